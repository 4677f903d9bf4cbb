"""The operator service (chunkserve.v1.Admin), on its own port, loopback by default."""
from __future__ import annotations

from typing import AsyncIterator

import grpc

from chunkserve.v1 import chunkserve_pb2 as pb
from chunkserve.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.trace import StepTracer


class AdminServicer(pb_grpc.AdminServicer):
    """Step trace streaming; the subscription ends when the client cancels."""

    def __init__(self, tracer: StepTracer) -> None:
        self._tracer = tracer

    async def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.StepTrace]:
        queue = self._tracer.subscribe()
        try:
            while True:
                yield await queue.get()
        finally:
            self._tracer.unsubscribe(queue)
