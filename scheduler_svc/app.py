"""Start-up and shutdown of the scheduler service.

The public server starts first, so health checks answer while the executor loads: the
process is SERVING at "" (alive) and the Generation service is NOT_SERVING until the
executor's handshake has sized the block pool. Limits are decided here from the handshake
and the config by config.validate_against_executor, the rules every live change passes too:
a setting that can never work stops start-up with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkserve_contracts import __version__
from chunkserve_contracts.auth import BearerTokenInterceptor
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2, replica_pb2_grpc
from scheduler_svc.admin import AdminServicer, Controls
from scheduler_svc.admin_access import AdminAccess
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig, resolve_auto, validate_against_executor
from scheduler_svc.engine import Engine
from scheduler_svc.executor_client import MAX_MESSAGE_BYTES, ExecutorClient
from scheduler_svc.grammar import LLGuidanceCompiler
from scheduler_svc.http_api import HttpFront
from scheduler_svc.http_extras import generation_defaults, parse_origins
from scheduler_svc.kv_events import KVEventLog
from scheduler_svc.kv_events_zmq import parse_kv_events_config
from scheduler_svc.metrics import Metrics
from scheduler_svc.mux import SERVICE as MUX_SERVICE
from scheduler_svc.mux import MuxServicer, add_mux_servicer
from scheduler_svc.openai_protocol import Settings
from scheduler_svc.policy import Policy, create_policy
from scheduler_svc.reflection import enable_reflection
from scheduler_svc.replica import ReplicaServicer, StepCostWatch
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import GenerationServicer, add_generation_servicer
from scheduler_svc.stats_log import log_stats_forever
from scheduler_svc.tokenizer import Tokenizer, read_chat_template
from scheduler_svc.trace import StepTracer
from scheduler_svc.validation import Limits

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# The public server's transport limit on one incoming message. The server listens before the
# handshake fixes max_model_len, so this is fixed: 16 MiB holds the ids of a 3-million-token
# prompt, or a text prompt averaging 128 bytes per token at max_model_len 131072. Once
# serving, a GenerateRequest over the largest valid one (Limits.max_request_bytes, usually far
# smaller) is refused before it is parsed (servicer.add_generation_servicer).
MAX_PUBLIC_REQUEST_BYTES = 16 * 1024 * 1024


def refused_message(address: str) -> str:
    """One line for an executor that refused this scheduler's token (UNAUTHENTICATED)."""
    return (
        f"the executor at {address} refused this scheduler (UNAUTHENTICATED): it belongs to another "
        "server (another `chunkserve serve` on the same --executor-port?) or CHUNKSERVE_EXECUTOR_TOKEN "
        "differs between the scheduler and the executor"
    )


def _listen(add_port: Callable[[], int], flag: str, address: str) -> int:
    """gRPC's add_*_port, with its RuntimeError (a port taken since start-up checked it, an
    address not of this host) as a ValueError of one line naming the flag."""
    try:
        return add_port()
    except RuntimeError:
        port = address.rsplit(":", 1)[-1]
        raise ValueError(
            f"{flag} {port}: cannot listen on {address} (the port is in use, or the address is not one of this host)"
        ) from None


@dataclass
class Ready:
    engine: Engine
    limits: Limits
    info: pb.GetInfoResponse
    client: ExecutorClient
    controls: Controls


class SchedulerApp:
    """The scheduler process: public server, health, executor connection, engine."""

    def __init__(self, config: SchedulerConfig, access: AdminAccess | None = None) -> None:
        """`access`: who may call the admin port (none given: no token, so loopback only)."""
        self.config = config
        self.access = access or AdminAccess()
        if config.admin_port:
            self.access.check(config.admin_host)  # beyond loopback: a token, or the explicit opt-out
        self.ready: Ready | None = None
        self.health = health.aio.HealthServicer()
        interceptors = [BearerTokenInterceptor(config.api_key)] if config.api_key else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_PUBLIC_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        servicer = GenerationServicer(
            lambda: None if self.ready is None else (self.ready.engine, self.ready.limits, self.ready.info)
        )
        add_generation_servicer(servicer, self.server)
        add_mux_servicer(MuxServicer(servicer), self.server)  # a router's calls on one stream, same admission
        # The OpenAI-compatible HTTP API: the same servicer's admission path, engine and loop.
        self.http = None
        if config.http_port:
            self.http = HttpFront(
                servicer,
                config.api_key,
                Settings(
                    trust_request_chat_template=config.trust_request_chat_template,
                    reject_unknown_fields=config.openai_unknown_fields == "reject",
                ),
                parse_origins(config.allowed_origins),
                access_log=not config.disable_uvicorn_access_log,
            )
        self._stats: asyncio.Task[None] | None = None
        self.http_port = 0
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(
            self.server, SERVICE_NAME, MUX_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        )
        self.port = 0
        self.metrics: Metrics | None = None
        self._grammars: tuple[tuple, LLGuidanceCompiler | None] | None = None  # kept across reconnects
        self._supervisor: asyncio.Task[None] | None = None
        self.tracer = StepTracer(config.step_trace_file)
        self.admin: grpc.aio.Server | None = None
        # KV cache events (kv_events.py): attached to the pool by the first watcher or, with
        # --kv-events-config, at start-up; the step-time model a router reads (replica.py).
        self._kv_config = parse_kv_events_config(config.kv_events_config)
        self.kv_events = KVEventLog(self._kv_config.buffer_steps if self._kv_config else 10_000)
        self.kv_publisher = None  # kv_events_zmq.ZmqPublisher, made at start-up with --kv-events-config
        self.step_costs = StepCostWatch()
        if config.admin_port:
            self.admin = grpc.aio.server(interceptors=self.access.interceptors(), options=[("grpc.so_reuseport", 0)])
            servicer = AdminServicer(self.tracer, lambda: None if self.ready is None else self.ready.controls)
            pb_grpc.add_AdminServicer_to_server(servicer, self.admin)
            replica = ReplicaServicer(
                self.kv_events, self.step_costs, lambda: None if self.ready is None else self.ready.controls.scheduler
            )
            replica_pb2_grpc.add_ReplicaServicer_to_server(replica, self.admin)
            enable_reflection(
                self.admin,
                pb.DESCRIPTOR.services_by_name["Admin"].full_name,  # v1 + v1alpha, as above
                replica_pb2.DESCRIPTOR.services_by_name["Replica"].full_name,
            )

    async def start(self) -> None:
        """Listens, then connects to the executor; returns when requests can be served."""
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert_file:
            with open(self.config.tls_cert_file, "rb") as cert, open(self.config.tls_key_file, "rb") as key:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            self.port = _listen(lambda: self.server.add_secure_port(address, credentials), "--port", address)
        else:
            self.port = _listen(lambda: self.server.add_insecure_port(address), "--port", address)
        await self.server.start()
        if self.http is not None:
            self.http_port = await self.http.start(
                self.config.http_host, self.config.http_port, self.config.tls_cert_file, self.config.tls_key_file
            )
            log.info("OpenAI-compatible HTTP API on %s:%d", self.config.http_host, self.http_port)
        if self.admin is not None:
            admin_address = f"{self.config.admin_host}:{self.config.admin_port}"
            _listen(lambda: self.admin.add_insecure_port(admin_address), "--admin-port", admin_address)
            await self.admin.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info(
            "public API on %s:%d; waiting for the executor at %s",
            self.config.host,
            self.port,
            self.config.executor_address,
        )
        client = ExecutorClient(self.config.executor_address, self.config.executor_token)
        try:
            hs = await client.handshake(timeout=self.config.startup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            await client.close()
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ValueError(refused_message(self.config.executor_address)) from None
            raise ValueError(
                f"no executor answered at {self.config.executor_address} within "
                f"{self.config.startup_timeout_s:g} s ({exc.code().name}): start it first "
                "(python -m executor_svc) or raise --startup-timeout-s"
            ) from None
        if self._kv_config is not None:
            from scheduler_svc.kv_events_zmq import ZmqPublisher  # pyzmq and msgspec: only with the flag

            self.kv_publisher = ZmqPublisher(self._kv_config, self.kv_events)
        self.ready = self._build(client, hs, self.config, create_policy(self.config.scheduling_policy))
        if self.kv_publisher is not None:
            self.kv_publisher.start(asyncio.get_running_loop())
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="executor-supervisor")
        if not self.config.disable_log_stats:
            self._stats = asyncio.get_running_loop().create_task(
                log_stats_forever(self._stats_source), name="stats-log"
            )

    def _stats_source(self) -> tuple[Any, str] | None:
        """The registry and model name for the stats line; None while not serving."""
        if self.ready is None or self.metrics is None or self.ready.engine.is_dead:
            return None
        return self.metrics.registry, self.ready.info.model_name

    def _build(
        self, client: ExecutorClient, hs: epb.HandshakeResponse, config: SchedulerConfig, policy: Policy
    ) -> Ready:
        """A fresh block pool, scheduler and engine sized from a handshake."""
        config = resolve_auto(config, hs)  # the `auto` budget and the multi-step default
        max_model_len = validate_against_executor(config, hs)  # the same rules as every live change
        template = read_chat_template(config.chat_template) if config.chat_template else None
        tokenizer = Tokenizer(config.tokenizer or hs.model_path, chat_template=template)
        if self.http is not None:  # the model's sampling defaults (--generation-config), for the HTTP API
            self.http.settings.defaults = generation_defaults(config.generation_config, hs.model_path)
            self.http.model_root = hs.model_path
        limits = Limits.for_tokenizer(max_model_len, hs.model.vocab_size, tokenizer.max_bytes_per_token)
        if limits.max_prompt_bytes is None:
            log.warning(
                "no byte bound on text prompts for this tokenizer (%s): text up to %d MiB is "
                "tokenized (off the event loop) before its length is checked",
                tokenizer.byte_bound_note,
                MAX_PUBLIC_REQUEST_BYTES >> 20,
            )
        elif limits.max_request_bytes > MAX_PUBLIC_REQUEST_BYTES:
            log.warning(
                "text prompts of %d to %d bytes could fit max_model_len %d but exceed the %d MiB message limit",
                MAX_PUBLIC_REQUEST_BYTES,
                limits.max_prompt_bytes,
                max_model_len,
                MAX_PUBLIC_REQUEST_BYTES >> 20,
            )
        host_pool = BlockPool(hs.num_host_blocks, hs.block_size) if hs.num_host_blocks else None
        pool = BlockPool(hs.num_device_blocks, hs.block_size, enable_caching=config.enable_prefix_caching)
        scheduler = Scheduler(config, pool, policy, max_model_len, host_pool)
        if self.kv_events.pool is not None or self.kv_publisher is not None:  # events on: follow the new pool
            self.kv_events.attach(pool)
        eos = frozenset(hs.model.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
        model_name = self.config.served_model_name or hs.model_name  # API, GetInfo and metrics label
        if self.metrics is None:
            self.metrics = Metrics(model_name, max_model_len)
            if config.metrics_port:
                self.metrics.serve(config.metrics_host, config.metrics_port)
        engine = Engine(
            scheduler,
            client,
            tokenizer,
            frozenset(eos),
            config.max_waiting_requests,
            config.step_timeout_s,
            (self.metrics, self.tracer, self.step_costs),
            self._grammar_compiler(config.tokenizer or hs.model_path, hs.model.vocab_size, sorted(eos)),
            device=hs.device,
        )
        engine.start()
        info = pb.GetInfoResponse(
            model_name=model_name,
            max_model_len=max_model_len,
            vocab_size=hs.model.vocab_size,
            dtype=hs.dtype,
            block_size=hs.block_size,
            num_device_blocks=hs.num_device_blocks,
            num_host_blocks=hs.num_host_blocks,
            attention_backend=hs.attention_backend,
            tensor_parallel_size=max(hs.tensor_parallel_size, 1),  # 0 from an executor before the field
            version=__version__,
            eos_token_ids=sorted(eos),
        )
        log.info(
            "serving %s (max_model_len %d, %d KV blocks of %d tokens, %s, %s)",
            hs.model_name,
            max_model_len,
            hs.num_device_blocks,
            hs.block_size,
            hs.dtype,
            hs.attention_backend,
        )
        return Ready(engine, limits, info, client, Controls(scheduler, hs))

    def _grammar_compiler(self, folder: str, vocab_size: int, eos: list[int]) -> LLGuidanceCompiler | None:
        """Structured output's compiler for this tokenizer and vocabulary, made once (its thread
        pool and tokenizer outlive a reconnect to the same model); None when llguidance cannot
        read the tokenizer (constrained requests are then refused, not served free)."""
        key = (folder, vocab_size, tuple(eos))
        if self._grammars is None or self._grammars[0] != key:
            if self._grammars is not None and self._grammars[1] is not None:
                self._grammars[1].close()
            try:
                compiler = LLGuidanceCompiler.from_folder(folder, vocab_size, eos)
            except (OSError, ValueError) as exc:
                log.warning("structured output unavailable: %s", exc)
                compiler = None
            self._grammars = (key, compiler)
        return self._grammars[1]

    async def _supervise(self) -> None:
        """When the executor fails, go NOT_SERVING, wait for it to come back (a supervisor or
        compose restarts it), and resume with a clean block pool and the live settings."""
        while True:
            ready = self.ready
            while not ready.engine.dead.is_set():
                try:
                    await asyncio.wait_for(ready.engine.dead.wait(), timeout=1.0)
                except TimeoutError:
                    if not ready.engine.scheduler.has_work():  # idle: is the executor still there?
                        try:
                            await ready.client.handshake(timeout=2.0)
                        except grpc.RpcError as exc:
                            ready.engine.fail(f"executor unavailable: unreachable ({exc.code().name})")
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            log.error("executor lost; waiting for it to come back at %s", self.config.executor_address)
            await ready.engine.stop()
            if self.metrics is not None:  # its requests all failed: nothing runs, waits or holds KV now
                self.metrics.clear_load()
            refused, unusable = False, ""
            sched = ready.engine.scheduler
            while True:
                try:
                    hs = await ready.client.handshake(timeout=5.0)
                    await ready.client.reset()
                    # An executor restarted with other settings (fewer blocks, a smaller budget)
                    # may not fit the live settings: say why once, stay NOT_SERVING and keep
                    # asking, rather than end this task and never serve again.
                    self.ready = self._build(ready.client, hs, sched.config, sched.policy)
                    break
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED and not refused:
                        refused = True  # said once per outage; keep waiting for our own executor
                        log.error("%s", refused_message(self.config.executor_address))
                    await asyncio.sleep(0.5)
                except (ValueError, OSError) as exc:
                    if str(exc) != unusable:
                        unusable = str(exc)
                        log.error(
                            "the executor came back with settings the live scheduler settings do not fit (%s); "
                            "not serving until an executor that fits answers at %s",
                            exc,
                            self.config.executor_address,
                        )
                    await asyncio.sleep(2.0)
            await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace), self.http.stop(grace) if self.http else asyncio.sleep(0))
        if self.admin is not None:
            await self.admin.stop(None)
        self.tracer.close()
        if self.kv_publisher is not None:
            self.kv_publisher.stop()
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._stats is not None:
            self._stats.cancel()
        if self.ready is not None:
            await self.ready.engine.stop()
            await self.ready.client.close()


async def run_forever(
    config: SchedulerConfig, stop_event: asyncio.Event | None = None, access: AdminAccess | None = None
) -> None:
    """Runs the scheduler until stop_event is set (or forever)."""
    app = SchedulerApp(config, access)
    try:
        await app.start()
        await (stop_event.wait() if stop_event is not None else app.server.wait_for_termination())
    finally:
        await app.stop()
