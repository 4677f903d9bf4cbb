"""Presence, frequency and repetition penalties on the executor: the logits rule against a
per-token reference (random cases), greedy tokens against transformers' generate on the tiny
Llama across chunked prefill, a recompute that re-sends the sequence's tokens and a prefix
start, and the plan check's rules for the token ids a penalized sequence comes with."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.penalties import LogitBias, Penalties, TokenHistory, apply_penalties
from executor_svc.plan_check import PlanError
from executor_svc.sampler import SamplingSpec, sample
from tests.executor_svc.test_runner import entry as _entry
from tests.hf_reference import PENALTIES, hf_greedy

VOCAB = 40
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)
factor = st.floats(-2, 2, width=32)


def _reference(row: np.ndarray, p: Penalties, prompt: list[int], output: list[int]) -> np.ndarray:
    """vLLM's rule, one token at a time, in float32."""
    out = row.astype(np.float32).copy()
    rep, freq, pres = np.float32(p.repetition), np.float32(p.frequency), np.float32(p.presence)
    for t in range(len(out)):
        count = output.count(t)
        if t in prompt or count:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] = out[t] - freq * np.float32(count)
        out[t] = out[t] - pres * np.float32(count > 0)
    return out


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    rows=st.lists(
        st.tuples(tokens.filter(bool), tokens, tokens, factor, factor, st.floats(0.0625, 4, width=32), st.booleans()),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
)
def test_penalized_logits_equal_the_per_token_rule(rows, seed):
    """Any rows (some penalized, some not), any prompt/output/extra tokens: each penalized row
    equals the reference with `extra` counted as output; the others are untouched."""
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    logits[0, 0] = float("-inf")  # a token a grammar mask forbids stays forbidden
    chosen = {}
    for r, (prompt, output, extra, pres, freq, rep, on) in enumerate(rows):
        if on:
            chosen[r] = (Penalties(pres, freq, rep), TokenHistory(prompt, output), extra)
    if not chosen:
        return
    got = logits.clone()
    apply_penalties(got, chosen)
    for r, (prompt, output, extra, *_rest) in enumerate(rows):
        if r in chosen:
            want = _reference(logits[r].numpy(), chosen[r][0], prompt, output + extra)
            np.testing.assert_array_equal(got[r].numpy(), want)
        else:
            assert torch.equal(got[r], logits[r])
    assert got[0, 0] == float("-inf")


def test_penalties_steer_greedy_and_leave_logprobs_raw():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    history = TokenHistory([0], [])
    spec = SamplingSpec(temperature=0, num_logprobs=1, penalties=Penalties(repetition=1.25))
    out = sample(logits, [spec], [1], histories={0: (history, [])})
    assert out.token_ids == [1]  # 3.0 / 1.25 = 2.4 < 2.9
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs[0] == pytest.approx(raw[1].item()) and out.top[0][0][0] == 0  # the model's own
    # Negative penalties favour what the output holds: token 2 (logit 0, once in the output)
    history = TokenHistory([3], [2])
    spec = SamplingSpec(temperature=0, penalties=Penalties(presence=-2.0))
    assert sample(logits, [spec], [1], histories={0: (history, [])}).token_ids == [0]  # 0 + 2 < 3
    spec = SamplingSpec(temperature=0, penalties=Penalties(frequency=-1.0))
    history.add([2, 2, 2])
    assert sample(logits, [spec], [1], histories={0: (history, [])}).token_ids == [2]  # 0 + 4 * 1 > 3
    assert sample(logits, [spec], [1], histories={0: (TokenHistory([3], [2, 2]), [2])}).token_ids == [
        0
    ]  # 0 + 3 = 3: a tie, the first token wins (argmax)


@pytest.mark.parametrize("bad", [dict(repetition=0.0), dict(repetition=-1.0), dict(presence=float("nan"))])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(ValueError, match="penalty"):
        Penalties(**bad)


def _greedy(**penalties):
    return epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1, **penalties)


def _decode(runner, seq_id, n, step):
    """n single-token decode steps of one sequence (blocks 8.. are its own); returns tokens."""
    out = []
    for _ in range(n):
        r = runner.execute(
            epb.StepRequest(
                step_id=step, seqs=[_entry(seq_id, runner.seqs[seq_id].num_computed_tokens, 1, sample=True)]
            )
        )
        out.append(r.sampled[0].token_id)
        step += 1
    return out


def test_greedy_tokens_equal_transformers_through_chunks_and_a_recompute(tiny):
    """A 10-token prompt in chunks of 4 and 6 beside an unpenalized neighbour, decodes, then a
    recompute (the sequence dropped and sent again with its prompt and output so far, its KV
    recomputed in one chunk) and more decodes: every token equals transformers' generate with
    the same penalties, and the neighbour equals plain greedy."""
    hf, loaded, _ = tiny
    runner = loaded.runner
    runner.reset()
    prompt, other = [5, 9, 5, 17, 5, 30, 9, 2, 44, 5], [40, 41, 42]
    want = hf_greedy(hf, prompt, 12, **PENALTIES)
    assert want != hf_greedy(hf, prompt, 12), "the penalties change nothing on this prompt: a weak test"
    blocks = list(range(16))  # room for 64 tokens
    r = runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[
                epb.NewSequence(seq_id=1, sampling=_greedy(**PENALTIES), prompt_token_ids=prompt),
                epb.NewSequence(seq_id=2, sampling=_greedy()),
            ],
            seqs=[_entry(1, 0, 4, prompt[:4], blocks), _entry(2, 0, 3, other, [20, 21], True)],
        )
    )
    neighbour = [r.sampled[0].token_id]
    r = runner.execute(epb.StepRequest(step_id=2, seqs=[_entry(1, 4, 6, prompt[4:], sample=True)]))
    got = [r.sampled[0].token_id] + _decode(runner, 1, 5, 3)
    assert got == want[:6]
    # Recompute: dropped, then new again with everything it holds; its KV computed again.
    known = prompt + got
    r = runner.execute(
        epb.StepRequest(
            step_id=10,
            finished_seq_ids=[1],
            new_seqs=[
                epb.NewSequence(
                    seq_id=1, sampling=_greedy(**PENALTIES), prompt_token_ids=prompt, output_token_ids=got[:-1]
                )
            ],
            seqs=[_entry(1, 0, len(known) - 1, known[:-1], blocks[:8])],
        )
    )
    r = runner.execute(epb.StepRequest(step_id=11, seqs=[_entry(1, len(known) - 1, 1, [known[-1]], sample=True)]))
    got += [r.sampled[0].token_id] + _decode(runner, 1, 5, 12)
    assert got == want
    neighbour += _decode(runner, 2, 3, 20)
    assert neighbour == hf_greedy(hf, other, 4)


def test_a_sequence_that_starts_on_cached_blocks_counts_the_prompt_it_skipped(tiny):
    """A prefix-cache hit: the second sequence's first entry starts at 8 (the blocks the first
    one wrote), so its chunks never carry those 8 tokens; the NewSequence does, and the
    repetition penalty counts them (tokens equal transformers')."""
    hf, loaded, _ = tiny
    runner = loaded.runner
    runner.reset()
    shared, tail = [7, 7, 3, 7, 11, 3, 7, 60], [3, 7]
    runner.execute(
        epb.StepRequest(
            step_id=1, new_seqs=[epb.NewSequence(seq_id=1, sampling=_greedy())], seqs=[_entry(1, 0, 8, shared, [0, 1])]
        )
    )
    penalties = {"repetition_penalty": 1.25}
    r = runner.execute(
        epb.StepRequest(
            step_id=2,
            finished_seq_ids=[],
            new_seqs=[epb.NewSequence(seq_id=2, sampling=_greedy(**penalties), prompt_token_ids=shared + tail)],
            seqs=[_entry(2, 8, 2, tail, [0, 1, 2, 3, 4], True)],
        )
    )
    got = [r.sampled[0].token_id] + _decode(runner, 2, 7, 3)
    assert got == hf_greedy(hf, shared + tail, 8, **penalties)


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (dict(sampling=_greedy(presence_penalty=0.5)), "needs its prompt_token_ids"),
        (dict(sampling=_greedy(), prompt_token_ids=[1, 2]), "no penalty"),
        (dict(sampling=_greedy(frequency_penalty=1.0), prompt_token_ids=[1, 500]), "token id 500"),
        (dict(sampling=_greedy(repetition_penalty=-1.0), prompt_token_ids=[1]), "repetition_penalty must be > 0"),
    ],
)
def test_the_plan_check_refuses_penalty_token_ids_it_cannot_use(tiny, new, message):
    assert_refused(tiny[1].runner, new, message)


def assert_refused(runner, new: dict, message: str) -> None:
    """A plan whose one NewSequence (`new`: its fields) the check refuses with `message`,
    leaving the runner without the sequence."""
    runner.reset()
    plan = epb.StepRequest(step_id=1, new_seqs=[epb.NewSequence(seq_id=1, **new)], seqs=[_entry(1, 0, 2, [1, 2], [0])])
    with pytest.raises(PlanError, match=message):
        runner.execute(plan)
    assert not runner.seqs


def test_logit_bias_comes_before_the_penalties_and_leaves_logprobs_raw():
    """Token 0 (logit -1, in the prompt) with bias +2 and repetition 2: (-1 + 2) / 2 = 0.5 beats
    token 1's 0.25; the other order, -1 * 2 + 2 = 0, would not (vLLM's order: bias first)."""
    logits = torch.tensor([[-1.0, 0.25, -5.0]])
    spec = SamplingSpec(
        temperature=0, num_logprobs=0, penalties=Penalties(repetition=2.0), logit_bias=LogitBias.of({0: 2.0, 2: -100.0})
    )
    out = sample(logits, [spec], [1], histories={0: (TokenHistory([0], []), [])})
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    forced = SamplingSpec(temperature=0.7, seed=1, logit_bias=LogitBias.of({2: 100.0}))
    assert sample(logits.expand(8, -1), [forced] * 8, list(range(8))).token_ids == [2] * 8
    assert sample(logits, [SamplingSpec(temperature=0)], [1]).token_ids == [1]  # no bias: as it was


def test_a_logit_bias_outside_the_vocabulary_is_refused(tiny):
    runner = tiny[1].runner
    runner.reset()
    sampling = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1, logit_bias={500: 1.0})
    plan = epb.StepRequest(
        step_id=1, new_seqs=[epb.NewSequence(seq_id=1, sampling=sampling)], seqs=[_entry(1, 0, 2, [1, 2], [0])]
    )
    with pytest.raises(PlanError, match="logit_bias"):
        runner.execute(plan)
    assert not runner.seqs


def test_allowed_tokens_leave_only_those_and_logprobs_raw():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5], [3.0, 2.0, 1.0, 0.5]])
    only = SamplingSpec(temperature=0, num_logprobs=0, allowed=np.array([2, 3]))
    out = sample(logits, [only, SamplingSpec(temperature=0)], [1, 1])
    assert out.token_ids == [2, 0]  # the best allowed one; the other row untouched
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())
    drawn = sample(
        logits[:1].expand(16, -1), [SamplingSpec(temperature=5.0, allowed=np.array([3]))] * 16, list(range(16))
    )
    assert drawn.token_ids == [3] * 16
