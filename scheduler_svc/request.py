"""A request's state in the scheduler: one token model, no phases.

    prompt tokens            generated tokens
    |<---- num_prompt_tokens ---->|<-- output -->|
    |<------------------ num_tokens ------------>|
    |<---- num_computed_tokens ---->|   (KV in cache)

A step gives a request `n = num_tokens - num_computed_tokens` tokens (capped by the
budget). It is prefilling while `num_computed_tokens < num_prompt_tokens`; a decode is just
`n == 1`. Chunked prefill, recompute after preemption and prefix-cache hits only move
`num_computed_tokens`.

A plan moves the cursor when it is built, not when its result comes back: a step that will
sample a token adds an in-flight token, counted in `num_tokens` but with no id yet. Under
async scheduling the next step is planned while one is in flight, so a decode of that token
can be planned (the executor feeds back the token it sampled); only its id waits for the result.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler_svc.structured import Constraint, GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in host memory
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended (mirrors chunkserve.v1.FinishReason)."""

    STOP = 1
    LENGTH = 2
    STOP_SEQUENCE = 3
    ABORTED = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated sampling parameters with their defaults filled in."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Structured output: the output must match it (scheduler_svc/structured.py); None: free.
    constraint: Constraint | None = None
    skip_special_tokens: bool = True  # output text without special tokens (EOS, template markers)
    include_stop_str_in_output: bool = False  # keep the matched stop string / stop token's text
    # vLLM's penalties (applied by the executor's sampler, executor_svc/penalties.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: (token id, value added to its logit), ids distinct.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Prompt logprobs with this many alternatives (vLLM's prompt_logprobs); None: none.
    prompt_logprobs: int | None = None
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be generated; () any
    # vLLM's bad_words, tokenized (validation.bad_words_token_ids): the last id of each is never
    # generated right after the ones before it.
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_tokens(self) -> bool:
        """Whether the executor needs the sequence's token ids: a penalty counts them, bad words
        look at the output's last ones."""
        return self.penalized or bool(self.bad_words)


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler tracks it."""

    request_id: str
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)  # while swapped out
    # Chained prefix-cache hashes of the leading full blocks (see block_pool.py).
    block_hashes: list[bytes] = field(default_factory=list)
    # Mixed into the prefix-cache hashes: requests with different salts never share blocks.
    cache_salt: str | None = None
    # For the policies: lower priority value runs earlier; tenant label for fair sharing;
    # the scheduler's step counter when the request arrived (for aging).
    priority: int = 0
    tenant: str = ""
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Whether the executor holds this sequence's state (sampling params, block table, the
    # last token it sampled). False until first scheduled and again after a recompute
    # preemption, which drops it there.
    known_to_executor: bool = False
    # Whether the executor sampled this sequence's last token itself, so a decode entry needs
    # no token id.
    executor_has_last_token: bool = False
    # Tokens a step in flight will sample (0 or 1): in num_tokens, ids not known yet.
    num_inflight_tokens: int = 0
    # Draft tokens of a verify step in flight (speculative decoding): already in
    # num_computed_tokens, which its result moves back over the rejected ones; until then no
    # other step is planned for the request.
    num_draft_inflight: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # A constrained request's grammar state (scheduler_svc/grammar.py): None until its
    # constraint is compiled; it has consumed exactly the output tokens.
    matcher: GrammarMatcher | None = None
    # Prompt logprobs received so far, for positions 1, 2, ... in order: (logprob, top as
    # (token id, logprob) best first, rank).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] = field(default_factory=list)
    # Monotonic timestamps for the latency metrics (one clock: this process's).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all in yet: then it never starts on cached blocks."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        """Prompt, output and in-flight tokens: what the KV will hold once all are computed."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions start..end-1 across prompt and output (all known: an
        in-flight token has no id yet, and asking for it is a scheduler bug)."""
        p = self.prompt_token_ids
        if end > len(p) + len(self.output_token_ids):
            raise RuntimeError(f"request {self.request_id}: token ids up to {end} asked, an in-flight token has none")
        if end <= len(p):
            return p[start:end]
        out = self.output_token_ids
        if start >= len(p):
            return out[start - len(p) : end - len(p)]
        return p[start:] + out[: end - len(p)]

    def ends_by_length(self, max_model_len: int) -> bool:
        """Whether the request ends by its in-flight tokens whatever their ids (max_tokens or
        the context is reached): then no step after them is planned for it."""
        return self.num_inflight_tokens > 0 and (
            self.num_output_tokens + self.num_inflight_tokens >= self.sampling.max_tokens
            or self.num_tokens >= max_model_len
        )

    def stop_reason(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Why the request ends with token_id just appended (token-based conditions only: stop
        strings need text and are checked by the engine), or None."""
        params = self.sampling
        if self.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        known = self.num_prompt_tokens + self.num_output_tokens  # not a later step's in-flight token
        if self.num_output_tokens >= params.max_tokens or known >= max_model_len:
            return FinishReason.LENGTH
        return None
