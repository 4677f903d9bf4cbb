"""The request queues and how a request moves between them; scheduler.py (a subclass) decides
which moves when. A live request is in one of `waiting`, `running`, `swapped`, and every move
(queued, finished, preempted by swap or recompute, restarted) keeps its device blocks, its host
blocks and the executor state the next plan drops consistent with that queue. A step's sampled
tokens reach their requests here too (`apply_tokens`), since a token may finish its request.
"""

from __future__ import annotations

from collections.abc import Container

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.grammar import advance_grammar
from scheduler_svc.plan import Sampled, StepPlan, StepResult, TokenOutput
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.spec.drafter import Drafter


class RequestQueues:
    """Owns the waiting, running and swapped queues and the requests' blocks."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, host_pool: BlockPool | None = None) -> None:
        self.config = config
        self.pool = pool
        self.host_pool = host_pool  # swap space; None = recompute only
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._dropped_seq_ids: list[int] = []  # executor state to drop in the next plan
        self.num_steps = 0  # plans built so far
        self.drafter: Drafter | None = None  # speculative decoding (scheduler_svc/spec), set by the scheduler
        self.max_model_len = 0  # set by the scheduler

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_step = self.num_steps
        self.requests[request.request_id] = request
        self._by_seq[request.seq_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._dropped_seq_ids)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request for any reason: leaves every queue and map, frees its blocks."""
        if not self._dequeue(request):
            return
        self._release(request)
        request.matcher = None  # its grammar state (structured output) goes with it
        if self.drafter is not None:
            self.drafter.on_finish(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        del self._by_seq[request.seq_id]

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request; returns it, or None when unknown or already finished."""
        if (request := self.requests.get(request_id)) is not None:
            self.finish(request, FinishReason.ABORTED)
        return request

    def drop_on_executor(self, seq_ids: list[int]) -> None:
        """Has the next plan drop these sequences' executor state (again, after a plan that
        dropped them was refused)."""
        self._dropped_seq_ids.extend(seq_ids)

    def failed_plan(self, plan: StepPlan) -> list[Request]:
        """After a plan failed (refused, or planned on top of a failed one): the next plan drops
        what it dropped on the executor again (twice is harmless), and this returns its requests
        to fail or start over: the unfinished ones it ran, and the ones it swapped out if still
        swapped out (their KV may never have been copied to host memory)."""
        self.drop_on_executor(plan.finished_seq_ids)
        return [
            request
            for request_id in [entry.request_id for entry in plan.seqs] + plan.preempted
            if (request := self.requests.get(request_id)) is not None
            and (request_id not in plan.preempted or request.status is RequestStatus.SWAPPED)
        ]

    def preempt(self, request: Request, plan: StepPlan) -> int:
        """Takes request's device blocks away; swaps its KV out when the mode and space allow.
        Returns the tokens it must compute again (0 when swapped).

        Swap keeps `num_computed_tokens` exactly (mid-prefill included) and the executor keeps
        the sequence's state; recompute frees the blocks tail first and the request later
        prefills its prompt and generated tokens again. Short of host blocks, swap falls back
        to recompute.
        """
        self.running.remove(request)
        request.num_preemptions += 1
        plan.preempted.append(request.request_id)
        host = self.host_pool if self.config.preemption_mode == "swap" else None
        if host is not None and host.num_free_blocks >= len(request.block_ids):
            request.host_block_ids = host.take(len(request.block_ids))
            plan.swap_out.extend(zip(request.block_ids, request.host_block_ids))
            self.pool.free(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return 0
        recomputed = request.num_computed_tokens
        self._start_over(request)
        return recomputed

    def restart(self, request: Request, seq_id: int) -> None:
        """Starts a live request over under a new sequence id: its blocks are freed, its old
        executor state dropped by the next plan, and it prefills what it has again, first in
        line. For the requests of a step planned on top of one that failed (async scheduling):
        whatever that step did or did not do on the executor, the old id's results are
        ignored from now on (update finds no request for them), so none is applied twice."""
        if not self._dequeue(request):
            return
        request.num_inflight_tokens = 0  # the failed steps sampled nothing that will be read
        request.num_draft_inflight = 0
        self._start_over(request)  # drops the old id on the executor
        del self._by_seq[request.seq_id]
        request.seq_id = seq_id
        self._by_seq[seq_id] = request

    def _start_over(self, request: Request) -> None:
        """Frees a request's device blocks, has the next plan drop its executor state, and puts
        it first in line to prefill all it has again (recompute preemption, restart)."""
        self._release(request)
        request.executor_has_last_token = False
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.insert(0, request)

    def _dequeue(self, request: Request) -> bool:
        """Takes a live request out of its queue (a swapped one's host blocks too); False if finished."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self._free_host(request)
        else:
            return False
        return True

    def _release(self, request: Request) -> None:
        """Frees a request's device blocks and has the next plan drop its executor state."""
        self.pool.free(request)
        if request.known_to_executor:
            self._dropped_seq_ids.append(request.seq_id)
        request.known_to_executor = False

    def _free_host(self, request: Request) -> None:
        if self.host_pool is not None and request.host_block_ids:
            self.host_pool.release(request.host_block_ids)
        request.host_block_ids = []

    # ---- a step's tokens -------------------------------------------------------------

    def apply_tokens(self, result: StepResult, verified: Container[int] = ()) -> list[TokenOutput]:
        """Gives each request its sampled tokens but those of `verified` sequences: `update`'s,
        and a streamed multi-step plan's steps before its last as they come (engine.py)."""
        outputs = []
        for sampled in result.sampled:
            request = self._by_seq.get(sampled.seq_id)
            if request is None or request.is_finished or request.num_inflight_tokens == 0 or sampled.seq_id in verified:
                continue
            request.num_inflight_tokens -= 1
            outputs.append(self.append_token(request, sampled))
        return outputs

    def append_token(self, request: Request, sampled: Sampled) -> TokenOutput:
        """Gives a request one token of a step's result; finishes it when the token ends it."""
        request.output_token_ids.append(sampled.token_id)
        reason = request.stop_reason(sampled.token_id, self.max_model_len)
        if request.matcher is not None:
            reason = advance_grammar(request, sampled.token_id, reason)
        if reason is not None:
            self.finish(request, reason)
        return TokenOutput(request, sampled, reason)
