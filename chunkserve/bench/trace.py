"""Optional step trace: `Admin.WatchSteps` on the scheduler's admin port, during a run.

The trace is a nice-to-have: with no admin address, or a server that does not serve the
Admin service (UNIMPLEMENTED) or has no admin port open (UNAVAILABLE), the watcher stops
quietly, records why in `error`, and the run goes on without the tokens-per-step plot.
Step timestamps are the server's wall clock (seconds since the epoch); `steps()` turns
them into seconds from the start of the run, comparable with the request records when
server and bench share a host (or synchronised clocks).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from chunkserve_contracts.auth import admin_metadata
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_QUIET_CODES = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class StepTraceWatcher:
    """Collects StepTrace messages in the background between `start()` and `stop()`."""

    def __init__(self, admin_address: str | None) -> None:
        self.address = admin_address
        self.traces: list[pb.StepTrace] = []
        self.error = ""  # why no trace was recorded (stays "" when none was asked for)
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None

    async def start(self, ready_timeout: float = 2.0) -> None:
        """Opens the stream (waits briefly for the connection so no early step is missed)."""
        if not self.address:
            return
        self._channel = grpc.aio.insecure_channel(self.address)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), ready_timeout)
        except TimeoutError:
            self.error = f"admin address {self.address} not reachable"
            await self._close()
            return
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0.05)  # let the call reach the server before the first request

    async def _watch(self) -> None:
        stub = pb_grpc.AdminStub(self._channel)
        try:
            async for trace in stub.WatchSteps(pb.WatchStepsRequest(), metadata=admin_metadata()):
                self.traces.append(trace)
        except grpc.aio.AioRpcError as exc:
            self.error = f"WatchSteps: {exc.code().name}: {exc.details()}"
            if exc.code() not in _QUIET_CODES:
                log.warning("%s", self.error)

    async def stop(self) -> None:
        """Ends the stream; the traces collected so far stay in `traces`."""
        if self._task is not None:
            await asyncio.sleep(0.05)  # the last step's trace may still be in flight
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._close()

    async def _close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def steps(self, start_wall: float) -> list[dict]:
        """The traces as plain dicts, `t` = seconds from the run's start."""
        return [
            {
                "t": t.timestamp - start_wall,
                "step_id": t.step_id,
                "num_tokens": t.num_tokens,
                "token_budget": t.token_budget,
                "num_prefill_tokens": t.num_prefill_tokens,
                "num_decode_tokens": t.num_decode_tokens,
                "num_steps": t.num_steps or 1,  # a multi-step plan: 1 + as many decodes of its num_seqs
                "num_seqs": len(t.seqs),
                "num_running": t.num_running,
                "num_waiting": t.num_waiting,
                "num_preempted": t.num_preempted,
                "kv_cache_usage": round(t.kv_cache_usage, 4),
            }
            for t in self.traces
        ]

    def first_scheduled(self, start_wall: float) -> dict[str, float]:
        """Request id -> time (from the run's start) of the first step that computed it."""
        first: dict[str, float] = {}
        for t in self.traces:
            for s in t.seqs:
                first.setdefault(s.request_id, t.timestamp - start_wall)
        return first
