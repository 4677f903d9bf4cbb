"""Structured output on the executor: the plan's token mask rows (plan_check.py rules) and the
sampler applying them before greedy, temperature, top-k/p, min-p and logprobs alike."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from chunkserve.launch import tiny_llama_config
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.config import ExecutorConfig
from executor_svc.plan_check import PlanError, SeqState, check_plan
from executor_svc.sampler import SamplingSpec, apply_token_masks, sample
from executor_svc.worker import load

V = 100  # not a multiple of 32: the last word has 28 bits past the vocabulary


def pack(allowed: set[int], vocab: int = V) -> bytes:
    """The packed row of an allowed set: ceil(vocab / 32) little-endian int32 words."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_packing_is_word_little_endian_bit_per_token():
    row = pack({0, 33, 99})
    assert len(row) == 16
    assert row[0] == 1 and row[4] == 2 and row[12] == 1 << 3  # token 99 = word 3, bit 3
    logits = torch.zeros(1, V)
    masked = apply_token_masks(logits, {0: row})
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 33, 99]
    assert torch.isfinite(logits).all()  # a new tensor: the model's logits are left as they are


def test_a_mask_comes_before_greedy_and_every_filter():
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    best = int(logits[0].argmax())
    allowed = {t for t in range(V) if t != best and t % 3 == 0}
    row = pack(allowed)
    specs = [
        SamplingSpec(temperature=0.0),
        SamplingSpec(temperature=1.0, seed=1),
        SamplingSpec(temperature=0.7, top_k=5, seed=2),
        SamplingSpec(temperature=1.0, top_p=0.5, seed=3),
        SamplingSpec(temperature=1.0, min_p=0.2, seed=4),
        SamplingSpec(temperature=0.0, num_logprobs=3),
    ]
    for trial in range(20):
        out = sample(logits.clone(), specs, [trial] * 6, {i: row for i in range(6)})
        assert all(t in allowed for t in out.token_ids), out.token_ids
    greedy = sample(logits[:1].clone(), specs[:1], [0], {0: row}).token_ids[0]
    assert greedy == max(allowed, key=lambda t: float(logits[0, t]))
    out = sample(logits[5:].clone(), specs[5:], [0], {0: row})
    masked = logits[5].clone()
    masked[[t for t in range(V) if t not in allowed]] = -math.inf
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(masked, -1).max()), abs=1e-5)
    assert [t for t, _ in out.top[0]] == masked.topk(3).indices.tolist()


def test_only_masked_rows_change_and_forbidden_tokens_never_show_as_alternatives():
    logits = torch.randn(3, V)
    before = logits.clone()
    specs = [SamplingSpec(temperature=0.0, num_logprobs=5)] * 3
    out = sample(logits, specs, [0, 0, 0], {1: pack({7, 8})})
    masked = apply_token_masks(logits, {1: pack({7, 8})})
    assert torch.equal(masked[0], before[0]) and torch.equal(masked[2], before[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [7, 8]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(before[0], -1).max()), abs=1e-5)
    assert out.token_ids[0] == int(before[0].argmax()) and out.token_ids[2] == int(before[2].argmax())
    assert out.token_ids[1] in (7, 8)
    assert sorted(t for t, _ in out.top[1]) == [7, 8]  # 5 asked, 2 allowed: no -inf entries
    assert len(out.top[0]) == 5


def test_transposed_logits_are_masked_like_contiguous_ones():
    """On CPU compute_logits returns a transposed view: masked like a contiguous one."""
    base = torch.randn(V, 4)
    logits = base.t()  # [4, V], not contiguous
    row = pack({3, 50})
    out = sample(logits, [SamplingSpec(temperature=0.0)] * 4, [0] * 4, {2: row})
    assert out.token_ids[2] in (3, 50)


def test_no_mask_no_change():
    logits = torch.randn(4, V)
    specs = [SamplingSpec(temperature=0.0)] * 4
    assert sample(logits.clone(), specs, [0] * 4).token_ids == sample(logits.clone(), specs, [0] * 4, {}).token_ids


# ---- the plan contract ---------------------------------------------------------------------


class _State:
    """The little of a runner check_plan reads."""

    def __init__(self, vocab: int = V) -> None:
        self.seqs = {1: SeqState(SamplingSpec(temperature=0.0), [0], num_computed_tokens=2, last_token=5)}
        self.holders = [1] + [0] * 7
        self.num_blocks, self.num_host_blocks, self.block_size = 8, 0, 4
        self.max_num_batched_tokens, self.max_model_len, self.vocab_size = 64, 32, vocab


def _plan(*masks, n=2, sample=True):
    return epb.StepRequest(
        step_id=9,
        seqs=[
            epb.ScheduledSequence(
                seq_id=1,
                num_computed_tokens=2,
                num_new_tokens=n,
                token_ids=[1] * n,
                block_ids=[1] if n > 2 else [],
                sample=sample,
                token_masks=[epb.TokenMask(position=p, bits=b) for p, b in masks],
            )
        ],
    )


def test_plan_check_takes_a_valid_row_for_the_sampled_position():
    c = check_plan(_plan((1, pack({4}))), _State())
    assert c.masks == {0: pack({4})} and c.sampling == [(0, 4)]
    assert check_plan(_plan(), _State()).masks == {}


@pytest.mark.parametrize(
    "masks, kwargs, message",
    [
        ([(1, pack({4}))], dict(sample=False), "does not sample"),
        ([(0, pack({4}))], {}, r"positions \[0\]"),
        ([(0, pack({4})), (1, pack({4}))], {}, r"positions \[0, 1\]"),
        ([(1, pack({4})[:-4])], {}, "12 bytes; vocab size 100 needs 16"),
        ([(1, pack({4}) + b"\0\0\0\0")], {}, "20 bytes"),
        ([(1, pack(set()))], {}, "allows no token"),
        ([(1, pack({100}, vocab=128))], {}, "at or past vocab size 100"),
    ],
)
def test_plan_check_refuses_bad_rows(masks, kwargs, message):
    with pytest.raises(PlanError, match=message):
        check_plan(_plan(*masks, **kwargs), _State())


# ---- through the runner --------------------------------------------------------------------


def test_the_runner_samples_inside_the_mask(tmp_path):
    """A real (tiny) model: the masked sequence's greedy token is the best allowed one, the
    unmasked neighbour's is unchanged, and the decode after it is masked too."""
    vocab = 128
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=vocab, max_position_embeddings=64)).save_pretrained(
        tmp_path
    )
    cfg = ExecutorConfig(
        model=str(tmp_path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=16,
        max_num_batched_tokens=32,
        cache_dir=str(tmp_path / "cache"),
    )
    runner = load(cfg).runner
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    prompt = [5, 9, 14, 3, 7]

    def step(step_id, masks):
        seqs = [
            epb.ScheduledSequence(
                seq_id=s,
                num_computed_tokens=0,
                num_new_tokens=5,
                token_ids=prompt,
                block_ids=[2 * s, 2 * s + 1],
                sample=True,
                token_masks=masks.get(s, []),
            )
            for s in (1, 2)
        ]
        new = [epb.NewSequence(seq_id=s, sampling=greedy) for s in (1, 2)]
        return runner.execute(epb.StepRequest(step_id=step_id, new_seqs=new, seqs=seqs))

    free = {s.seq_id: s.token_id for s in step(1, {}).sampled}
    assert free[1] == free[2]
    runner.reset()
    allowed = {t for t in range(vocab) if t % 5 == 1 and t != free[1]}
    out = {s.seq_id: s.token_id for s in step(2, {1: [epb.TokenMask(position=4, bits=pack(allowed, vocab))]}).sampled}
    assert out[2] == free[2] and out[1] in allowed
    decode = epb.StepRequest(
        step_id=3,
        seqs=[
            epb.ScheduledSequence(
                seq_id=1,
                num_computed_tokens=5,
                num_new_tokens=1,
                sample=True,
                token_masks=[epb.TokenMask(position=0, bits=pack({42}, vocab))],
            )
        ],
    )
    assert [s.token_id for s in runner.execute(decode).sampled] == [42]
