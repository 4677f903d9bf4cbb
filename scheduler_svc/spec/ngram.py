"""Prompt lookup (n-gram) drafts: copy what followed the last time the request's text ended
the way it ends now.

vLLM's `prompt_lookup_min` / `prompt_lookup_max` semantics: for n from max down to min, take
the request's last n tokens, find their most recent earlier occurrence in the prompt and
output, and propose the (up to) k tokens that followed it; the first n that matches wins, so
a longer context is trusted over a shorter one.

Where the copy runs into the current text (the occurrence ends p < k tokens before the end:
the text repeats with period p, as a list, a table row or a model stuck in a loop does) the
draft goes on repeating those p tokens up to k: exactly what the lookup would propose step
after step if every drafted token were accepted. Without it such a request drafted p tokens a
step however long its acceptance run (a period-2 output verified 2 drafts at a time).

Incremental: instead of rescanning the history every step (vLLM's proposer runs a KMP scan
over the whole context per step), each request keeps one dict per n mapping an n-gram to the
end of its most recent occurrence. Appending a token indexes the (max - min + 1) n-grams that
now have a token after them, so a step costs O(max_n^2) however long the request is; the
n-grams ending at the last token stay out of the index until a token follows them, which is
what makes every hit an *earlier* occurrence with at least one token to copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.spec.proposer import SpecRequest


@dataclass(slots=True)
class _NgramState:
    tokens: list[int]
    # index[i]: n-gram of n = min_n + i -> end (exclusive) of its most recent occurrence
    # that has a token after it.
    index: list[dict[tuple[int, ...], int]]
    indexed: int = 0  # ends 1..indexed are in the index


def periodic_copy(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """The k tokens after position `end` of `tokens`, the text from `end` on repeated where it
    runs out (module docstring: the lookup iterated under full acceptance)."""
    draft = list(tokens[end : end + k])
    period = len(tokens) - end
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft


class NgramProposer:
    """Prompt lookup over each request's own prompt and output (see the module docstring)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._states: dict[str, _NgramState] = {}

    def __len__(self) -> int:
        """Requests with state here (a finished request must not stay)."""
        return len(self._states)

    def _state(self, req: SpecRequest) -> _NgramState:
        state = self._states.get(req.request_id)
        if state is None:
            state = _NgramState(list(req.prompt_token_ids), [{} for _ in range(self.min_n, self.max_n + 1)])
            self._states[req.request_id] = state
        return state

    def _index(self, state: _NgramState, budget: int | None = None) -> None:
        """Indexes the n-grams that end before the last token (so have a token after it): all
        of them, or those of the next `budget` ends."""
        tokens, min_n = state.tokens, self.min_n
        stop = len(tokens) if budget is None else min(len(tokens), state.indexed + 1 + budget)
        for end in range(state.indexed + 1, stop):
            for i, table in enumerate(state.index):
                n = min_n + i
                if n > end:
                    break
                table[tuple(tokens[end - n : end])] = end  # a later end replaces an earlier one
        state.indexed = max(state.indexed, stop - 1)

    def prepare(self, req: SpecRequest, budget: int) -> int:
        """Indexes up to `budget` more prompt tokens; returns how many are left."""
        state = self._state(req)
        self._index(state, budget)
        return max(0, len(state.tokens) - 1 - state.indexed)

    def propose(self, req: SpecRequest, k: int) -> list[int]:
        if k <= 0:
            return []
        state = self._state(req)
        self._index(state)
        tokens = state.tokens
        length = len(tokens)
        for i in range(len(state.index) - 1, -1, -1):
            n = self.min_n + i
            if n >= length:  # needs the n-gram and an earlier occurrence with a token after it
                continue
            end = state.index[i].get(tuple(tokens[length - n :]))
            if end is not None:
                return periodic_copy(tokens, end, k)
        return []

    def on_tokens(self, req: SpecRequest, new_tokens: Sequence[int]) -> None:
        state = self._state(req)
        state.tokens.extend(new_tokens)
        self._index(state)

    def on_finish(self, req: SpecRequest) -> None:
        self._states.pop(req.request_id, None)

    def history(self, req: SpecRequest) -> list[int]:
        """The tokens the proposer holds for req (prompt and accepted output), for checks."""
        return list(self._state(req).tokens)
