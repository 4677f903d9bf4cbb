"""Prompt lookup: the incremental index proposes exactly what a scan of the whole history
would, and every proposal is what followed an earlier occurrence of the request's last tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.spec.ngram import NgramProposer, periodic_copy
from scheduler_svc.spec.proposer import Proposer


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)


def iterated_lookup(tokens: list[int], end: int, k: int) -> list[int]:
    """What the lookup proposes step after step when every drafted token is accepted: one
    token at a time, the n-gram ending at `end` matching again each time (the oracle of
    `periodic_copy`)."""
    history = list(tokens)
    out = []
    for _ in range(k):
        out.append(history[end])
        history.append(history[end])
        end += 1
    return out


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The oracle: for n from max down to min, scan the history backwards for the most recent
    earlier occurrence of the last n tokens that has a token after it; copy k tokens from it,
    one at a time as the lookup would if every one were accepted."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return iterated_lookup(tokens, end, k)
    return []


streams = st.lists(st.integers(0, 5), min_size=0, max_size=120)  # few symbols: many matches
chunks = st.lists(st.integers(1, 6), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(prompt=streams, output=streams, sizes=chunks, lo=st.integers(1, 4), span=st.integers(0, 3), k=st.integers(1, 8))
def test_incremental_index_equals_a_full_scan(prompt, output, sizes, lo, span, k):
    hi = lo + span
    proposer = NgramProposer(lo, hi)
    req = Req("r", prompt)
    history = list(prompt)
    i = 0
    assert proposer.propose(req, k) == brute_force_lookup(history, lo, hi, k)
    for size in sizes:  # tokens arrive in steps of several (accepted drafts + the bonus token)
        if i >= len(output):
            break
        new = output[i : i + size]
        i += size
        proposer.on_tokens(req, new)
        history += new
        assert proposer.propose(req, k) == brute_force_lookup(history, lo, hi, k)
    assert proposer.history(req) == history


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=200), lo=st.integers(1, 3), k=st.integers(1, 10))
def test_a_proposal_is_what_followed_an_earlier_occurrence(tokens, lo, k):
    hi = lo + 2
    proposer = NgramProposer(lo, hi)
    req = Req("r", tokens)
    draft = proposer.propose(req, k)
    if not draft:
        return
    assert 1 <= len(draft) <= k
    length = len(tokens)
    found = [
        n
        for n in range(lo, hi + 1)
        for end in range(n, length)
        if tokens[end - n : end] == tokens[length - n :] and iterated_lookup(tokens, end, len(draft)) == draft
    ]
    assert found, "the draft continues no earlier occurrence of the last n tokens"


def test_the_longest_window_wins_over_a_more_recent_shorter_one():
    # "1 2 3 9" long ago; "7 3 8" recently; the history ends "1 2 3": n=3 finds the old one.
    tokens = [1, 2, 3, 9, 5, 7, 3, 8, 6, 1, 2, 3]
    assert NgramProposer(1, 3).propose(Req("a", tokens), 2) == [9, 5]
    assert NgramProposer(1, 1).propose(Req("b", tokens), 2) == [8, 6]  # n=1: most recent "3"


def test_the_most_recent_occurrence_wins_and_a_copy_running_into_the_current_text_repeats():
    tokens = [4, 5, 1, 4, 5, 2, 4, 5]
    assert NgramProposer(2, 2).propose(Req("a", tokens), 3) == [2, 4, 5]
    assert NgramProposer(2, 2).propose(Req("b", [7, 7, 7]), 4) == [7, 7, 7, 7]  # the run goes on
    # "1 2" ended 2 tokens back: the text repeats with period 2, and so does the draft
    assert NgramProposer(2, 2).propose(Req("c", [9, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]
    assert periodic_copy([5, 6, 7, 5, 6], 2, 4) == [7, 5, 6, 7]


def test_no_draft_without_a_match_or_for_k_zero_and_finish_drops_the_state():
    proposer = NgramProposer(2, 3)
    assert isinstance(proposer, Proposer)
    req = Req("a", [1, 2, 3, 4])
    assert proposer.propose(req, 4) == []
    proposer.on_tokens(req, [1, 2])
    assert proposer.propose(req, 0) == [] and proposer.propose(req, 4) == [3, 4, 1, 2]
    assert proposer.propose(req, 4) == [3, 4, 1, 2]  # proposing changes nothing
    assert len(proposer) == 1
    proposer.on_finish(req)
    proposer.on_finish(req)  # twice, or for an unknown request: ignored
    assert len(proposer) == 0


def test_bad_windows_are_refused():
    for lo, hi in ((0, 3), (3, 2)):
        with pytest.raises(ValueError, match="prompt_lookup_min"):
            NgramProposer(lo, hi)


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), max_size=80), budgets=st.lists(st.integers(0, 9), max_size=12))
def test_a_prompt_indexed_in_pieces_proposes_the_same(prompt, budgets):
    whole, pieces = NgramProposer(1, 4), NgramProposer(1, 4)
    left = len(prompt)
    for budget in budgets:
        new_left = pieces.prepare(Req("r", prompt), budget)
        assert 0 <= new_left <= left
        left = new_left
    assert pieces.propose(Req("r", prompt), 5) == whole.propose(Req("r", prompt), 5)
    assert pieces.prepare(Req("r", prompt), 0) == 0  # proposing indexed the rest
