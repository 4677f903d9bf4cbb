"""Suffix decoding: the compressed trie counts every substring exactly as a scan does (through
appends, inserts and evictions), drafts are paths that exist, and the corpus stays bounded."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.spec.proposer import Proposer
from scheduler_svc.spec.suffix import SuffixProposer
from scheduler_svc.spec.suffix_tree import SuffixTrie


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)


def occurrences(seqs: list[list[int]], pattern: list[int], depth: int) -> tuple[int, int]:
    """(occurrences of pattern, of which have a next token within the depth bound), by scan."""
    count = cont = 0
    m = len(pattern)
    for seq in seqs:
        for end in range(m, len(seq) + 1):
            if seq[end - m : end] == pattern:
                count += 1
                cont += end < len(seq) and m < depth
    return count, cont


def trie_stats(trie: SuffixTrie, pattern: list[int]) -> tuple[int, int]:
    found = trie.walk(pattern, 0, len(pattern))
    if found is None:
        return 0, 0
    node, extra = found
    if trie.pos[node] >= 0:  # one occurrence, read from its sequence
        has_next = trie.depth[node] + extra < trie.max_depth and trie.pos[node] + extra + 1 < len(trie.src[node])
        return 1, int(has_next)
    return trie.count[node], trie.cont[node]


def patterns_of(seqs: list[list[int]], depth: int, alphabet: int) -> list[list[int]]:
    """Every substring up to the depth, plus a few that occur nowhere."""
    out = {tuple(s[i : i + m]) for s in seqs for i in range(len(s)) for m in range(1, depth + 1) if i + m <= len(s)}
    out |= {(alphabet,), (0, alphabet)}
    return [list(p) for p in out]


@settings(max_examples=120, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=0, max_size=70), depth=st.integers(1, 8))
def test_appending_counts_every_substring_like_a_scan(seq, depth):
    trie, tokens, active = SuffixTrie(depth), [], []
    for p, t in enumerate(seq):
        tokens.append(t)
        trie.append(active, tokens, p)
        assert len(active) == min(p + 1, depth - 1)
    for pattern in patterns_of([tokens], depth, 4):
        assert trie_stats(trie, pattern) == occurrences([tokens], pattern, depth), pattern


@settings(max_examples=80, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
    drop=st.lists(st.booleans(), min_size=6, max_size=6),
    depth=st.integers(2, 7),
)
def test_insert_and_remove_keep_the_counts_of_what_is_left(docs, drop, depth):
    trie = SuffixTrie(depth)
    for doc in docs:
        trie.insert(doc)
    kept = [doc for doc, d in zip(docs, drop) if not d]
    for doc, d in zip(docs, drop):
        if d:
            trie.remove(doc)
    for pattern in patterns_of(docs, depth, 4):
        assert trie_stats(trie, pattern) == occurrences(kept, pattern, depth), pattern
    for doc in kept:
        trie.remove(doc)
    assert trie.kids[0] == {} and trie.cont[0] == 0 and trie.num_nodes == 1  # nothing leaks


def earlier_continuation(history: list[int], draft: list[int], depth: int) -> bool:
    """Whether some last-m tokens (m + len(draft) <= depth) occurred earlier, followed by draft."""
    n = len(history)
    for m in range(1, depth - len(draft) + 1):
        if m >= n:
            break
        for end in range(m, n):
            if history[end - m : end] == history[n - m :] and history[end : end + len(draft)] == draft:
                return True
    return False


@settings(max_examples=120, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    output=st.lists(st.integers(0, 4), max_size=40),
    depth=st.integers(2, 10),
    k=st.integers(1, 12),
    factor=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_request_drafts_are_paths_of_the_request_text(prompt, output, depth, k, factor, min_prob):
    proposer = SuffixProposer(
        max_tree_depth=depth, max_cached_requests=0, max_spec_factor=factor, min_token_prob=min_prob
    )
    req = Req("r", prompt)
    history = list(prompt)
    for t in [None, *output]:
        if t is not None:
            proposer.on_tokens(req, [t])
            history.append(t)
        draft = proposer.propose(req, k)
        assert len(draft) <= min(k, depth - 1)
        if draft:
            assert earlier_continuation(history, draft, depth), (history, draft)
    assert proposer.history(req) == history


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=25), min_size=1, max_size=8),
    context=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    max_requests=st.integers(1, 4),
    max_tokens=st.integers(1, 60),
)
def test_corpus_drafts_exist_and_the_corpus_stays_bounded(docs, context, max_requests, max_tokens):
    proposer = SuffixProposer(max_tree_depth=6, max_cached_requests=max_requests, max_cached_tokens=max_tokens)
    for i, doc in enumerate(docs):  # each finished request's output joins the corpus
        req = Req(f"done{i}", [9])
        proposer.on_tokens(req, doc)
        proposer.on_finish(req)
        assert proposer.corpus_requests <= max_requests and proposer.corpus_tokens <= max_tokens
    kept = list(proposer._docs.values())
    assert proposer.corpus_tokens == sum(map(len, kept)) and all(9 not in d for d in kept)  # outputs only
    req = Req("live", [7, *context])  # 7: a token no document has
    draft = proposer.propose(req, 8)
    if draft:
        history = [7, *context]
        in_corpus = any(
            doc[end - m : end] == history[-m:] and doc[end : end + len(draft)] == draft
            for doc in kept
            for m in range(1, len(history))
            for end in range(m, len(doc))
        )
        assert in_corpus or earlier_continuation(history, draft, 6)
    for doc in kept:
        proposer.corpus.remove(doc)
    assert proposer.corpus.kids[0] == {} and proposer.corpus.num_nodes == 1


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), max_size=80),
    budgets=st.lists(st.integers(0, 9), max_size=12),
    output=st.lists(st.integers(0, 4), max_size=10),
)
def test_a_prompt_indexed_in_pieces_proposes_the_same(prompt, budgets, output):
    whole, pieces = SuffixProposer(max_tree_depth=8), SuffixProposer(max_tree_depth=8)
    left = len(prompt)
    for budget in budgets:
        new_left = pieces.prepare(Req("r", prompt), budget)
        assert new_left == max(0, left - budget)
        left = new_left
    for proposer in (whole, pieces):
        proposer.on_tokens(Req("r", prompt), output)
    assert pieces.propose(Req("r", prompt), 6) == whole.propose(Req("r", prompt), 6)
    assert pieces.history(Req("r", prompt)) == prompt + output


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=8)), min_size=1, max_size=25
    )
)
def test_the_remembered_corpus_match_bound_never_hides_a_longer_match(events):
    """The corpus lookup bisects below the last match plus the tokens since (module docstring):
    as outputs come and go and the request grows, it still finds the longest match."""
    proposer = SuffixProposer(max_tree_depth=6, max_cached_requests=3)
    req = Req("live", [0])
    for is_output, tokens in events:
        if is_output:
            proposer.add_to_corpus(tokens)
        else:
            proposer.on_tokens(req, tokens)
        proposer.propose(req, 4)
        state = proposer._states["live"]
        seq, longest = state.tokens, 0
        for m in range(1, min(len(state.active), 5) + 1):
            if proposer.corpus.walk(seq, len(seq) - m, len(seq)) is not None:
                longest = m
        assert proposer._corpus_match(state, len(state.active)) == longest


def test_the_most_frequent_continuation_wins_and_min_token_prob_cuts_the_draft():
    # After "1 2": "3" twice, "4" once.
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    assert SuffixProposer(max_tree_depth=8, min_token_prob=0.1).propose(Req("a", prompt), 1) == [3]
    # 2/3 < 0.7: nothing is likely enough to draft
    assert SuffixProposer(max_tree_depth=8, min_token_prob=0.7).propose(Req("b", prompt), 4) == []


def test_a_longer_match_earns_a_longer_draft_up_to_the_depth():
    doc = list(range(10, 40))
    prompt = [*doc, 5, *doc[:14]]  # the last 14 tokens occurred once before
    # best bound: m = 12 gives min(k, 1.0 * 12, 24 - 12) = 12 tokens (m = 14 gives 10)
    assert SuffixProposer(max_tree_depth=24, max_spec_factor=1.0).propose(Req("a", prompt), 32) == doc[14:26]
    assert SuffixProposer(max_tree_depth=24, max_spec_factor=1.0).propose(Req("b", prompt), 5) == doc[14:19]
    # m = 14 gives min(0.5 * 14, 24 - 14) = 7
    assert SuffixProposer(max_tree_depth=24, max_spec_factor=0.5).propose(Req("c", prompt), 32) == doc[14:21]
    short = [*doc, 5, *doc[:3]]  # m = 3: three tokens
    assert SuffixProposer(max_tree_depth=24).propose(Req("d", short), 32) == doc[3:6]


def test_outputs_of_finished_requests_serve_later_requests_and_state_is_dropped():
    proposer = SuffixProposer(max_tree_depth=16)
    assert isinstance(proposer, Proposer)
    done = Req("done", [1, 2, 3])
    proposer.on_tokens(done, [50, 51, 52, 53, 54, 55])
    proposer.on_finish(done)
    assert len(proposer) == 0 and proposer.corpus_requests == 1 and proposer.corpus_tokens == 6
    assert proposer.propose(Req("new", [8, 50, 51, 52]), 8) == [53, 54, 55]  # m=3: 3 tokens
    assert proposer.propose(Req("other", [1, 2]), 8) == []  # prompts are not in the corpus
    off = SuffixProposer(max_tree_depth=16, max_cached_requests=0)
    proposer_req = Req("x", [1])
    off.on_tokens(proposer_req, [50, 51])
    off.on_finish(proposer_req)
    assert off.corpus_requests == 0


def test_the_least_recently_used_output_is_evicted_first():
    proposer = SuffixProposer(max_tree_depth=8, max_cached_requests=2)
    proposer.add_to_corpus([1, 2, 3, 4])
    proposer.add_to_corpus([5, 6, 7, 8])
    assert proposer.propose(Req("a", [0, 1, 2]), 2) == [3, 4]  # reads the first output: used
    proposer.add_to_corpus([9, 10, 11, 12])  # evicts the second, not the first
    assert proposer.propose(Req("b", [0, 1, 2]), 2) == [3, 4]
    assert proposer.propose(Req("c", [0, 5, 6]), 2) == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixProposer(max_tree_depth=1)
    with pytest.raises(ValueError, match="min_token_prob"):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_cached"):
        SuffixProposer(max_cached_requests=-1)
