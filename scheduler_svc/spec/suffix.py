"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025): drafts from the most
frequent continuation of the request's recent tokens, found in suffix tries over the request's
own prompt and output and over a bounded corpus of recent outputs of finished requests.

For a pattern length m (the request's last m tokens, 1 <= m < max_depth), each trie gives the
most frequent continuation, extended while the path's empirical probability (the product of
child.count / occurrences with a continuation) stays >= min_token_prob, for at most
min(k, int(max_spec_factor * m), max_depth - m) tokens: a longer match earns a longer draft,
and the trie depth bounds match plus draft, as in vLLM's `suffix_decoding_*` options. Of all
pattern lengths and both tries, the draft with the highest score (the sum of its tokens' path
probabilities) wins; lengths are tried in order of their length bound so the search stops
as soon as no other can beat the best score found.

The paper scores speculation *trees*; chunkserve verifies one chain per request (one query
chunk on the varlen path), so this proposes the best single path.

The global corpus holds finished requests' outputs, evicted least recently used first (use:
insertion, or a draft read from that output's tail) when it holds more than
`max_cached_requests` outputs or `max_cached_tokens` tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.spec.proposer import SpecRequest
from scheduler_svc.spec.suffix_tree import SuffixTrie


@dataclass(slots=True)
class _RequestState:
    trie: SuffixTrie
    tokens: list[int]  # indexed so far
    num_prompt: int
    pending: list[int]  # prompt tokens not indexed yet (see prepare)
    # cursors (suffix_tree.py), oldest first: active[i] ends a pattern of len(active) - i tokens
    active: list[int] = field(default_factory=list)
    # the last corpus lookup: longest match, at which length, at which corpus version
    corpus_m: int = 0
    corpus_at: int = 0
    corpus_version: int = -1


class SuffixProposer:
    """Suffix decoding drafts (see the module docstring)."""

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_tokens: int = 1 << 20,
    ) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be >= 2 (a match and a draft token), got {max_tree_depth}")
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError("max_cached_requests and max_cached_tokens must be >= 0")
        if max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need max_spec_factor >= 0 and 0 <= min_token_prob <= 1")
        self.max_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.corpus = SuffixTrie(max_tree_depth)
        # id(tokens) -> tokens, least recently used first; the trie's compressed nodes read them
        self._docs: OrderedDict[int, list[int]] = OrderedDict()
        self.corpus_tokens = 0
        self._version = 0  # outputs added so far (a lookup's bound holds until the next)
        self._states: dict[str, _RequestState] = {}
        self._orders: dict[int, list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        """Requests with state here (a finished request must not stay)."""
        return len(self._states)

    @property
    def corpus_requests(self) -> int:
        return len(self._docs)

    # ---- per request --------------------------------------------------------------------

    def _state(self, req: SpecRequest) -> _RequestState:
        state = self._states.get(req.request_id)
        if state is None:
            prompt = list(req.prompt_token_ids)
            state = _RequestState(SuffixTrie(self.max_depth), [], len(prompt), prompt[::-1])
            self._states[req.request_id] = state
        return state

    def _ready(self, req: SpecRequest) -> _RequestState:
        """The request's state with its whole prompt indexed."""
        state = self._state(req)
        if state.pending:
            self.prepare(req, len(state.pending))
        return state

    def prepare(self, req: SpecRequest, budget: int) -> int:
        """Indexes up to `budget` more prompt tokens; returns how many are left."""
        state = self._state(req)
        pending, seq, trie = state.pending, state.tokens, state.trie
        for _ in range(min(budget, len(pending))):
            seq.append(pending.pop())
            trie.append(state.active, seq, len(seq) - 1)
        return len(pending)

    def _extend(self, state: _RequestState, tokens: Sequence[int]) -> None:
        seq, trie = state.tokens, state.trie
        for t in tokens:
            seq.append(t)
            trie.append(state.active, seq, len(seq) - 1)

    def on_tokens(self, req: SpecRequest, new_tokens: Sequence[int]) -> None:
        self._extend(self._ready(req), new_tokens)

    def on_finish(self, req: SpecRequest) -> None:
        state = self._states.pop(req.request_id, None)
        if state is None or state.pending or self.max_cached_requests == 0 or self.max_cached_tokens == 0:
            return
        output = state.tokens[state.num_prompt :][-self.max_cached_tokens :]
        if output:
            self.add_to_corpus(output)

    # ---- the global corpus ----------------------------------------------------------------

    def add_to_corpus(self, tokens: Sequence[int]) -> None:
        """Indexes a finished output in the global trie, evicting LRU outputs over the bounds."""
        doc = list(tokens)
        self.corpus.insert(doc)
        self._version += 1
        self._docs[id(doc)] = doc
        self.corpus_tokens += len(doc)
        while self._docs and (
            len(self._docs) > self.max_cached_requests or self.corpus_tokens > self.max_cached_tokens
        ):
            _, old = self._docs.popitem(last=False)
            self.corpus.remove(old)
            self.corpus_tokens -= len(old)

    def _touch(self, seq: list[int] | None) -> None:
        if seq is not None and id(seq) in self._docs:
            self._docs.move_to_end(id(seq))

    # ---- proposing ----------------------------------------------------------------------

    def _order(self, k: int) -> list[tuple[int, int]]:
        """(bound, m) for every pattern length m with a draft bound >= 1, best bound first
        (longer m first among equal bounds)."""
        order = self._orders.get(k)
        if order is None:
            bounds = ((min(k, int(self.max_spec_factor * m), self.max_depth - m), m) for m in range(1, self.max_depth))
            order = self._orders[k] = sorted((b for b in bounds if b[0] >= 1), key=lambda b: (-b[0], -b[1]))
        return order

    def _corpus_match(self, state: _RequestState, first_m: int) -> int:
        """The longest m (< max_depth) such that the request's last m tokens occur in the
        corpus trie, by bisection: occurrence is monotone in m (a suffix of an occurring
        string occurs). Unless an output was added since the last lookup, the answer is at
        most the last one plus the tokens appended since (its prefix occurred then)."""
        seq = state.tokens
        n = len(seq)
        hi = min(first_m, self.max_depth - 1)
        if state.corpus_version == self._version:
            hi = min(hi, state.corpus_m + n - state.corpus_at)
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.corpus.walk(seq, n - mid, n) is None:
                hi = mid - 1
            else:
                lo = mid
        state.corpus_m, state.corpus_at, state.corpus_version = lo, n, self._version
        return lo

    def propose(self, req: SpecRequest, k: int) -> list[int]:
        if k <= 0:
            return []
        state = self._ready(req)
        seq, trie, active = state.tokens, state.trie, state.active
        n = len(seq)
        first_m = len(active)  # active[i] ends with the last first_m - i tokens
        # The longest m whose pattern occurred before: its node branches. A compressed node
        # would be this occurrence alone, and then so would every longer pattern.
        req_m = 0
        for i in range(first_m - 1, -1, -1):
            if trie.pos[trie.resolve_cursor(active, i, seq)] >= 0:
                break
            req_m = first_m - i
        corpus_m = -1  # looked up only if the request's own text leaves room to beat
        best: list[int] = []
        best_score, best_seq = 0.0, None
        for bound, m in self._order(k):
            if bound <= best_score:
                break
            if m <= req_m:
                node = active[first_m - m]
                if trie.cont[node] > 0:
                    tokens, score, _ = trie.draft(node, 0, bound, self.min_token_prob)
                    if score > best_score:
                        best, best_score, best_seq = tokens, score, None
                        if bound <= best_score:
                            break
            if corpus_m < 0:
                corpus_m = self._corpus_match(state, first_m) if self._docs else 0
            if m <= corpus_m:
                node, extra = self.corpus.walk(seq, n - m, n)
                tokens, score, tail = self.corpus.draft(node, extra, bound, self.min_token_prob)
                if score > best_score:
                    best, best_score, best_seq = tokens, score, tail
        self._touch(best_seq)
        return best

    def history(self, req: SpecRequest) -> list[int]:
        """The tokens the proposer holds for req (prompt and accepted output), for checks."""
        return list(self._ready(req).tokens)
