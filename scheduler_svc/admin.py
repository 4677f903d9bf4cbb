"""The operator service (chunkserve.v1.Admin), on its own port, loopback by default (who may
call that port: admin_access.py).

Everything runs on the scheduler's event loop, and the engine only yields to it between
steps, so a change applies at a step boundary: the plan in flight was built under the old
settings, the next one under the new. A change is validated whole before anything moves;
a rejected one leaves everything as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

import grpc

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.config import resolve_auto, validate_against_executor
from scheduler_svc.policy import create_policy
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.snapshot import SchedulerSnapshot
from scheduler_svc.trace import StepTracer

_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "max_num_partial_prefills",
    "max_long_partial_prefills",
    "long_prefill_token_threshold",
)


@dataclasses.dataclass
class Controls:
    """What the admin service may touch, once the server is ready."""

    scheduler: Scheduler
    executor: epb.HandshakeResponse  # what a change is checked against (config.validate_against_executor)


def describe(s: SchedulerSnapshot) -> pb.SchedulingConfig:
    return pb.SchedulingConfig(
        policy=s.policy,
        **{f: getattr(s.config, f) for f in _FIELDS},
        num_running=s.num_running,
        num_waiting=s.num_waiting + s.num_swapped,
        kv_cache_usage=s.kv_cache_usage,
        effective_step=s.next_step,
        target_itl_ms=s.config.target_itl_ms or 0.0,
        token_budget=s.token_budget,
        budget_reason=s.budget_reason,
    )


def apply_update(controls: Controls, update: pb.SchedulingConfig) -> pb.SchedulingConfig:
    """Validates and applies a change; ValueError (nothing changed) when it cannot work."""
    sched, now = controls.scheduler, controls.scheduler.snapshot()
    changes = {f: getattr(update, f) for f in _FIELDS if update.HasField(f)}
    if update.HasField("target_itl_ms"):  # 0 = back to a fixed budget
        changes["target_itl_ms"] = update.target_itl_ms or None
    config = dataclasses.replace(now.config, **changes)  # __post_init__ validates
    config = resolve_auto(config, controls.executor)  # max_num_batched_tokens 0 = auto, as at start-up
    validate_against_executor(config, controls.executor, now.max_model_len)  # the start-up rules
    policy = create_policy(update.policy) if update.HasField("policy") else sched.policy
    sched.reconfigure(config, policy)
    return describe(sched.snapshot())


class AdminServicer(pb_grpc.AdminServicer):
    """Step trace, prefix-cache reset, live configuration."""

    def __init__(self, tracer: StepTracer, get_controls: Callable[[], Controls | None]) -> None:
        self._tracer = tracer
        self._get_controls = get_controls

    async def _controls(self, context: grpc.aio.ServicerContext) -> Controls:
        controls = self._get_controls()
        if controls is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is still loading")
        return controls

    async def WatchSteps(
        self, request: pb.WatchStepsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepTrace]:
        queue = self._tracer.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self._tracer.unsubscribe(queue)

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        controls = await self._controls(context)
        return pb.ResetPrefixCacheResponse(num_blocks_dropped=controls.scheduler.pool.reset_cache())

    async def GetConfig(self, request: pb.GetConfigRequest, context: grpc.aio.ServicerContext) -> pb.SchedulingConfig:
        return describe((await self._controls(context)).scheduler.snapshot())

    async def UpdateConfig(
        self, request: pb.SchedulingConfig, context: grpc.aio.ServicerContext
    ) -> pb.SchedulingConfig:
        controls = await self._controls(context)
        try:
            return apply_update(controls, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
