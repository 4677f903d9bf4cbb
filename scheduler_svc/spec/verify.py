"""A step's drafts in the scheduler's plan, and a verify step's result applied: the two places
speculative decoding touches the step scheduler (scheduler.py calls them; docs/speculative.md).

`drafts_for` runs once a plan holds everything else, so drafts take only the budget and free
blocks left: a draft never delays a decode or a prefill chunk, never preempts anyone (it
shrinks to the free blocks instead) and never passes max_tokens or the context. Only a step of
decodes alone is drafted: a step with a prefill chunk is large already, and the gate's times
(drafter.py) are those of pure-decode steps. A structured-output request's draft is cut at
its first token the grammar forbids and carries one mask row per draft position (the
matcher walks the draft and rolls back: only accepted tokens advance it, in `append_token`).

`apply_verified` gives a verify entry's result to its request: the accepted drafts and the
token sampled after them, in order, until one ends the request (later ones are dropped with
their KV), and moves the cursor back over the rejected drafts. Their slots keep their blocks
and are overwritten by the next step's tokens (vLLM's rollback); only blocks full of accepted
tokens are cached.
"""

from __future__ import annotations

from typing import Protocol

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.plan import Sampled, StepPlan, StepResult, StepStats, TokenMask, TokenOutput
from scheduler_svc.request import Request
from scheduler_svc.spec.drafter import Drafter


class Scheduler(Protocol):
    """What these functions use of scheduler_svc.scheduler.Scheduler (which calls them)."""

    drafter: Drafter | None
    requests: dict[str, Request]
    pool: BlockPool
    max_model_len: int
    num_steps: int
    step_stats: StepStats

    def tokens_that_fit(self, request: Request) -> int: ...
    def append_token(self, request: Request, sampled: Sampled) -> TokenOutput: ...


def _draft_room(sched: Scheduler, request: Request) -> int:
    """Most draft tokens a decode of request may carry: what is left of max_tokens and of the
    context after its own token, and the free blocks (drafts never preempt)."""
    return min(
        request.sampling.max_tokens - request.num_output_tokens - 1,
        sched.max_model_len - request.num_tokens - 1,
        sched.tokens_that_fit(request) - 1,
    )


def drafts_for(sched: Scheduler, plan: StepPlan, budget: int) -> None:
    """Turns some of a pure-decode plan's decodes into verify entries (module docstring)."""
    drafter = sched.drafter
    decodes = []
    for index, entry in enumerate(plan.seqs):
        if entry.num_new_tokens != 1 or not entry.sample:
            return  # a prefill chunk in the step: no drafts
        request = sched.requests[entry.request_id]
        # Its last token's id must be known (not a step in flight's, under async scheduling):
        # the proposer and the grammar matcher need it.
        if request.num_inflight_tokens == 0:
            if (room := _draft_room(sched, request)) > 0:
                decodes.append((index, request, room))
    most = min(budget, sum(min(room, drafter.settings.k_max) for _, _, room in decodes))
    if not decodes or not drafter.could_pay(len(plan.seqs), most, sched.num_steps):
        return
    candidates = drafter.candidates(decodes)
    keep = drafter.choose(len(plan.seqs), candidates, budget, sched.num_steps)
    for c in candidates:
        entry = plan.seqs[c.index]
        request = sched.requests[entry.request_id]
        # Free blocks again: drafts placed before this one may have taken them.
        if (k := min(keep.get(c.index, 0), sched.tokens_that_fit(request) - 1)) <= 0:
            continue
        if request.matcher is not None:
            rows = request.matcher.draft_masks(c.draft[:k])  # cut at the first forbidden token
            if (k := len(rows)) == 0:
                continue
            # position j + 1 samples after the first j + 1 drafts (position 0 has its row)
            entry.token_masks.extend(TokenMask(j + 1, bits) for j, bits in enumerate(rows))
        entry.draft_token_ids = c.draft[:k]
        entry.num_new_tokens = 1 + k
        entry.new_block_ids.extend(sched.pool.allocate(request, 1 + k))
        sched.step_stats.draft_tokens += k


def apply_verified(sched: Scheduler, plan: StepPlan, result: StepResult, outputs: list[TokenOutput]) -> set[int]:
    """Applies the verify entries of a step's result (module docstring); returns their sequence
    ids, whose tokens the caller then skips."""
    verify = {e.seq_id: e for e in plan.seqs if e.draft_token_ids}
    if not verify:
        return set()
    tokens: dict[int, list[Sampled]] = {seq_id: [] for seq_id in verify}
    for sampled in result.sampled:
        if sampled.seq_id in tokens:
            tokens[sampled.seq_id].append(sampled)
    for seq_id, entry in verify.items():
        request = sched.requests.get(entry.request_id)
        got = tokens[seq_id]
        if request is None or request.seq_id != seq_id or request.num_draft_inflight == 0 or not got:
            continue  # ended (or restarted) while the step ran: its late result is dropped
        k = len(entry.draft_token_ids)
        accepted = min(len(got) - 1, k)
        request.num_draft_inflight = 0
        request.num_computed_tokens -= k - accepted
        request.num_inflight_tokens -= 1
        if sched.drafter is not None:
            sched.drafter.on_result(request, k, accepted)
        for sampled in got[: accepted + 1]:
            out = sched.append_token(request, sampled)
            outputs.append(out)
            if out.finish_reason is not None:
                break
        else:
            sched.pool.cache_full_blocks(request, request.cache_salt, request.num_computed_tokens)
    return set(verify)


def accepted_counts(plan: StepPlan, result: StepResult) -> dict[int, tuple[int, int]]:
    """seq id -> (draft tokens, accepted) of a step's verify entries, from its plan and result
    (for observers: metrics and the step trace)."""
    counts = {e.seq_id: [len(e.draft_token_ids), -1] for e in plan.seqs if e.draft_token_ids}
    if counts:
        for sampled in result.sampled:
            if (c := counts.get(sampled.seq_id)) is not None:
                c[1] += 1
    return {seq_id: (k, max(0, min(a, k))) for seq_id, (k, a) in counts.items()}
