"""`chunkserve router`: the process. gRPC Generation + health on --port, the OpenAI HTTP API on
--http-port, the Router operator service on --admin-port, Prometheus on --metrics-port."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkserve.router.core import Router
from chunkserve.router.grpc_front import GenerationProxy, RouterAdmin
from chunkserve.router.metrics import RouterMetrics
from chunkserve.router.replicas import Intervals, Replica, ReplicaAddress, ReplicaSet
from chunkserve_contracts.auth import BearerTokenInterceptor, check_admin_bind
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

log = logging.getLogger(__name__)
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class RouterConfig:
    replicas: list[ReplicaAddress] = field(default_factory=list)
    dns: tuple[str, int, int, int] | None = None  # (name, grpc port, admin port, http port)
    host: str = "0.0.0.0"
    port: int = 50051
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int = 50052
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400
    tokenizer: str | None = None
    policy: str = "cache_aware"
    balance_abs: int = 32
    balance_rel: float = 1.5
    intervals: Intervals = field(default_factory=Intervals)
    # How requests travel to a replica (legs.py): "mux", all of them on one Multiplex stream per
    # replica, or "call", one Generate call each (also the fallback for a replica without mux).
    replica_transport: str = "mux"
    # The replicas' --api-key: required of the router's gRPC clients too (health stays open), and
    # sent on the router's own calls to the replicas. Clients' keys are forwarded as they are.
    api_key: str | None = field(default=None, repr=False)
    # The Router service's token (ListReplicas, DrainReplica): required of every call to
    # --admin-port when set, and needed to listen beyond loopback unless explicitly waived.
    admin_token: str | None = field(default=None, repr=False)
    admin_allow_unauthenticated: bool = False
    # Sent on WatchKVEvents and GetLoad to the replicas' admin ports: their --admin-read-token
    # (or --admin-token).
    replica_admin_token: str | None = field(default=None, repr=False)


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        if not config.replicas and config.dns is None:
            raise ValueError("give the replicas: --replica host:port (repeatable) and/or --replica-dns NAME")
        if config.admin_port:
            check_admin_bind(
                config.admin_host,
                config.admin_token,
                config.admin_allow_unauthenticated,
                "CHUNKSERVE_ROUTER_ADMIN_TOKEN",
            )
        self.config = config
        self.health = health.aio.HealthServicer()
        self.replicas = ReplicaSet(
            config.replicas,
            config.dns,
            config.intervals,
            self._replica_changed,
            api_key=config.api_key,
            admin_token=config.replica_admin_token,
            transport=config.replica_transport,
        )
        self.metrics = RouterMetrics(lambda: list(self.replicas.replicas.values()))
        self.router = Router(
            self.replicas, self.metrics, config.tokenizer, config.policy, config.balance_abs, config.balance_rel
        )
        interceptors = [BearerTokenInterceptor(config.api_key)] if config.api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        self.proxy = GenerationProxy(self.router)
        self.server.add_generic_rpc_handlers((self.proxy.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.admin = None
        if config.admin_port:
            token = config.admin_token
            admin_auth = [BearerTokenInterceptor(token, "missing or wrong router admin token")] if token else []
            self.admin = grpc.aio.server(interceptors=admin_auth, options=[("grpc.so_reuseport", 0)])
        if self.admin is not None:
            rpb_grpc.add_RouterServicer_to_server(RouterAdmin(self.router), self.admin)
        self.http = None
        if config.http_port:
            from chunkserve.router.http_front import HttpProxy  # httpx: only with the HTTP front

            self.http = HttpProxy(self.router)
        self.port = self.http_port = self.admin_port = 0

    def _replica_changed(self, replica: Replica) -> None:
        serving = bool(self.replicas.routable())
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(self.health.set(GENERATION, status))

    async def start(self) -> None:
        c = self.config
        self.port = self.server.add_insecure_port(f"{c.host}:{c.port}")
        if not self.port:
            raise ValueError(f"--port {c.port}: cannot listen on {c.host}:{c.port}")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(GENERATION, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.admin is not None:
            self.admin_port = self.admin.add_insecure_port(f"{c.admin_host}:{c.admin_port}")
            await self.admin.start()
        if self.http is not None:
            self.http_port = await self.http.start(c.http_host, c.http_port)
        if c.metrics_port:
            self.metrics.serve(c.metrics_host, c.metrics_port)
        self.replicas.start()
        log.info(
            "router on %s:%d (HTTP %d, admin %d), policy %s, replica transport %s, %d replicas%s",
            c.host,
            self.port,
            self.http_port,
            self.admin_port,
            c.policy,
            c.replica_transport,
            len(c.replicas),
            f" + DNS {c.dns[0]}" if c.dns else "",
        )
        if not c.tokenizer and c.policy == "cache_aware":
            log.warning(
                "no --tokenizer: text and chat prompts cannot be hashed as the replicas hash them, so only "
                "token-id prompts are routed by cache (the rest by load)"
            )

    async def wait_ready(self, count: int, timeout: float = 600.0) -> None:
        """Returns once `count` replicas serve with their event streams connected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while sum(r.routable and r.events_connected for r in self.replicas.replicas.values()) < count:
            if loop.time() > deadline:
                raise TimeoutError(f"fewer than {count} replicas serving after {timeout:g} s")
            await asyncio.sleep(0.1)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop(grace)
        await self.server.stop(grace)
        if self.admin is not None:
            await self.admin.stop(None)
        await self.replicas.close()
        self.router.close()


async def run_router(config: RouterConfig, stop: asyncio.Event) -> int:
    app = RouterApp(config)
    try:
        await app.start()
        print(f"chunkserve router: serving on {config.host}:{app.port}", flush=True)
        if app.http is not None:
            print(f"chunkserve router: OpenAI-compatible HTTP API on {config.http_host}:{app.http_port}", flush=True)
        await stop.wait()
        return 0
    finally:
        await app.stop()
