"""The router's gRPC fronts: chunkserve.v1.Generation proxied to the chosen replica, and the
chunkserve.v1.Router operator service.

Request ids: a client gets the router's own id (`rt-...`) in every message, mapped to the
replica and the replica's id, so Abort reaches the right replica, and a request can move to
another replica before it streamed anything: when its replica fails (UNAVAILABLE, its queue
full: RESOURCE_EXHAUSTED, or the health check took it down) before the first token, the
router places it again elsewhere and the client sees one stream. Once a token was streamed it
cannot move (a second replica would stream it again): the stream ends with the replica's
error, UNAVAILABLE when the replica died.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from chunkserve.router.core import NoReplicaError, Router, Ticket
from chunkserve.router.legs import LegError
from chunkserve.router.wire import request_id_field, with_request_id
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name
LIVE_FIELDS = ("num_free_device_blocks", "num_requests_running", "num_requests_waiting")


@dataclass
class _Placed:
    """Where a router request id runs now."""

    ticket: Ticket | None = None
    replica_request_id: str = ""


def _forwarded(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in context.invocation_metadata() or () if k == "authorization")


class GenerationProxy:
    """chunkserve.v1.Generation on the router. Generate relays bytes: the request is parsed once
    (to route it) and forwarded as it came; the replica's messages are parsed only until the
    first token (admission, retries) and relayed with the router's request id spliced in
    (wire.with_request_id), never decoded and encoded again per token. The replica is reached
    through a leg (legs.py: its Multiplex stream, or a Generate call of its own)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._placed: dict[str, _Placed] = {}

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers: Generate on raw bytes, Abort and GetInfo as messages."""
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            GENERATION,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(self.Generate),  # bytes in, bytes out
                "Abort": unary(self.Abort, pb.AbortRequest.FromString, pb.AbortResponse.SerializeToString),
                "GetInfo": unary(self.GetInfo, pb.GetInfoRequest.FromString, pb.GetInfoResponse.SerializeToString),
            },
        )

    async def Generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            request = pb.GenerateRequest.FromString(data)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid GenerateRequest")
        token_ids = await self.router.token_ids(request)
        cacheable = not request.sampling.HasField("prompt_logprobs")  # those prefill the whole prompt
        rid = f"rt-{uuid.uuid4().hex[:20]}"
        rid_field = request_id_field(rid)
        placed = self._placed[rid] = _Placed()
        tried: set[str] = set()
        admitted = streamed = False
        try:
            while True:
                try:
                    ticket = placed.ticket = self.router.place(token_ids, request.cache_salt or None, tried, cacheable)
                except NoReplicaError as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                replica = ticket.replica
                leg = replica.open_leg(data, _forwarded(context), context.time_remaining())
                first = True
                try:
                    async for chunk in leg:
                        if not streamed:  # admission and the first token: parsed (small, few)
                            msg = pb.GenerateResponse.FromString(chunk)
                            if first:  # the replica's admission message: its id for Abort
                                first = False
                                placed.replica_request_id = msg.request_id
                                if not msg.token_ids and not msg.finished:
                                    if admitted:
                                        continue  # moved: the client already has its first message
                                    admitted = True
                            if msg.token_ids or msg.finished:
                                ticket.got_first_token()
                                streamed = True
                        yield with_request_id(chunk, rid_field)
                    return
                except LegError as exc:
                    if not streamed and exc.code in RETRYABLE:
                        tried.add(replica.name)
                        self.router.metrics.retries.labels(replica.name, exc.code.name).inc()
                        log.info("request %s moves off %s (%s) before any token", rid, replica.name, exc.code.name)
                        continue
                    self.router.metrics.failed.labels(replica.name, exc.code.name).inc()
                    await context.abort(exc.code, f"{exc.details} (replica {replica.name})")
                finally:
                    leg.close()  # the client left, or the request moved: nothing runs for nobody
                    ticket.release()
        finally:
            self._placed.pop(rid, None)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        placed = self._placed.get(request.request_id)
        if placed is None or placed.ticket is None or not placed.replica_request_id:
            return pb.AbortResponse(found=False)
        stub = placed.ticket.replica.generation
        reply = await stub.Abort(pb.AbortRequest(request_id=placed.replica_request_id), metadata=_forwarded(context))
        return reply

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        """One replica's description with the live counts summed over every serving replica,
        and num_device_blocks / num_host_blocks summed: the router's whole capacity."""
        replicas = self.router.replicas.routable()
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving")
        md = _forwarded(context)
        answers = await asyncio.gather(
            *(r.generation.GetInfo(request, metadata=md, timeout=5) for r in replicas), return_exceptions=True
        )
        infos = [a for a in answers if isinstance(a, pb.GetInfoResponse)]
        if not infos:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica answered GetInfo")
        info = pb.GetInfoResponse()
        info.CopyFrom(infos[0])
        for name in (*LIVE_FIELDS, "num_device_blocks", "num_host_blocks"):
            setattr(info, name, sum(getattr(i, name) for i in infos))
        return info


class RouterAdmin(rpb_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def _status(self, r) -> rpb.ReplicaStatus:
        return rpb.ReplicaStatus(
            address=r.name,
            healthy=r.healthy and r.events_connected,
            draining=r.draining,
            cached_blocks=len(r.index),
            in_flight=r.in_flight,
            load=r.load,
        )

    async def ListReplicas(
        self, request: rpb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListReplicasResponse:
        return rpb.ListReplicasResponse(replicas=[self._status(r) for r in self.router.replicas.replicas.values()])

    async def DrainReplica(
        self, request: rpb.DrainReplicaRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ReplicaStatus:
        r = self.router.replicas.replicas.get(request.address)
        if r is None:
            known = ", ".join(self.router.replicas.replicas) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"address: no replica {request.address!r} (known: {known})")
        r.draining = request.drain
        log.info("replica %s %s", r.name, "drained" if r.draining else "resumed")
        return self._status(r)
