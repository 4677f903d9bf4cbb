"""The router's replicas: addresses, health, KV event index and load, each kept fresh by tasks.

Per replica three tasks run on the router's loop: a gRPC health check of the Generation
service every `health_interval_s` (a failure takes the replica out of routing at once, clears
its index and cancels its in-flight calls, which end UNAVAILABLE or are retried elsewhere when
nothing was streamed yet: grpc_front.py); a WatchKVEvents stream on its admin port (the index:
the set of block hashes it holds; reconnects resume by sequence number, a replay batch
replaces the index); a GetLoad poll every `load_interval_s`.

Replicas come from `--replica host:port[,admin=port][,http=port]` and/or the A records of a
DNS name (a Kubernetes headless Service), re-resolved every `dns_interval_s`: a pod that leaves
the name is dropped, a new one is added.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkserve.router.legs import REPLICA_DOWN, CallLeg, Leg, MuxStream
from chunkserve.router.scoring import RECENT_TAU_S
from chunkserve_contracts.auth import bearer_metadata
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

log = logging.getLogger(__name__)
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one replica listens: public gRPC, admin (Replica service) and, optionally, HTTP."""

    host: str
    port: int
    admin_port: int
    http_port: int = 0

    @property
    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address

    @property
    def grpc(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def admin(self) -> str:
        return f"{self._host}:{self.admin_port}"

    @property
    def http(self) -> str | None:
        return f"http://{self._host}:{self.http_port}" if self.http_port else None


def parse_replica(text: str) -> ReplicaAddress:
    """`host:port[,admin=port][,http=port]`; the admin port defaults to port + 1 (50051 ->
    50052, `chunkserve serve`'s defaults). ValueError names what is wrong."""
    head, *opts = [part.strip() for part in text.split(",")]
    host, sep, port = head.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--replica {text!r}: expected host:port[,admin=port][,http=port]")
    ports = {"admin": int(port) + 1, "http": 0}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in ports or not eq or not value.isdigit():
            raise ValueError(f"--replica {text!r}: unknown option {opt!r} (admin=PORT, http=PORT)")
        ports[key] = int(value)
    return ReplicaAddress(host.strip("[]"), int(port), ports["admin"], ports["http"])


@dataclass
class Replica:
    """One replica's live state in the router."""

    address: ReplicaAddress
    channel: grpc.aio.Channel = field(init=False)
    admin_channel: grpc.aio.Channel = field(init=False)
    generation: pb_grpc.GenerationStub = field(init=False)
    generate: grpc.aio.UnaryStreamMultiCallable = field(init=False)  # Generate on raw bytes (legs.CallLeg)
    transport: str = "mux"  # --replica-transport: how requests travel to it (legs.py)
    auth: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # the router's key, on its Multiplex stream
    mux: MuxStream | None = None  # its Multiplex stream, opened by the first request
    healthy: bool = False
    events_connected: bool = False
    draining: bool = False
    index: set[bytes] = field(default_factory=set)
    routed: collections.Counter[bytes] = field(default_factory=collections.Counter)  # sent, maybe not reported
    load: rpb.ReplicaLoad = field(default_factory=rpb.ReplicaLoad)
    info: pb.GetInfoResponse | None = None
    in_flight: int = 0
    pending_tokens: int = 0  # uncached prompt tokens of in-flight requests with no token yet
    pending_attention: int = 0  # and the query-key pairs their prefill attends to (step_cost.attention_pairs)
    calls: set[CallLeg] = field(default_factory=set)  # in-flight Generate calls, cancelled on failure
    tasks: list[asyncio.Task] = field(default_factory=list)
    watch_task: asyncio.Task | None = None
    last_seq: int | None = None
    _recent: tuple[float, float] = (0.0, 0.0)  # (requests sent lately, decayed to this monotonic time)

    def sent(self, now: float) -> None:
        """Counts a request routed here (scoring.ReplicaView.recent_requests)."""
        self._recent = (self.recent_requests(now) + 1.0, now)

    def recent_requests(self, now: float) -> float:
        """Requests routed here lately: each counts 1 when sent, decaying by e every RECENT_TAU_S."""
        count, at = self._recent
        return count * math.exp(-(now - at) / RECENT_TAU_S) if count else 0.0

    def __post_init__(self) -> None:
        options = [("grpc.keepalive_time_ms", 10_000), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(self.address.grpc, options=options)
        self.admin_channel = grpc.aio.insecure_channel(self.address.admin, options=options)
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.generate = self.channel.unary_stream(f"/{GENERATION}/Generate")  # no (de)serializers: bytes

    @property
    def name(self) -> str:
        return self.address.grpc

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def open_leg(self, data: bytes, metadata: tuple[tuple[str, str], ...], timeout: float | None) -> Leg:
        """Sends a request (`data`, a serialized GenerateRequest) here: on the replica's
        Multiplex stream (transport mux, unless it refused the stream) or as its own Generate
        call with the client's `metadata` and `timeout` (transport call, or the fallback)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def per_call() -> CallLeg:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            return CallLeg(self.generate, self.calls, data, metadata, remaining)

        if self.transport == "mux":
            if self.mux is None or (self.mux.closed and not self.mux.unsupported):
                self.mux = MuxStream(self.channel, self.auth, self.name)
            if not self.mux.unsupported:
                return self.mux.open(data, per_call)
        return per_call()

    def mark_down(self, why: str) -> None:
        """Out of routing now: the index is stale (the event stream is dropped with it and
        starts again from a replay once the replica is back), in-flight calls are cancelled
        (they end UNAVAILABLE, or go elsewhere when nothing was streamed: grpc_front.py), its
        Multiplex stream closed (the next one is tried afresh: a replica that refused it may have
        been upgraded meanwhile)."""
        if self.healthy:
            log.warning("replica %s is down: %s", self.name, why)
        self.healthy = False
        if self.watch_task is not None:
            self.watch_task.cancel()
            self.watch_task = None
        self.events_connected = False
        self.index.clear()
        self.last_seq = None
        for call in list(self.calls):
            call.cancel()
        if self.mux is not None:
            self.mux.close(REPLICA_DOWN)
            self.mux = None

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.mark_down("removed")
        await self.channel.close()
        await self.admin_channel.close()


@dataclass
class Intervals:
    health_s: float = 1.0
    load_s: float = 0.1
    dns_s: float = 5.0
    timeout_s: float = 2.0


class ReplicaSet:
    """The replicas and the tasks that keep them fresh."""

    def __init__(
        self,
        static: list[ReplicaAddress],
        dns: tuple[str, int, int, int] | None = None,  # (name, grpc port, admin port, http port)
        intervals: Intervals | None = None,
        on_change: Callable[[Replica], None] = lambda r: None,
        api_key: str | None = None,
        admin_token: str | None = None,
        transport: str = "mux",
    ) -> None:
        self._auth = bearer_metadata(api_key)  # public API calls (GetInfo, Multiplex)
        self.transport = transport
        self._admin_auth = bearer_metadata(admin_token)  # the Replica service on the admin port
        self.intervals = intervals or Intervals()
        self.replicas: dict[str, Replica] = {}
        self._static = static
        self._dns = dns
        self._on_change = on_change
        self._dns_task: asyncio.Task | None = None

    def start(self) -> None:
        for address in self._static:
            self._add(address)
        if self._dns is not None:
            self._dns_task = asyncio.get_running_loop().create_task(self._resolve_forever(), name="router-dns")

    def _add(self, address: ReplicaAddress) -> Replica:
        replica = Replica(address, transport=self.transport, auth=self._auth)
        self.replicas[replica.name] = replica
        loop = asyncio.get_running_loop()
        replica.tasks = [
            loop.create_task(self._health(replica), name=f"health {replica.name}"),
            loop.create_task(self._poll_load(replica), name=f"load {replica.name}"),
        ]
        return replica

    async def _resolve_forever(self) -> None:
        name, port, admin, http = self._dns  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                hosts = sorted({info[4][0] for info in infos})
            except OSError as exc:
                log.warning("cannot resolve %s: %s", name, exc)
                hosts = None
            if hosts is not None:
                found = {ReplicaAddress(h, port, admin, http).grpc: ReplicaAddress(h, port, admin, http) for h in hosts}
                static = {a.grpc for a in self._static}
                for gone in [n for n in self.replicas if n not in found and n not in static]:
                    log.info("replica %s left %s", gone, name)
                    await self.replicas.pop(gone).close()
                for key, address in found.items():
                    if key not in self.replicas:
                        log.info("replica %s found through %s", key, name)
                        self._add(address)
            await asyncio.sleep(self.intervals.dns_s)

    async def _health(self, r: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(r.channel)
        info_stub = pb_grpc.GenerationStub(r.channel)
        while True:
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=GENERATION), timeout=self.intervals.timeout_s
                )
                ok = reply.status == health_pb2.HealthCheckResponse.SERVING
                why = f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            except grpc.aio.AioRpcError as exc:
                ok, why = False, f"health check {exc.code().name}"
            if ok and r.info is None:
                try:
                    r.info = await info_stub.GetInfo(
                        pb.GetInfoRequest(), metadata=self._auth, timeout=self.intervals.timeout_s
                    )
                except grpc.aio.AioRpcError:
                    ok = False
            if ok and not r.healthy:
                log.info("replica %s is serving", r.name)
                r.healthy = True
                r.watch_task = asyncio.get_running_loop().create_task(self._watch(r), name=f"events {r.name}")
                self._on_change(r)
            elif not ok and r.healthy:
                r.mark_down(why)
                r.info = None
                self._on_change(r)
            await asyncio.sleep(self.intervals.health_s)

    async def _watch(self, r: Replica) -> None:
        """The replica's KV events into its index, while it is healthy (mark_down cancels this)."""
        from scheduler_svc.kv_events import apply
        from scheduler_svc.replica import batch_from_proto

        stub = rpb_grpc.ReplicaStub(r.admin_channel)
        refused = False
        while True:
            request = rpb.WatchKVEventsRequest()
            if r.last_seq is not None:
                request.from_seq = max(r.last_seq + 1, 0)
            try:
                async for msg in stub.WatchKVEvents(request, metadata=self._admin_auth):
                    r.events_connected = True
                    apply(r.index, batch_from_proto(msg))  # a replay batch starts with AllBlocksCleared
                    r.last_seq = msg.seq
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and not refused:
                    refused = True  # said once; routed by load only until the token is right
                    log.error(
                        "replica %s refused the router on its admin port %s (UNAUTHENTICATED): set "
                        "CHUNKSERVE_ROUTER_REPLICA_ADMIN_TOKEN to the replicas' --admin-read-token",
                        r.name,
                        r.address.admin,
                    )
                elif r.events_connected:
                    log.warning("KV events from %s interrupted (%s); resubscribing", r.name, exc.code().name)
            r.events_connected = False
            await asyncio.sleep(self.intervals.health_s / 4)

    async def _poll_load(self, r: Replica) -> None:
        stub = rpb_grpc.ReplicaStub(r.admin_channel)
        while True:
            if r.healthy:
                try:
                    r.load = await stub.GetLoad(
                        rpb.GetLoadRequest(), metadata=self._admin_auth, timeout=self.intervals.timeout_s
                    )
                except grpc.aio.AioRpcError:
                    pass  # the health check decides whether it is down
            await asyncio.sleep(self.intervals.load_s)

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable]

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
        for r in list(self.replicas.values()):
            await r.close()
