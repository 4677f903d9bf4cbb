"""vLLM's bad_words on the executor: the logits rule against a per-row reference (random
cases, verify rows' drafts included), greedy tokens against transformers' generate with an
output-only bad-words processor on the tiny Llama through chunks, a recompute and penalties,
and the plan check's rules for the words and the token ids they need."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.penalties import TokenHistory, apply_bad_words
from executor_svc.sampler import SamplingSpec, sample
from tests.executor_svc.test_penalties import _decode, assert_refused
from tests.executor_svc.test_runner import entry as _entry
from tests.hf_reference import PENALTIES, hf_greedy

VOCAB = 12
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=6)


def _reference(row: torch.Tensor, words: list[list[int]], output: list[int]) -> torch.Tensor:
    """vLLM's rule, word by word: ban the last token where the output ends with the others."""
    out = row.clone()
    for w in words:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1 :] == w[:-1]):
            out[w[-1]] = float("-inf")
    return out


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    rows=st.lists(
        st.tuples(tokens, tokens, st.lists(tokens.filter(bool), min_size=1, max_size=4)), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
)
def test_banned_tokens_equal_the_per_word_rule(rows, seed):
    """Each row: (output so far, drafts before the row, bad words); the output may end inside
    a word, the drafts may complete its prefix, a word may repeat a token."""
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    want = torch.stack([_reference(logits[r], words, out + extra) for r, (out, extra, words) in enumerate(rows)])
    got = logits.clone()
    apply_bad_words(
        got,
        {r: (tuple(map(tuple, words)), TokenHistory([1], out), extra) for r, (out, extra, words) in enumerate(rows)},
    )
    assert torch.equal(got, want)


def test_bad_words_come_before_the_bias_and_leave_logprobs_raw():
    """A banned token stays banned whatever bias it gets (vLLM's order: allowed ids, bad words,
    logit bias, penalties); the reported logprob is the model's own."""
    from executor_svc.penalties import LogitBias

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5]])
    spec = SamplingSpec(
        temperature=0, num_logprobs=2, bad_words=((0,), (3, 1)), logit_bias=LogitBias.of({0: 100.0, 1: 5.0})
    )
    history = TokenHistory([2], [3])  # the output ends with 3: (3, 1) bans 1
    out = sample(logits, [spec], [2], histories={0: (history, [])})
    assert out.token_ids == [2]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())
    assert [t for t, _ in out.top[0]] == [0, 1]  # raw: the banned ones are still the model's top


def _greedy(words=(), **penalties):
    return epb.SamplingParams(
        temperature=0.0, top_p=1.0, num_logprobs=-1, bad_words=[epb.BadWord(token_ids=w) for w in words], **penalties
    )


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalized"])
@pytest.mark.parametrize("kind", ["one-token", "two-token"])
def test_greedy_tokens_equal_transformers_through_chunks_and_a_recompute(tiny, penalties, kind):
    """A bad word taken from the plain greedy output so it bites (its 4th token; or its 4th and
    5th, banning the 5th after the 4th), beside one that starts on the prompt's last token (no
    ban: only the output counts): a prompt in chunks of 4 and 6, decodes, a recompute that sends
    the output so far, more decodes; every token equals transformers' generate with the same
    words (output only)."""
    hf, loaded, _ = tiny
    runner = loaded.runner
    runner.reset()
    prompt = [5, 9, 5, 17, 5, 30, 9, 2, 44, 5]
    plain = hf_greedy(hf, prompt, 12, **penalties)
    bites = (plain[3],) if kind == "one-token" else (plain[3], plain[4])
    words = (bites, (prompt[-1], plain[0]))
    want = hf_greedy(hf, prompt, 12, bad_words=words, **penalties)
    at = len(bites) + 2
    assert want[:at] == plain[:at] and want[at] != plain[at], "the word bites elsewhere: a weak test"
    blocks = list(range(16))
    new = epb.NewSequence(seq_id=1, sampling=_greedy(words, **penalties), prompt_token_ids=prompt)
    runner.execute(epb.StepRequest(step_id=1, new_seqs=[new], seqs=[_entry(1, 0, 4, prompt[:4], blocks)]))
    r = runner.execute(epb.StepRequest(step_id=2, seqs=[_entry(1, 4, 6, prompt[4:], sample=True)]))
    got = [r.sampled[0].token_id] + _decode(runner, 1, 5, 3)
    assert got == want[:6]
    known = prompt + got
    again = epb.NewSequence(
        seq_id=1, sampling=_greedy(words, **penalties), prompt_token_ids=prompt, output_token_ids=got[:-1]
    )
    runner.execute(
        epb.StepRequest(
            step_id=10, finished_seq_ids=[1], new_seqs=[again], seqs=[_entry(1, 0, len(known) - 1, known[:-1], blocks)]
        )
    )
    r = runner.execute(epb.StepRequest(step_id=11, seqs=[_entry(1, len(known) - 1, 1, [known[-1]], sample=True)]))
    got += [r.sampled[0].token_id] + _decode(runner, 1, 5, 12)
    assert got == want


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (dict(sampling=_greedy([[3]])), "needs its prompt_token_ids"),
        (dict(sampling=_greedy([[3, 500]]), prompt_token_ids=[1]), "bad_words: id 500"),
        (dict(sampling=_greedy([[]]), prompt_token_ids=[1]), "at least one token id"),
    ],
)
def test_the_plan_check_refuses_bad_words_it_cannot_use(tiny, new, message):
    assert_refused(tiny[1].runner, new, message)
