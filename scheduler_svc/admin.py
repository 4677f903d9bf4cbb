"""The operator service (chunkserve.v1.Admin), on its own port, loopback by default.

Everything runs on the scheduler's event loop, and the engine only yields to it between
steps, so a change applies at a step boundary: the plan in flight was built under the old
settings, the next one under the new. A change is validated whole before anything moves;
a rejected one leaves everything as it was.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Callable

import grpc

from chunkserve.v1 import chunkserve_pb2 as pb
from chunkserve.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.policy import create_policy
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.trace import StepTracer

_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "max_num_partial_prefills",
           "max_long_partial_prefills", "long_prefill_token_threshold")


@dataclasses.dataclass
class Controls:
    """What the admin service may touch, once the server is ready."""

    scheduler: Scheduler
    executor_max_batched_tokens: int


def describe(sched: Scheduler) -> pb.SchedulingConfig:
    c = sched.config
    return pb.SchedulingConfig(
        policy=sched.policy_name, max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
        enable_chunked_prefill=c.enable_chunked_prefill, max_num_partial_prefills=c.max_num_partial_prefills,
        max_long_partial_prefills=c.max_long_partial_prefills,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.swapped),
        kv_cache_usage=sched.pool.usage, effective_step=sched.num_steps)


def apply_update(controls: Controls, update: pb.SchedulingConfig) -> pb.SchedulingConfig:
    """Validates and applies a change; ValueError (nothing changed) when it cannot work."""
    sched = controls.scheduler
    changes = {f: getattr(update, f) for f in _FIELDS if update.HasField(f)}
    config = dataclasses.replace(sched.config, **changes)  # __post_init__ validates
    if config.max_num_batched_tokens > controls.executor_max_batched_tokens:
        raise ValueError(f"max_num_batched_tokens {config.max_num_batched_tokens} exceeds the executor's "
                         f"{controls.executor_max_batched_tokens}")
    if not config.enable_chunked_prefill and sched.max_model_len > config.max_num_batched_tokens:
        raise ValueError(f"chunked prefill off needs max_num_batched_tokens >= max_model_len "
                         f"({sched.max_model_len}): a longer prompt could never be scheduled")
    policy = create_policy(update.policy) if update.HasField("policy") else sched.policy
    sched.reconfigure(config, policy)
    return describe(sched)


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

    async def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.StepTrace]:
        queue = self._tracer.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self._tracer.unsubscribe(queue)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        controls = await self._controls(context)
        return pb.ResetPrefixCacheResponse(num_blocks_dropped=controls.scheduler.pool.reset_cache())

    async def GetConfig(self, request: pb.GetConfigRequest, context: grpc.aio.ServicerContext
                        ) -> pb.SchedulingConfig:
        return describe((await self._controls(context)).scheduler)

    async def UpdateConfig(self, request: pb.SchedulingConfig, context: grpc.aio.ServicerContext
                           ) -> pb.SchedulingConfig:
        controls = await self._controls(context)
        try:
            return apply_update(controls, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
