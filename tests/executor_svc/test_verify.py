"""Verify steps (speculative decoding, issue 34) on the executor: a decode with draft tokens
keeps the longest prefix of drafts equal to what its rows sample plus the token after it, so
its tokens are plain decoding's, greedy or seeded; rejected drafts roll the cursor back; the
plan check refuses drafts it cannot verify."""

from __future__ import annotations

import pytest

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.plan_check import PlanError

# Strong enough that a verify row which does not count the drafts before it picks another
# token on this model (a runner counting none fails both cases below).
STRONG = {"repetition_penalty": 2.0, "frequency_penalty": 1.5, "presence_penalty": 0.5}

GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
PROMPT = [3, 17, 9, 44, 23, 8, 61, 5, 12, 30]
BLOCKS = list(range(16))  # 64 slots of 4: room for any run here


@pytest.fixture(scope="module")
def runner(tiny):
    """The runner tests' tiny random Llama (conftest.py): block size 4, 32 blocks."""
    return tiny[1].runner


def _start(runner, sampling=GREEDY, seq_id=1):
    """Prefills PROMPT; returns the first sampled token."""
    runner.reset()
    r = runner.execute(
        epb.StepRequest(
            step_id=1,
            new_seqs=[epb.NewSequence(seq_id=seq_id, sampling=sampling, prompt_token_ids=_history(sampling))],
            seqs=[
                epb.ScheduledSequence(
                    seq_id=seq_id,
                    num_computed_tokens=0,
                    num_new_tokens=len(PROMPT),
                    token_ids=PROMPT,
                    block_ids=BLOCKS,
                    sample=True,
                )
            ],
        )
    )
    return r.sampled[0].token_id


def _history(sampling: epb.SamplingParams) -> list[int]:
    """A penalized sequence comes with its prompt's ids (executor_svc/penalties.py)."""
    penalized = sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty not in (0, 1)
    return PROMPT if penalized else []


def _decode(runner, n, sampling=GREEDY):
    """Plain decoding: n tokens after the prompt, one step each."""
    out = [_start(runner, sampling)]
    for step in range(n - 1):
        c = runner.seqs[1].num_computed_tokens
        r = runner.execute(
            epb.StepRequest(
                step_id=2 + step,
                seqs=[epb.ScheduledSequence(seq_id=1, num_computed_tokens=c, num_new_tokens=1, sample=True)],
            )
        )
        out.append(r.sampled[0].token_id)
    return out


def _verify_step(runner, step, draft, masks=()):
    """One verify step of sequence 1 from its cursor: its last token and `draft`."""
    c = runner.seqs[1].num_computed_tokens
    entry = epb.ScheduledSequence(
        seq_id=1, num_computed_tokens=c, num_new_tokens=1 + len(draft), sample=True, draft_token_ids=draft
    )
    entry.token_masks.extend(masks)
    return runner.execute(epb.StepRequest(step_id=step, seqs=[entry]))


def _speculate(runner, n, guess, sampling=GREEDY, k=3):
    """Decoding with verify steps whose drafts come from guess(tokens so far, k); returns the
    tokens and the kept-draft count per step."""
    out, kept = [_start(runner, sampling)], []
    step = 2
    while len(out) < n:
        c = runner.seqs[1].num_computed_tokens
        assert c == len(PROMPT) + len(out) - 1  # the cursor: every kept token but the last
        draft = guess(out, k)
        r = _verify_step(runner, step, draft)
        got = [s.token_id for s in r.sampled]
        assert 1 <= len(got) <= len(draft) + 1 and got[:-1] == draft[: len(got) - 1]
        kept.append(len(got) - 1)
        out += got
        step += 1
    return out[:n], kept


N = 16


def test_greedy_with_right_wrong_and_mixed_drafts_equals_plain_decoding(runner):
    plain = _decode(runner, N + 8)
    right = lambda out, k: plain[len(out) : len(out) + k]  # noqa: E731
    wrong = lambda out, k: [(t + 1) % 128 for t in plain[len(out) : len(out) + k]]  # noqa: E731
    mixed = lambda out, k: right(out, k)[:2] + wrong(out, k)[2:]  # noqa: E731
    got, kept = _speculate(runner, N, right)
    assert got == plain[:N] and max(kept) == 3  # every draft accepted
    got, kept = _speculate(runner, N, wrong)
    assert got == plain[:N] and set(kept) == {0}
    got, kept = _speculate(runner, N, mixed)
    assert got == plain[:N] and 2 in kept
    got, _ = _speculate(runner, N, right, k=7)
    assert got == plain[:N]


@pytest.mark.parametrize("seed", [None, 3])
def test_penalized_tokens_with_drafts_equal_plain_decoding(runner, seed):
    """Row j of a verify entry counts the first j drafts as output, the tokens plain decoding
    holds there: greedy and seeded, right, wrong and mixed drafts give plain decoding's tokens."""
    sampling = epb.SamplingParams(
        temperature=0.0 if seed is None else 0.9,
        top_p=1.0,
        num_logprobs=-1,
        has_seed=seed is not None,
        seed=seed or 0,
        **STRONG,
    )
    plain = _decode(runner, N + 8, sampling)
    if seed is None:
        assert plain[:N] != _decode(runner, N), "the penalties change nothing here: a weak test"
    right = lambda out, k: plain[len(out) : len(out) + k]  # noqa: E731
    wrong = lambda out, k: [(t + 1) % 128 for t in plain[len(out) : len(out) + k]]  # noqa: E731
    mixed = lambda out, k: right(out, k)[:2] + wrong(out, k)[2:]  # noqa: E731
    for guess in (right, wrong, mixed):
        got, kept = _speculate(runner, N, guess, sampling)
        assert got == plain[:N]
        assert (max(kept) == 3) if guess is right else True


def test_seeded_sampling_with_drafts_gives_the_same_tokens(runner):
    """Each row draws with its (seed, position) uniform, as plain sampling does: a draft of the
    very tokens plain sampling drew is accepted, a wrong one rejected, and the tokens are the
    same either way. Over many seeds this is the distribution argument of docs/speculative.md."""
    for seed in range(12):
        sampling = epb.SamplingParams(temperature=1.3, top_p=0.95, top_k=40, has_seed=True, seed=seed, num_logprobs=-1)
        plain = _decode(runner, N + 8, sampling)
        got, kept = _speculate(runner, N, lambda out, k, p=plain: p[len(out) : len(out) + k], sampling)
        assert got == plain[:N] and max(kept) > 0
        greedy_guess = _decode(runner, N + 8)
        got, _ = _speculate(runner, N, lambda out, k, g=greedy_guess: g[len(out) : len(out) + k], sampling)
        assert got == plain[:N]


def test_logprobs_of_each_kept_token(runner):
    params = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=2)
    first = _start(runner, params)
    plain = _decode(runner, 6)
    _start(runner, params)
    r = _verify_step(runner, 2, plain[1:4])
    assert first == plain[0] and [s.token_id for s in r.sampled] == plain[1:5]
    for s in r.sampled:
        assert s.logprob <= 0 and len(s.top) == 2 and s.top[0].token_id == s.token_id


def _plan(**fields):
    defaults = dict(seq_id=1, num_computed_tokens=len(PROMPT), num_new_tokens=3, sample=True, draft_token_ids=[1, 2])
    return epb.StepRequest(step_id=9, seqs=[epb.ScheduledSequence(**(defaults | fields))])


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(sample=False), "need a chunk that samples"),
        (dict(num_new_tokens=2), "need a chunk that samples"),
        (dict(draft_token_ids=[1, 500]), "draft token id 500"),
        (dict(num_new_tokens=3, token_ids=[4, 5]), "2 token ids for 1 new tokens"),
        (dict(token_masks=[epb.TokenMask(position=0, bits=b"\xff" * 16)] * 2), "token mask positions"),
        (dict(num_new_tokens=57, draft_token_ids=[1] * 56), "blocks cannot hold"),
    ],
)
def test_the_plan_check_refuses_drafts_it_cannot_verify(runner, fields, message):
    _start(runner)
    before = runner.seqs[1].num_computed_tokens
    with pytest.raises(PlanError, match=message):
        runner.execute(_plan(**fields))
    assert runner.seqs[1].num_computed_tokens == before  # a refused plan changed nothing


def test_mask_rows_at_draft_positions_constrain_those_rows(runner):
    """One mask row per draft position: a row allowed a single token samples it."""
    plain = _decode(runner, 6)
    _start(runner)
    words = (128 + 31) // 32
    only = lambda t: bytes(  # noqa: E731
        b for w in range(words) for b in ((1 << (t - 32 * w)) if 32 * w <= t < 32 * w + 32 else 0).to_bytes(4, "little")
    )
    forced = (plain[2] + 5) % 128  # at the row that checks the second draft: not the model's pick
    r = _verify_step(runner, 2, plain[1:3], [epb.TokenMask(position=1, bits=only(forced))])
    assert [s.token_id for s in r.sampled] == [plain[1], forced]  # draft 2 rejected by the mask's row
