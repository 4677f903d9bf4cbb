"""The step trace: what every step did, for people watching chunked prefill work.

Off unless someone asks: a JSON-lines file (`--step-trace-file`) and/or subscribers of
Admin.WatchSteps. Building a trace costs O(sequences in the step), so it is skipped
entirely when nobody listens. A subscriber that falls behind loses steps (its queue is
bounded) rather than growing the server's memory.
"""

from __future__ import annotations

import asyncio
from typing import IO

from google.protobuf import json_format

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.observer import Observer, StepRecord
from scheduler_svc.request import Request
from scheduler_svc.spec.verify import accepted_counts

QUEUE_STEPS = 4096


def _prefix_hash(request: Request) -> str:
    """The prompt's first KV block as a short id (its prefix-cache hash), for a reader that
    rebuilds which requests share a prefix; "" until the block is full and hashed (or when
    the request has finished and released it, or prefix caching is off)."""
    return request.block_hashes[0][:8].hex() if request.block_hashes else ""


class StepTracer(Observer):
    """Fans step traces out to a file and to subscribers."""

    def __init__(self, path: str | None = None) -> None:
        self._file: IO[str] | None = open(path, "a", buffering=1) if path else None
        self._subscribers: set[asyncio.Queue[pb.StepTrace]] = set()

    def subscribe(self) -> asyncio.Queue[pb.StepTrace]:
        queue: asyncio.Queue[pb.StepTrace] = asyncio.Queue(QUEUE_STEPS)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[pb.StepTrace]) -> None:
        self._subscribers.discard(queue)

    def on_step(self, record: StepRecord) -> None:
        if self._file is None and not self._subscribers:
            return  # nobody listens: build nothing
        plan, stats = record.plan, record.stats
        verified = accepted_counts(plan, record.result)
        seqs = [
            pb.StepTraceEntry(
                request_id=s.request_id,
                num_tokens=s.num_new_tokens,
                is_prefill=s.num_computed_tokens < r.num_prompt_tokens,
                num_computed_tokens=s.num_computed_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                num_cached_tokens=r.num_cached_tokens,
                prefix_hash=_prefix_hash(r) if s.num_computed_tokens <= r.num_prompt_tokens else "",
                num_draft_tokens=len(s.draft_token_ids),
                num_accepted_tokens=verified.get(s.seq_id, (0, 0))[1],
            )
            for s, r in zip(plan.seqs, stats.requests)
        ]
        prefill = sum(e.num_tokens for e in seqs if e.is_prefill)
        trace = pb.StepTrace(
            step_id=plan.step_id,
            timestamp=record.planned_at,
            num_tokens=plan.num_tokens,
            token_budget=stats.token_budget,
            num_prefill_tokens=prefill,
            num_decode_tokens=plan.num_tokens - prefill,
            num_preempted=len(plan.preempted),
            num_swapped_out=len(plan.swap_out),
            num_swapped_in=len(plan.swap_in),
            num_cached_tokens=stats.prefix_hits,
            executor_ns=record.result.execute_ns,
            step_ns=record.step_ns,
            executor_start_unix_ns=record.result.start_unix_ns,
            num_running=record.state.num_running,
            num_waiting=record.state.num_waiting,
            kv_cache_usage=record.state.kv_cache_usage,
            policy=stats.policy,
            seqs=seqs,
            budget_reason=stats.budget_reason,
            predicted_step_ms=stats.predicted_step_ms,
            num_draft_tokens=sum(k for k, _ in verified.values()),
            num_accepted_tokens=sum(a for _, a in verified.values()),
            num_steps=record.result.num_steps,
        )
        if self._file is not None:
            self._file.write(json_format.MessageToJson(trace, indent=None) + "\n")
        for queue in self._subscribers:
            if not queue.full():
                queue.put_nowait(trace)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
