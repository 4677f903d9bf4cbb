"""What every draft proposer offers the scheduler (docs/speculative.md).

A proposer guesses the next tokens of a running request from token ids alone (no model, no
torch), so guesses cost scheduler CPU time only and the executor checks them. It keeps its
own per-request state, keyed by request id, fed only with *accepted* tokens: a rejected draft
never reaches it, so nothing ever has to be rolled back here.

Call order for one request: any number of `prepare` / `propose` / `on_tokens` calls, then
`on_finish` once. Indexing a long prompt is the one costly part (a 16K-token prompt takes
tens of milliseconds in pure Python), so `prepare` lets the scheduler spread it over the
steps that prefill the prompt; `propose` and `on_tokens` index whatever is left first.
`propose` never changes what later calls return; `on_tokens` appends tokens after
everything passed before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class SpecRequest(Protocol):
    """The little of a request a proposer reads (scheduler_svc.request.Request has it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...


@runtime_checkable
class Proposer(Protocol):
    """A draft source: token ids in, up to k guessed token ids out."""

    def prepare(self, req: SpecRequest, budget: int) -> int:
        """Indexes up to `budget` more of the request's prompt; returns the tokens still to
        index (0: ready)."""
        ...

    def propose(self, req: SpecRequest, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow the request's accepted tokens ([] for no guess).

        `k <= 0` returns []. Proposing is read-only (indexing what is left of the prompt is
        not a visible change)."""
        ...

    def on_tokens(self, req: SpecRequest, new_tokens: Sequence[int]) -> None:
        """Tokens the request just gained (accepted drafts and the step's own token), in order."""
        ...

    def on_finish(self, req: SpecRequest) -> None:
        """The request ended (any reason): drop its state; a proposer with a cross-request
        corpus keeps its output there. Unknown requests are ignored."""
        ...
