"""The Replica service (protos/chunkserve/v1/replica.proto): a router's view of this scheduler.

Served on the Admin port, next to the Admin service: the KV events carry prompt token ids,
so they are for the operator's router, never for clients.

- WatchKVEvents: the KV cache events (kv_events.py) as a gRPC stream. The event log is
  attached to the block pool on the first subscription (or at start-up when the ZMQ publisher
  is on), so a server nobody routes by pays nothing for it.
- GetLoad: queues, KV use, prompt tokens still to prefill, and a step-time model
  (step_cost.py) the router predicts a request's time to first token with. The model is the
  auto budget's when that is on; otherwise `StepCostWatch` fits one on this server's own
  steps, starting at the first GetLoad (an observer that collects nothing before), refitted at
  most every REFIT_S seconds when a GetLoad asks, never inside a step.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc

from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc
from scheduler_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventLog
from scheduler_svc.observer import Observer, StepRecord
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_cost import FEATURES, CostModel, TraceStep, attention_pairs, features

WINDOW = 256  # steps the fallback step-time model is fitted on
MIN_STEPS = 32
WARM_UP = 10  # a server's first steps (allocations, first forward passes) are left out
REFIT_S = 2.0
MAX_QUEUED_BATCHES = 10_000  # a watcher further behind than this is ended (it resumes with from_seq)


class StepCostWatch(Observer):
    """Collects (features, seconds) of every step once enabled; fits on demand, rate-limited."""

    def __init__(self) -> None:
        self.enabled = False
        self._seen = 0
        self._steps: deque[TraceStep] = deque(maxlen=WINDOW)
        self._fitted_at = -REFIT_S
        self._new_since_fit = 0
        self.model: CostModel | None = None

    def on_step(self, record: StepRecord) -> None:
        if not self.enabled or not record.plan.seqs:
            return
        self._seen += 1
        if self._seen <= WARM_UP:
            return
        seqs = zip(record.plan.seqs, record.stats.requests)
        x = features((s.num_new_tokens, s.num_computed_tokens, r.num_prompt_tokens) for s, r in seqs)
        self._steps.append(TraceStep(x, record.step_ns / 1e9 / record.result.num_steps))  # per step run
        self._new_since_fit += 1

    def current(self) -> CostModel | None:
        """The model, refitted first when REFIT_S passed and new steps came in."""
        self.enabled = True
        now = time.monotonic()
        if len(self._steps) >= MIN_STEPS and self._new_since_fit and now - self._fitted_at >= REFIT_S:
            self.model = CostModel.fit_relative(list(self._steps))
            self._fitted_at, self._new_since_fit = now, 0
        return self.model


def load_of(scheduler: Scheduler, model: CostModel | None) -> rpb.ReplicaLoad:
    """GetLoad's answer. Walks the queues once (the router asks a few times a second)."""
    s = scheduler.snapshot()
    pending = pairs = decoding = context = 0
    prefills: list[tuple[int, int]] = []  # (uncomputed prompt tokens, computed) of each pending prefill
    for r in scheduler.running:
        if r.num_computed_tokens < r.num_prompt_tokens:
            prefills.append((r.num_prompt_tokens - r.num_computed_tokens, r.num_computed_tokens))
        else:
            decoding += 1
            context += r.num_computed_tokens
    prefills += [(r.num_prompt_tokens - r.num_computed_tokens, r.num_computed_tokens) for r in scheduler.waiting]
    # a swapped-out prefill counts its whole prompt (it may come back by recompute)
    prefills += [(r.num_prompt_tokens, 0) for r in scheduler.swapped if r.num_computed_tokens < r.num_prompt_tokens]
    for n, computed in prefills:
        pending += n
        pairs += attention_pairs(n, computed)
    return rpb.ReplicaLoad(
        num_running=s.num_running,
        num_waiting=s.num_waiting + s.num_swapped,
        kv_cache_usage=s.kv_cache_usage,
        pending_prefill_tokens=pending,
        pending_prefill_attention=pairs,
        num_decoding=decoding,
        decode_context_tokens=context,
        token_budget=s.token_budget,
        block_size=scheduler.pool.block_size,
        num_device_blocks=scheduler.pool.num_blocks,
        num_free_device_blocks=s.num_free_device_blocks,
        step_cost=list(model.coef) if model is not None else [0.0] * len(FEATURES),
        step_cost_fitted=model is not None,
    )


def batch_to_proto(batch: EventBatch) -> rpb.KVEventBatch:
    msg = rpb.KVEventBatch(seq=batch.seq, timestamp=batch.ts, replay=batch.replay)
    for event in batch.events:
        if isinstance(event, BlockStored):
            msg.events.add().stored.CopyFrom(
                rpb.BlockStored(
                    block_hashes=event.block_hashes,
                    parent_block_hash=event.parent_block_hash or b"",
                    token_ids=event.token_ids,
                    block_size=event.block_size,
                )
            )
        elif isinstance(event, BlockRemoved):
            msg.events.add().removed.CopyFrom(rpb.BlockRemoved(block_hashes=event.block_hashes))
        else:
            msg.events.add().cleared.CopyFrom(rpb.AllBlocksCleared())
    return msg


def batch_from_proto(msg: rpb.KVEventBatch) -> EventBatch:
    """The inverse of batch_to_proto (the router's side)."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in msg.events:
        kind = e.WhichOneof("kind")
        if kind == "stored":
            st = e.stored
            parent = st.parent_block_hash or None
            events.append(BlockStored(tuple(st.block_hashes), parent, tuple(st.token_ids), st.block_size))
        elif kind == "removed":
            events.append(BlockRemoved(tuple(e.removed.block_hashes)))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return EventBatch(msg.seq, msg.timestamp, tuple(events), msg.replay)


class ReplicaServicer(rpb_grpc.ReplicaServicer):
    """WatchKVEvents and GetLoad, once the server is ready (UNAVAILABLE before)."""

    def __init__(self, log: KVEventLog, steps: StepCostWatch, get_scheduler: Callable[[], Scheduler | None]) -> None:
        self._log = log
        self._steps = steps
        self._get_scheduler = get_scheduler

    async def _scheduler(self, context: grpc.aio.ServicerContext) -> Scheduler:
        scheduler = self._get_scheduler()
        if scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is still loading")
        return scheduler  # type: ignore[return-value]

    async def WatchKVEvents(
        self, request: rpb.WatchKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.KVEventBatch]:
        scheduler = await self._scheduler(context)
        if self._log.pool is not scheduler.pool:
            self._log.attach(scheduler.pool)  # the first watcher turns the events on
        queue: asyncio.Queue[EventBatch | None] = asyncio.Queue()

        def deliver(batch: EventBatch) -> None:
            if queue.qsize() >= MAX_QUEUED_BATCHES:
                self._log.unsubscribe(deliver)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)

        self._log.subscribe(deliver, request.from_seq if request.HasField("from_seq") else None)
        try:
            while (batch := await queue.get()) is not None:
                yield batch_to_proto(batch)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this watcher fell {MAX_QUEUED_BATCHES} batches behind; resume with from_seq",
            )
        finally:
            self._log.unsubscribe(deliver)

    async def GetLoad(self, request: rpb.GetLoadRequest, context: grpc.aio.ServicerContext) -> rpb.ReplicaLoad:
        scheduler = await self._scheduler(context)
        model = scheduler.budget.model if scheduler.config.target_itl_ms is not None else None
        return load_of(scheduler, model or self._steps.current())
