"""The step scheduler: builds each step's plan under the token budget. Never touches a tensor.

There is no prefill or decode phase: every request has `num_computed_tokens` catching up with
`num_tokens`. A step hands out the budget to pinned requests, then decodes, short partial
prefills, swapped-out requests, waiting requests in policy order, and long partial prefills
last; each gets `min(remaining known tokens, remaining budget)` tokens and exactly the KV
blocks those tokens need, except that a prefill chunk placed before decodes leaves each a
token and a seq slot: no decode waits on a prefill. Running out of blocks preempts a victim
(recompute or swap, queues.py) instead of failing; a request preempted `max_preemptions`
times is pinned: placed first, oldest first, and never its own victim while another exists,
so it always progresses. docs/architecture.md ("Building a step") has the whole order and why.

A plan is committed when it is built: cursors move and a sampling entry leaves an in-flight
token (request.py), so the next plan can be built before this one's result is back (async
scheduling, engine.py). `update` then only fills in the sampled ids and caches full blocks.
"""

from __future__ import annotations

import time

from scheduler_svc import multi_step
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.budget import BudgetController
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.plan import (
    ScheduledSeq,
    StepPlan,
    StepResult,
    StepStats,
    TokenMask,
    TokenOutput,
    add_prompt_logprob_rows,
    new_seq,
)
from scheduler_svc.policy import Policy
from scheduler_svc.queues import RequestQueues
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.snapshot import SchedulerSnapshot
from scheduler_svc.spec.config import parse_speculative_config
from scheduler_svc.spec.drafter import Drafter
from scheduler_svc.spec.verify import apply_verified, drafts_for


class Scheduler(RequestQueues):
    """Builds each step's plan from the queues (queues.py) and applies its result."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        policy: Policy,
        max_model_len: int,
        host_pool: BlockPool | None = None,
    ) -> None:
        super().__init__(config, pool, host_pool)
        self.max_model_len = max_model_len
        # Host blocks read by this plan's swap-ins, returned to the host pool only once the plan
        # is complete: the executor runs a plan's swap-outs before its swap-ins, so a host block
        # a swap-out in the same plan reused would be overwritten before the swap-in reads it.
        self._host_blocks_read: list[int] = []
        self.step_stats = StepStats(0, "")  # of the last plan built, for observers
        # Admission keeps this many blocks free while others run, so that the decodes of
        # running requests do not immediately preempt what was just admitted.
        self.watermark_blocks = max(1, pool.num_blocks // 100)
        # The auto token budget (--target-itl-ms); it learns only while it is on (engine.py).
        self.budget = BudgetController(pool.block_size)
        self.reconfigure(config, policy)  # sets the policy and the long-prefill threshold

    def reconfigure(self, config: SchedulerConfig, policy: Policy) -> None:
        """Swaps settings and policy. Call it between steps (the engine's event loop only runs
        other code between steps), so every plan is built under one configuration."""
        if self.drafter is None or config.speculative_config != self.config.speculative_config:
            spec = parse_speculative_config(config.speculative_config)
            self.drafter = None if spec is None else Drafter(spec)  # a new one drops the old state
        self.config = config
        self.policy = policy
        # A prefill with more tokens left than this is "long" (vLLM's rule: 4% of max_model_len).
        self.long_prefill_token_threshold = config.long_prefill_token_threshold or max(
            self.pool.block_size, int(self.max_model_len * 0.04)
        )

    @property
    def policy_name(self) -> str:
        return self.policy.name or type(self.policy).__name__

    def snapshot(self) -> SchedulerSnapshot:
        """Live queues, pool and settings: the one way other code reads them."""
        return SchedulerSnapshot(
            self.config,
            self.policy_name,
            self.max_model_len,
            self.num_steps,
            len(self.running),
            len(self.waiting),
            len(self.swapped),
            self.pool.num_free_blocks,
            self.pool.usage,
            self.step_stats.token_budget or self.config.max_num_batched_tokens,
            self.step_stats.budget_reason,
        )

    # ---- building a step ---------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Builds the next step's plan and allocates its blocks; `step_stats` says what else it did."""
        plan = StepPlan(step_id=self.num_steps)
        budget, reason, predicted_ms = self.config.max_num_batched_tokens, "", 0.0
        if self.config.target_itl_ms is not None:
            decodes = [r.num_computed_tokens for r in self.running if r.num_remaining_tokens == 1]
            prefill_ctx = max((r.num_computed_tokens for r in self.running if r.num_remaining_tokens > 1), default=0)
            d = self.budget.decide(budget, len(decodes), sum(decodes), prefill_ctx, self.config.target_itl_ms)
            budget, reason, predicted_ms = d.budget, d.reason, d.predicted_ms
        self.step_stats = StepStats(budget, self.policy_name, budget_reason=reason, predicted_step_ms=predicted_ms)
        self.num_steps += 1
        pinned = sorted((r for r in self.running if self._is_pinned(r)), key=lambda r: (r.arrival_time, r.seq_id))
        if self.config.enable_chunked_prefill:
            decodes, short, long = [], [], []
            for r in self.running:
                if not self._is_pinned(r):
                    (decodes if r.num_remaining_tokens == 1 else long if self._is_long(r) else short).append(r)
            # Pinned requests first (forward progress), leaving a token and a seq slot per decode.
            budget = self._schedule_running(plan, pinned, budget, sum(map(self._is_decode, decodes)))
            budget = self._schedule_running(plan, decodes, budget)
            budget = self._schedule_running(plan, short, budget)
            if not plan.preempted:
                budget = self._schedule_swapped(plan, budget)
                if not self.swapped:  # preempted requests resume before new ones start
                    budget = self._schedule_waiting(plan, budget, whole=False)
            budget = self._schedule_running(plan, long, budget)
        else:
            budget = self._schedule_waiting(plan, budget, whole=True) if not self.swapped else budget
            if not plan.seqs:
                rest = [r for r in self.running if not self._is_pinned(r)]
                budget = self._schedule_running(plan, pinned + rest, budget)
                if not plan.preempted:
                    budget = self._schedule_swapped(plan, budget)
        if self.drafter is not None and budget > 0:  # after everything else: only what is left
            drafts_for(self, plan, budget)
        multi_step.extend(self, plan)  # a plan of decodes alone may run several steps (--num-scheduler-steps)
        plan.finished_seq_ids = self._dropped_seq_ids
        self._dropped_seq_ids = []
        if self._host_blocks_read:
            self.host_pool.release(self._host_blocks_read)
            self._host_blocks_read = []
        for entry in plan.seqs:
            request = self._by_seq[entry.seq_id]
            self.policy.on_scheduled(request, entry.num_new_tokens)  # a multi-step plan's later steps: applied()
            request.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens + plan.num_steps - 1
            request.num_draft_inflight = len(entry.draft_token_ids)  # 0..k of them will be kept
            if entry.sample:  # the executor samples it (a token a step) and keeps it for the next decode
                request.num_inflight_tokens += plan.num_steps
                request.executor_has_last_token = True
        if plan.is_empty:  # never sent (all wait for a token in flight, or nothing fits): ids stay consecutive
            self.num_steps -= 1
        return plan

    def _is_long(self, request: Request) -> bool:
        return request.num_remaining_tokens > self.long_prefill_token_threshold

    def _is_pinned(self, request: Request) -> bool:
        return request.num_preemptions >= self.config.max_preemptions

    def _is_decode(self, request: Request) -> bool:
        """One token to compute, and not ended by a token in flight (then it is skipped)."""
        return (
            request.num_remaining_tokens == 1
            and not request.ends_by_length(self.max_model_len)
            and not self._mask_pending(request)
        )

    @staticmethod
    def _mask_pending(request: Request) -> bool:
        """A constrained request whose next token's mask cannot be made yet: its grammar is
        still compiling, or a step in flight samples the token the mask depends on (async
        scheduling). It may compute all but its last known token (prefill goes on while the
        grammar compiles); the step that samples waits (grammar.py)."""
        return request.sampling.constraint is not None and (request.matcher is None or request.num_inflight_tokens > 0)

    def _schedule_running(self, plan: StepPlan, requests: list[Request], budget: int, decodes_after: int = 0) -> int:
        """Schedules running requests in the given order. No decode waits on a prefill: a chunk
        of more tokens than one leaves a token and a seq slot for every decode still to come
        (later in `requests`, pinned ones included, and `decodes_after` more), and waits for
        the next step when those take all there is."""
        decodes = [self._is_decode(r) for r in requests]  # as the step begins
        to_come = decodes_after + sum(decodes)
        for request, decode in zip(requests, decodes):
            to_come -= decode
            if budget == 0 or len(plan.seqs) >= self.config.max_num_seqs:
                break
            if request.status is not RequestStatus.RUNNING or request.num_draft_inflight:
                continue  # preempted earlier in this step, or its cursor waits for a verify step
            if request.ends_by_length(self.max_model_len):
                continue  # a step in flight gives it its last token: nothing more to compute
            reserve = 0 if decode else to_come
            if budget <= reserve or len(plan.seqs) + reserve >= self.config.max_num_seqs:
                continue
            n = self._chunk(request, budget - reserve)
            if n == 0:
                continue  # its mask is pending: nothing to compute before it samples
            if n > 1:
                # Shrink a chunk to the free blocks rather than preempt for it; with nothing
                # free, preempt for one block's worth.
                fit = self.tokens_that_fit(request)
                n = min(n, fit if fit > 0 else self.pool.block_size)
            if not self._make_room(request, n, plan):
                continue
            self._add(plan, request, n)
            budget -= n
        return budget

    def _schedule_swapped(self, plan: StepPlan, budget: int) -> int:
        """Swaps requests back in, in the step they run again, with a fresh device table."""
        for request in self.policy.order_waiting(self.swapped, self.num_steps):
            if budget == 0 or len(plan.seqs) >= self.config.max_num_seqs:
                break
            if request.num_inflight_tokens:
                continue  # swapped out while a step computed it: resumes once its token is back
            n = min(request.num_remaining_tokens - self._mask_pending(request), budget)
            if n == 0:
                continue
            if not self.pool.can_allocate(request, n):
                break
            self.swapped.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            entry = self._add(plan, request, n)
            entry.replace_block_table = True
            entry.new_block_ids = list(request.block_ids)
            plan.swap_in.extend(zip(request.host_block_ids, request.block_ids))
            self._host_blocks_read.extend(request.host_block_ids)  # released when the plan is built
            request.host_block_ids = []
            budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int, whole: bool) -> int:
        """Admits waiting requests in policy order.

        With chunked prefill, the partial-prefill caps gate admission: at most
        max_num_partial_prefills requests are mid-prefill at once, and at most
        max_long_partial_prefills of them long, so a long prompt over the long cap is
        skipped and the short ones behind it still start.
        """
        prefilling = sum(1 for r in self.running if r.num_remaining_tokens > 1)
        long_prefilling = sum(1 for r in self.running if r.num_remaining_tokens > 1 and self._is_long(r))
        for request in self.policy.order_waiting(self.waiting, self.num_steps):
            if budget == 0 or len(plan.seqs) >= self.config.max_num_seqs:
                break
            if request.num_inflight_tokens:
                continue  # preempted while a step computed it: its prompt needs that token's id
            # The whole known sequence is matched against the prefix cache before chunking.
            request.num_computed_tokens = self.pool.match_prefix(request, request.cache_salt)
            n = self._chunk(request, budget)
            if n == 0 or (whole and self._mask_pending(request)):  # admitted once it can sample
                self._unmatch(request)
                continue
            is_long = self._is_long(request)
            stop = whole and n < request.num_remaining_tokens
            if not whole and not stop:
                if prefilling >= self.config.max_num_partial_prefills:
                    stop = True
                elif is_long and long_prefilling >= self.config.max_long_partial_prefills:
                    self._unmatch(request)
                    continue
            spare = self.pool.num_free_blocks - self.pool.num_new_blocks(request, n)
            if stop or spare < 0 or (self.running and spare < self.watermark_blocks):
                self._unmatch(request)
                break
            if request.first_scheduled_time is None:  # once per request: queue time, cache hits
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = request.num_computed_tokens
                self.step_stats.prefix_queries += request.num_prompt_tokens if self.pool.enable_caching else 0
                self.step_stats.prefix_hits += request.num_computed_tokens
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._add(plan, request, n)
            budget -= n
            prefilling += request.num_remaining_tokens > n
            long_prefilling += is_long and request.num_remaining_tokens > n
        return budget

    def _unmatch(self, request: Request) -> None:
        """Gives back the cached blocks a request took but could not be admitted with."""
        self.pool.free(request)
        request.num_computed_tokens = 0

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens to compute for request within budget (all but the last while its mask is
        pending). With prefix caching a non-final chunk ends on a block boundary, so every
        block it fills can be cached."""
        n = min(request.num_remaining_tokens - self._mask_pending(request), budget)
        if self.pool.enable_caching and n < request.num_remaining_tokens:
            bs = self.pool.block_size
            aligned = (request.num_computed_tokens + n) // bs * bs - request.num_computed_tokens
            if aligned > 0:
                n = aligned
        return n

    def tokens_that_fit(self, request: Request) -> int:
        """How many more tokens request can compute with the blocks it has plus the free ones."""
        capacity = (len(request.block_ids) + self.pool.num_free_blocks) * self.pool.block_size
        return max(0, capacity - request.num_computed_tokens)

    def _make_room(self, request: Request, n: int, plan: StepPlan) -> bool:
        """Preempts until request's n tokens fit; False when request itself was the victim."""
        scheduled = {s.seq_id for s in plan.seqs}
        while not self.pool.can_allocate(request, n):
            # Not a request whose last token is in flight: it ends when that step's result is
            # applied, and preempting it first (a swap copies all its KV) would be wasted.
            candidates = [
                r
                for r in self.running
                if r.seq_id not in scheduled and not r.ends_by_length(self.max_model_len) and not r.num_draft_inflight
            ]
            if self._is_pinned(request):  # a pinned request never preempts itself while it can
                candidates = [r for r in candidates if r is not request] or candidates
            # Forward progress: a request preempted max_preemptions times is pinned, never
            # a victim again while anyone else can be.
            unpinned = [r for r in candidates if r.num_preemptions < self.config.max_preemptions]
            victim = self.policy.pick_victim(unpinned or candidates)
            self.step_stats.recomputed_tokens += self.preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _add(self, plan: StepPlan, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        new_blocks = self.pool.allocate(request, n)
        if not request.known_to_executor:
            plan.new_seqs.append(new_seq(request))
            request.known_to_executor = True
            new_blocks = list(request.block_ids)  # the whole table: cached prefix blocks too
        is_decode = n == 1 and start == request.num_tokens - 1 and request.executor_has_last_token
        plan.seqs.append(
            ScheduledSeq(
                seq_id=request.seq_id,
                request_id=request.request_id,
                num_computed_tokens=start,
                num_new_tokens=n,
                token_ids=[] if is_decode else request.token_ids(start, start + n),
                new_block_ids=new_blocks,
                sample=start + n == request.num_tokens,
            )
        )
        if request.needs_prompt_logprobs:
            add_prompt_logprob_rows(plan.seqs[-1], request)
        if plan.seqs[-1].sample and request.matcher is not None:  # its grammar's mask for the sampled token
            plan.seqs[-1].token_masks.append(TokenMask(n - 1, request.matcher.token_mask()))
        if self.drafter is not None and not plan.seqs[-1].sample:  # index the prompt as it prefills
            self.drafter.prepare(request, n)
        self.step_stats.requests.append(request)
        return plan.seqs[-1]

    # ---- applying a step's result ------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenOutput]:
        """Applies a step's result: its in-flight tokens get their ids, blocks it filled are cached.

        Requests that ended while the step ran (aborted, or finished by an earlier step's
        token under async scheduling) are skipped: their late result is dropped. A request
        preempted while the step ran (async scheduling) still gets its token: the step
        computed it before the preemption's swap-out or drop. Token-based stop conditions
        are checked here; stop strings need text and are checked by the caller, which then
        calls finish().
        """
        if self.drafter is not None:
            self.drafter.observe_result(plan, result)
        for entry in plan.seqs:
            request = self._by_seq.get(entry.seq_id)
            if request is not None and request.status is RequestStatus.RUNNING and not entry.draft_token_ids:
                self.pool.cache_full_blocks(
                    request, request.cache_salt, entry.num_computed_tokens + entry.num_new_tokens
                )
        for p in result.prompt_logprobs:  # in position order; a repeat (async scheduling) is dropped
            request = self._by_seq.get(p.seq_id)
            if request is not None and p.position == len(request.prompt_logprobs) + 1:
                request.prompt_logprobs.append((p.logprob, p.top, p.rank))
        outputs: list[TokenOutput] = []
        verified = apply_verified(self, plan, result, outputs)  # verify entries: drafts kept or rolled back
        outputs += self.apply_tokens(result, verified)
        multi_step.applied(self, plan, result)  # a multi-step plan: cut short? blocks its later steps filled
        return outputs
