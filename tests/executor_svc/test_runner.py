"""The executor's runner on a tiny random Llama: plans in, tokens out, bad plans refused."""

from __future__ import annotations

import json
import time

import pytest
import torch

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.config import ExecutorConfig
from executor_svc.plan_check import PlanError
from executor_svc.worker import load

GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)


def hf_greedy(hf, prompt, n):
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def entry(seq_id, computed, n, tokens=(), blocks=(), sample=False):
    return epb.ScheduledSequence(
        seq_id=seq_id,
        num_computed_tokens=computed,
        num_new_tokens=n,
        token_ids=list(tokens),
        block_ids=list(blocks),
        sample=sample,
    )


def test_handshake_describes_model_and_cache(tiny):
    _, loaded, path = tiny
    hs = loaded.handshake
    assert hs.model.architecture == "LlamaForCausalLM" and hs.model.vocab_size == 128
    assert hs.model.num_kv_heads == 2 and hs.model.head_dim == 16 and hs.model.num_layers == 2
    assert hs.num_device_blocks == 32 and hs.block_size == 4 and hs.dtype == "float32"
    assert hs.model_path == str(path)


def test_chunked_prefill_then_decode_equals_transformers(tiny):
    hf, loaded, _ = tiny
    runner = loaded.runner
    runner.reset()
    a, b = list(range(3, 13)), list(range(40, 47))
    # Step 1: a's first chunk (4 tokens) and all of b (7 tokens) in one batch.
    r = runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[epb.NewSequence(seq_id=1, sampling=GREEDY), epb.NewSequence(seq_id=2, sampling=GREEDY)],
            seqs=[entry(1, 0, 4, a[:4], [9]), entry(2, 0, 7, b, [30, 2], True)],
        )
    )
    got = {1: [], 2: [s.token_id for s in r.sampled]}
    # Step 2: b decodes (no token id: fed back) while a prefills the rest.
    r = runner.execute(
        epb.StepRequest(
            step_id=2, seqs=[entry(2, 7, 1, blocks=[17], sample=True), entry(1, 4, 6, a[4:], [5, 21], True)]
        )
    )
    for s in r.sampled:
        got[s.seq_id].append(s.token_id)
    free = [24, 8, 31, 0, 13]
    for step in range(3, 8):
        seqs = []
        for sid, computed in ((1, 10 + step - 3), (2, 8 + step - 3)):
            new_block = [free.pop()] if computed % 4 == 0 else []
            seqs.append(entry(sid, computed, 1, blocks=new_block, sample=True))
        r = runner.execute(epb.StepRequest(step_id=step, seqs=seqs))
        for s in r.sampled:
            got[s.seq_id].append(s.token_id)
    assert got[1] == hf_greedy(hf, a, 6)
    assert got[2] == hf_greedy(hf, b, 7)  # 1 + 1 + 5


def test_logprobs_are_log_softmax_of_the_logits(tiny):
    hf, loaded, _ = tiny
    loaded.runner.reset()
    params = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=3)
    prompt = [5, 6, 7, 8, 9]
    before = time.time_ns()
    r = loaded.runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[epb.NewSequence(seq_id=3, sampling=params)],
            seqs=[entry(3, 0, 5, prompt, [0, 1], True)],
        )
    )
    assert before <= r.start_unix_ns <= time.time_ns()  # the executor's wall clock, for idle time
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    s = r.sampled[0]
    assert s.token_id == int(ref.argmax())
    assert s.logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert [t.token_id for t in s.top] == ref.topk(3).indices.tolist()
    assert r.execute_ns >= r.forward_ns > 0 and r.num_tokens == 5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: epb.StepRequest(step_id=9, seqs=[entry(77, 0, 1, [1], [0])]), "unknown sequence"),
        (lambda: epb.StepRequest(step_id=9, seqs=[entry(8, 5, 1, [1], [])]), "computed tokens"),
        (lambda: epb.StepRequest(step_id=9, seqs=[entry(6, 4, 1, [1], [])]), "twice"),
        (
            lambda: epb.StepRequest(
                step_id=9, new_seqs=[epb.NewSequence(seq_id=5, sampling=GREEDY)], seqs=[entry(5, 0, 2, [1, 2], [99])]
            ),
            "block id 99",
        ),
        (
            lambda: epb.StepRequest(
                step_id=9, new_seqs=[epb.NewSequence(seq_id=5, sampling=GREEDY)], seqs=[entry(5, 0, 1, [], [0])]
            ),
            "no token ids",
        ),
        (
            lambda: epb.StepRequest(
                step_id=9, new_seqs=[epb.NewSequence(seq_id=5, sampling=GREEDY)], seqs=[entry(5, 0, 6, range(6), [0])]
            ),
            "cannot hold",
        ),
        (
            lambda: epb.StepRequest(
                step_id=9, new_seqs=[epb.NewSequence(seq_id=5, sampling=GREEDY)], seqs=[entry(5, 0, 2, [1, 500], [0])]
            ),
            "vocab",
        ),
        (
            lambda: epb.StepRequest(
                step_id=9,
                new_seqs=[epb.NewSequence(seq_id=5, sampling=GREEDY)],
                seqs=[entry(5, 0, 65, range(65), range(17))],
            ),
            "max_num_batched_tokens",
        ),
    ],
)
def test_malformed_plans_are_refused(tiny, make, message):
    runner = tiny[1].runner
    runner.reset()
    runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[epb.NewSequence(seq_id=6, sampling=GREEDY), epb.NewSequence(seq_id=8, sampling=GREEDY)],
            seqs=[entry(6, 0, 3, [1, 2, 3], [4], True), entry(8, 0, 3, [1, 2, 3], [5])],
        )
    )
    with pytest.raises(PlanError, match=message):
        # A valid entry first: a refused plan must not move its state either.
        plan = make()
        plan.seqs.insert(0, entry(6, 3, 1, blocks=[7], sample=True))
        runner.execute(plan)
    state = runner.seqs[6]
    assert state.num_computed_tokens == 3 and state.block_table == [4]


def test_unsupported_architecture_is_refused_at_load(tiny, tmp_path):
    _, _, path = tiny
    for f in path.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load(ExecutorConfig(model=str(tmp_path), dtype="float32", cache_dir=str(tmp_path / "cache")))
