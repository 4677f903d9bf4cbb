"""The operator service (chunkserve.v1.Admin), on its own port, loopback by default."""
from __future__ import annotations

from typing import AsyncIterator, Callable

import grpc

from chunkserve.v1 import chunkserve_pb2 as pb
from chunkserve.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.block_manager import BlockPool
from scheduler_svc.trace import StepTracer


class AdminServicer(pb_grpc.AdminServicer):
    """Operator calls. Everything runs on the scheduler's event loop, so a call takes effect
    between two steps, never in the middle of building one."""

    def __init__(self, tracer: StepTracer, get_pool: Callable[[], BlockPool | None]) -> None:
        self._tracer = tracer
        self._get_pool = get_pool

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        pool = self._get_pool()
        if pool is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is still loading")
        return pb.ResetPrefixCacheResponse(num_blocks_dropped=pool.reset_cache())

    async def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.StepTrace]:
        queue = self._tracer.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self._tracer.unsubscribe(queue)
