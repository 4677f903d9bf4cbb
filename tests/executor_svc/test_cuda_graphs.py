"""Decode steps through DecodeGraphs' padded static buffers (executor_svc/cuda_graphs.py).

No GPU here: `capture=False` runs the same padded forward eagerly, so what the CUDA path adds
on top of it is only capture and replay (tests/kernels/test_gpu.py). What is checked here:
buckets, padding rows that write nothing but the scratch block, block tables written into
the static buffer, and the same tokens, log-probabilities and KV as the plain path.
"""

from __future__ import annotations

import pytest
import torch

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_kernels.backend import get_backend
from executor_svc.collectives import NO_TP
from executor_svc.config import ExecutorConfig
from executor_svc.cuda_graphs import DecodeGraphs, capture_sizes
from executor_svc.plan_check import PlanError
from executor_svc.runner import ModelRunner
from executor_svc.worker import load, use_cuda_graphs

BLOCK, BLOCKS, PER_SEQ = 4, 32, 6  # each test sequence owns PER_SEQ blocks: up to 24 tokens
SAMPLING = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=3)


@pytest.fixture
def model(tmp_path, tiny_configs, hf_model_factory):
    """The executor's model of conftest's tiny random Llama, loaded as the server loads it."""
    path = tmp_path / "tiny"
    hf_model_factory(tiny_configs["llama"](), seed=1).save_pretrained(path)
    cfg = ExecutorConfig(
        model=str(path),
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=BLOCKS,
        swap_space=0,
        cache_dir=str(path / "cache"),
        cpu_linear_plan="table",
    )
    return load(cfg).runner.model


def runners(model, sizes):
    """A plain runner, and one whose decode steps go through DecodeGraphs (one block more)."""
    like = dict(dtype=torch.float32)
    shape = (2, 2, BLOCKS, BLOCK, 2, 16)
    plain = ModelRunner(model, torch.zeros(shape, **like), None, 128, 64, 64)
    kv = torch.zeros(shape[:2] + (BLOCKS + 1,) + shape[3:], **like)
    kv[:, :, BLOCKS] = float("nan")  # the scratch block: whatever the padding reads there, it stays there
    graphed = ModelRunner(model, kv, None, 128, 64, 64, reserved_blocks=1)
    graphed.graphs = DecodeGraphs(model, kv, 64, BLOCKS, sizes, capture=False)
    return plain, graphed


def prefill(seq_ids, prompts, step_id=0):
    return epb.StepRequest(
        step_id=step_id,
        new_seqs=[epb.NewSequence(seq_id=s, sampling=SAMPLING) for s in seq_ids],
        seqs=[
            epb.ScheduledSequence(
                seq_id=s,
                num_computed_tokens=0,
                num_new_tokens=len(p),
                token_ids=p,
                block_ids=list(range(s * PER_SEQ, (s + 1) * PER_SEQ)),
                sample=True,
            )
            for s, p in zip(seq_ids, prompts)
        ],
    )


def decode(step_id, computed: dict[int, int], finished=()):
    return epb.StepRequest(
        step_id=step_id,
        seqs=[
            epb.ScheduledSequence(seq_id=s, num_computed_tokens=c, num_new_tokens=1, sample=True)
            for s, c in computed.items()
        ],
        finished_seq_ids=list(finished),
    )


def same(a: epb.StepResponse, b: epb.StepResponse) -> None:
    assert [(s.seq_id, s.token_id) for s in a.sampled] == [(s.seq_id, s.token_id) for s in b.sampled]
    for x, y in zip(a.sampled, b.sampled):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top]


def test_capture_sizes_pad_by_less_than_half_beyond_sixteen():
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert capture_sizes(100)[-2:] == [96, 100] and capture_sizes(1) == [1]
    for n in range(1, 257):
        b = next(s for s in capture_sizes(256) if s >= n)
        assert b < 2 * n and (n <= 16 or b < 1.5 * n)
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_decodes_give_the_plain_tokens_and_kv(model):
    """Five sequences prefilled, then decode steps of 5, 4, 3, 1 sequences (buckets 8, 4, 4,
    1: padding rows of 3, 0, 1, 0) and one of 5 over the largest bucket 4 (eager): the same
    tokens and log-probabilities as the plain runner, the same KV in every real block, and
    the scratch block is the only one the padding touched."""
    plain, graphed = runners(model, capture_sizes(4))
    prompts = [[(7 * s + j) % 120 + 3 for j in range(3 + 2 * s)] for s in range(5)]
    step = prefill(list(range(5)), prompts)
    a, b = plain.execute(step), graphed.execute(step)
    same(a, b)
    assert graphed.graphs.replays == 0  # a prefill runs as before
    computed = {s: len(p) for s, p in enumerate(prompts)}
    step_id = 1
    for live, finished in (([0, 1, 2, 3, 4], ()), ([0, 1, 3, 4], (2,)), ([0, 3, 4], (1,)), ([4], (0, 3))):
        for _ in range(3):
            plan = decode(step_id, {s: computed[s] for s in live}, finished)
            finished = ()
            before = graphed.graphs.replays
            same(plain.execute(plan), graphed.execute(plan))
            assert graphed.graphs.replays == before + (len(live) <= 4)
            for s in live:
                computed[s] += 1
            step_id += 1
    real = slice(0, BLOCKS)
    torch.testing.assert_close(graphed.kv_cache[:, :, real], plain.kv_cache[:, :, real], rtol=1e-5, atol=1e-5)
    assert graphed.graphs.replays == 9


def test_a_step_with_a_prefill_runs_eagerly_and_the_scratch_block_is_not_the_plans(model):
    plain, graphed = runners(model, [1, 2])
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    same(plain.execute(prefill([0], prompts[:1])), graphed.execute(prefill([0], prompts[:1])))
    mixed = epb.StepRequest(
        step_id=1,
        new_seqs=[epb.NewSequence(seq_id=1, sampling=SAMPLING)],
        seqs=[
            epb.ScheduledSequence(seq_id=0, num_computed_tokens=3, num_new_tokens=1, sample=True),
            epb.ScheduledSequence(
                seq_id=1, num_computed_tokens=0, num_new_tokens=4, token_ids=prompts[1], block_ids=[6, 7], sample=True
            ),
        ],
    )
    same(plain.execute(mixed), graphed.execute(mixed))
    assert graphed.graphs.replays == 0
    assert graphed.num_blocks == BLOCKS
    bad = epb.StepRequest(
        step_id=2,
        new_seqs=[epb.NewSequence(seq_id=2, sampling=SAMPLING)],
        seqs=[
            epb.ScheduledSequence(seq_id=2, num_computed_tokens=0, num_new_tokens=1, token_ids=[4], block_ids=[BLOCKS])
        ],
    )
    with pytest.raises(PlanError, match="device blocks"):
        graphed.execute(bad)


def test_cuda_graphs_stay_off_on_cpu(tmp_path):
    """--cuda-graphs defaults on, and does nothing without CUDA: no scratch block, no graphs."""
    assert ExecutorConfig().cuda_graphs
    assert not use_cuda_graphs(ExecutorConfig(), torch.device("cpu"), get_backend("triton"), NO_TP)
    with pytest.raises(ValueError, match="cuda-graph-max-batch"):
        ExecutorConfig(cuda_graph_max_batch=0)
