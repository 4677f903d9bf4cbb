"""The per-step plan the scheduler hands the executor, and what comes back.

Delta-encoded (docs/architecture.md): a sequence's sampling parameters travel once, in `new_seqs`;
after that an entry carries only counts, the token ids the executor does not know, and the
block ids appended since the last step. These are plain objects; executor_client.py turns
them into chunkserve.executor.v1 messages; request ids and `StepStats` stay on this side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.request import FinishReason, Request, SamplingParams


@dataclass(slots=True)
class TokenMask:
    """Structured output: which tokens may be sampled at one position of an entry's chunk."""

    # Index within the entry's new tokens (0 .. num_new_tokens - 1) whose logits it masks; the
    # sampled position (the last) today, one row per draft position with speculative decoding.
    position: int
    # Packed bits: ceil(vocab_size / 32) little-endian 32-bit words, bit i = token i allowed.
    bits: bytes


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step."""

    seq_id: int
    request_id: str
    # KV already in cache before this step; the new tokens start at this position.
    num_computed_tokens: int
    # Tokens computed this step (1 for a decode).
    num_new_tokens: int
    # Ids of the new tokens when the executor does not know them; empty for a decode.
    token_ids: list[int]
    # Device blocks appended to the sequence's table this step.
    new_block_ids: list[int]
    # Whether this chunk reaches the last known token, so the executor samples.
    sample: bool
    # new_block_ids is the whole table (after a swap-in), not an append.
    replace_block_table: bool = False
    # Structured output: mask rows by position, increasing (empty: unconstrained).
    token_masks: list[TokenMask] = field(default_factory=list)
    # Speculative decoding: guessed tokens after this decode's own, counted in num_new_tokens;
    # every one of the entry's rows samples (a verify entry, scheduler_svc/spec/verify.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs: rows prompt_logprob_first .. + prompt_logprob_rows - 1 report the logprob
    # of the token after them; next_token_id is the token after the chunk (its last row's).
    prompt_logprob_first: int = 0
    prompt_logprob_rows: int = 0
    next_token_id: int | None = None


@dataclass(slots=True)
class NewSeq:
    """Static data of a sequence scheduled for the first time (or again after recompute)."""

    seq_id: int
    sampling: SamplingParams
    # With a penalty or bad words: the prompt's token ids and the output so far (the executor
    # counts on from there); empty otherwise.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def add_prompt_logprob_rows(entry: ScheduledSeq, request: Request) -> None:
    """Names the rows of an entry whose prompt logprobs the request still needs: row j gives
    the token at position start + j + 1, wanted from the first one not received (a row the
    step in flight also computes, under async scheduling, is dropped on arrival) to the
    prompt's last token."""
    start, n, last = entry.num_computed_tokens, entry.num_new_tokens, request.num_prompt_tokens - 1
    first = max(len(request.prompt_logprobs) - start, 0)
    count = min(n, last - start) - first
    if count <= 0:  # a decode (drafts come only on decodes) or nothing left to ask for
        return
    entry.prompt_logprob_first, entry.prompt_logprob_rows = first, count
    if first + count == n:
        entry.next_token_id = request.prompt_token_ids[start + n]


def new_seq(request: Request) -> NewSeq:
    """The NewSeq of a request the executor does not know (first scheduled, or after a
    recompute preemption): with a penalty or bad words, every token it holds goes along, because
    its chunks skip what the prefix cache holds and the sampler reads it all."""
    if not request.sampling.needs_tokens:
        return NewSeq(request.seq_id, request.sampling)
    if request.num_inflight_tokens:  # waiting and swapped requests are skipped while they have one
        raise RuntimeError(f"request {request.request_id}: scheduled anew with a token in flight")
    return NewSeq(request.seq_id, request.sampling, list(request.prompt_token_ids), list(request.output_token_ids))


@dataclass(slots=True)
class StepPlan:
    """Everything the executor does in one step."""

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    # Sequences that ended or were preempted by recompute: the executor drops their state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Request ids preempted while building this plan (not sent: swap-outs carry the blocks).
    preempted: list[str] = field(default_factory=list)
    # (device block, host block) copies before the forward pass, swap-outs first.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block) copies.
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Async scheduling: the step in flight when this one was planned; the executor runs this
    # one after it (None: nothing in flight).
    follows_step_id: int | None = None
    # Multi-step decoding (multi_step.py): the executor runs this plan, then num_steps - 1 more
    # decode steps of its sequences; with stream_steps it answers each of them as it ends.
    num_steps: int = 1
    stream_steps: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens the plan's first step computes (each step after it: one per entry)."""
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.finished_seq_ids and not self.swap_out


@dataclass(slots=True)
class StepStats:
    """What else the scheduler did in a step, for observers only; counts are this step's."""

    token_budget: int
    policy: str
    requests: list[Request] = field(default_factory=list)  # of the plan's seqs, in order
    recomputed_tokens: int = 0  # computed tokens discarded by recompute preemption
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (at first admission)
    prefix_hits: int = 0  # of which found
    budget_reason: str = ""  # the auto budget's (scheduler_svc/budget.py); "" with a fixed budget
    predicted_step_ms: float = 0.0  # the auto budget's prediction for token_budget
    draft_tokens: int = 0  # speculative decoding: draft tokens the plan's verify entries carry


@dataclass(slots=True)
class Sampled:
    """One token the executor sampled."""

    seq_id: int
    token_id: int
    logprob: float = 0.0
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprob:
    """The logprob of the prompt token at `position` given the tokens before it."""

    seq_id: int
    position: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0  # 1 + the number of tokens more likely at that position


@dataclass(slots=True)
class StepResult:
    """What the executor reports for a step. For a multi-step plan the times are per step (its
    totals over the steps it ran): observers that model a step's time by its tokens see one."""

    step_id: int
    sampled: list[Sampled]
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    execute_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    swap_ns: int = 0
    start_unix_ns: int = 0  # the executor's wall clock when it began the step (0: unknown)
    num_threads: int = 0  # torch CPU threads the step ran with (0: unknown)
    num_steps: int = 1  # steps a multi-step plan ran: its num_steps, fewer when cut (multi_step.py)


@dataclass(slots=True)
class TokenOutput:
    """A token a request gained in a step, and whether that token finished it."""

    request: Request
    sampled: Sampled
    finish_reason: FinishReason | None
