"""The executor process: load the model (worker.py, in named phases), serve chunkserve.executor.v1.

A plain threaded gRPC server: steps arrive from the one scheduler (over one StepStream, or
as unary Step calls), and every torch call runs on one compute thread (see
ExecutorServicer), which serialises them even if a second caller appears. Torch work blocks
the handling thread, not the server, so health and handshake calls still answer during a
long step. With an executor token (always, under `chunkserve serve`) only the scheduler that
holds it gets past the interceptor: no second scheduler drives this KV cache.

With --tensor-parallel-size N > 1 this process is rank 0 of a group (executor_svc/tp_group.py):
it forwards every step and reset to ranks 1..N-1 before running it on its own shard.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkserve_contracts.auth import SyncBearerTokenInterceptor
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from chunkserve_contracts.ownership import port_in_use
from executor_svc.config import ExecutorConfig
from executor_svc.plan_check import PlanError
from executor_svc.tp_group import EXIT_GROUP_LOST, Leader, ignore_interrupts, join_group, worker_loop
from executor_svc.worker import Loaded, load

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVICE_NAME = epb.DESCRIPTOR.services_by_name["Executor"].full_name
TOKEN_DENIAL = (
    "missing or wrong executor token: this executor belongs to another scheduler (each "
    "`chunkserve serve` has its own), or CHUNKSERVE_EXECUTOR_TOKEN differs between the services"
)


class ExecutorServicer(epb_grpc.ExecutorServicer):
    """Thin: converts errors to status codes; the runner does the work.

    Every torch call, loading included, runs on the one compute thread it is given. Each
    thread that calls into torch gets its own OpenMP team, and a second team steals the
    cores from the busy one: measured here, a batch-8 decode step took 289 ms on a thread
    other than the one that loaded the model, 123 ms on the same one. One thread also
    serialises the steps.
    """

    def __init__(self, loaded: Loaded, compute: futures.ThreadPoolExecutor) -> None:
        self._loaded = loaded
        self._compute = compute
        # Async scheduling sends step N+1 while N runs, on another gRPC thread: it is queued on
        # the compute thread (first in, first out) only once N is, as follows_step_id says.
        self._order = threading.Condition()
        self._last_queued: int | None = None  # step id last queued since start or Reset

    def Handshake(self, request: epb.HandshakeRequest, context: grpc.ServicerContext) -> epb.HandshakeResponse:
        log.debug("handshake from %s", request.scheduler_version or "a probe")
        return self._loaded.handshake

    def Step(self, request: epb.StepRequest, context: grpc.ServicerContext) -> epb.StepResponse:
        with self._order:
            if request.HasField("follows_step_id"):
                follows = request.follows_step_id
                context.add_callback(self._notify)  # a cancelled call stops waiting at once
                if (
                    not self._order.wait_for(
                        lambda: self._last_queued == follows or not context.is_active(),
                        timeout=context.time_remaining(),
                    )
                    or not context.is_active()
                ):
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"step {request.step_id} follows step {follows}, which never arrived",
                    )
            step = self._compute.submit(self._loaded.step, request)
            self._last_queued = request.step_id
            self._order.notify_all()
        try:
            return step.result()
        except (PlanError, torch.OutOfMemoryError) as exc:
            context.abort(*_refusal(request.step_id, exc))
        raise AssertionError("unreachable: abort raises")

    def StepStream(
        self, requests: Iterator[epb.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[epb.StepOutcome]:
        """Steps over one stream (the scheduler's way). A reader thread queues each step on the
        compute thread as it arrives, so a step sent while the one before runs (async
        scheduling) starts the moment that one ends; this thread answers them in order, a
        streamed multi-step plan's steps (stream_steps) each as it ends."""
        pending: queue.SimpleQueue[tuple[epb.StepRequest, futures.Future | str, queue.SimpleQueue] | None] = (
            queue.SimpleQueue()
        )
        context.add_callback(lambda: pending.put(None))  # cancelled or gone: stop answering

        def read() -> None:
            try:
                for request in requests:
                    steps: queue.SimpleQueue[epb.StepResponse | None] = queue.SimpleQueue()
                    pending.put((request, self._queue_in_stream(request, steps), steps))
            except Exception:  # noqa: BLE001 - the stream broke: the callback above ends the answers
                pass
            finally:
                pending.put(None)

        threading.Thread(target=read, name="step-stream", daemon=True).start()
        while (item := pending.get()) is not None:
            request, step, steps = item
            if isinstance(step, str):
                yield _error(request.step_id, grpc.StatusCode.FAILED_PRECONDITION, step)
                continue
            while (earlier := steps.get()) is not None:  # a streamed plan's steps before its last
                outcome = epb.StepOutcome(result=earlier)  # a copy: the compute thread still reads earlier
                outcome.result.more_steps, outcome.result.num_steps = True, 1
                yield outcome
            try:
                yield epb.StepOutcome(result=step.result())
            except (PlanError, torch.OutOfMemoryError) as exc:
                yield _error(request.step_id, *_refusal(request.step_id, exc))

    def _queue_in_stream(
        self, request: epb.StepRequest, steps: queue.SimpleQueue[epb.StepResponse | None]
    ) -> futures.Future | str:
        """Queues a streamed step on the compute thread; why not, when it follows a step other
        than the one queued last (a stream's steps arrive in order, so it never should).
        `steps` gets a plan's earlier steps where it asks for them (stream_steps), then None."""
        with self._order:
            if request.HasField("follows_step_id") and request.follows_step_id != self._last_queued:
                return (
                    f"step {request.step_id} follows step {request.follows_step_id}, "
                    f"but the step queued before it was {self._last_queued}"
                )
            emit = steps.put if request.stream_steps and request.num_steps > 1 else None
            step = self._compute.submit(self._loaded.step, request, emit)
            self._last_queued = request.step_id
            self._order.notify_all()
        step.add_done_callback(lambda _: steps.put(None))
        return step

    def _notify(self) -> None:
        with self._order:  # reentrant: gRPC may call this on the thread that holds it
            self._order.notify_all()

    def CutSteps(self, request: epb.CutStepsRequest, context: grpc.ServicerContext) -> epb.CutStepsResponse:
        # Read by the compute thread between a multi-step plan's steps (ModelRunner._more_steps).
        self._loaded.runner.cut_steps(request.step_id)
        return epb.CutStepsResponse()

    def Reset(self, request: epb.ResetRequest, context: grpc.ServicerContext) -> epb.ResetResponse:
        with self._order:
            self._last_queued = None  # a new scheduler numbers its steps from 0 again
            reset = self._compute.submit(self._loaded.reset)
        reset.result()
        return epb.ResetResponse()


def _refusal(step_id: int, exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a refused plan or an out-of-memory step ends with (the executor lives on)."""
    if isinstance(exc, PlanError):
        log.error("rejected plan: %s", exc)
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.error("out of memory in step %d: %s", step_id, exc)
    return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory in step {step_id}"


def _error(step_id: int, code: grpc.StatusCode, message: str) -> epb.StepOutcome:
    return epb.StepOutcome(error=epb.StepError(step_id=step_id, code=code.value[0], message=message))


def serve(config: ExecutorConfig, stop: threading.Event | None = None) -> None:
    """Loads, listens, and serves until stop is set. With config.executor_token every
    executor call must carry it (UNAUTHENTICATED otherwise); health stays open."""
    stop = stop or threading.Event()
    tp, group = join_group(config)
    if tp.rank > 0:  # a tensor-parallel rank other than 0: no gRPC, it runs what rank 0 sends
        ignore_interrupts()
        loaded = load(config, tp)
        try:
            worker_loop(loaded.runner, loaded.runner.channel)
        except Exception as exc:  # noqa: BLE001 - rank 0 or another rank is gone: so is the group
            log.error("rank %d of %d: the tensor-parallel group ended: %r", tp.rank, tp.size, exc)
            logging.shutdown()
            os._exit(EXIT_GROUP_LOST)
        return
    compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    try:
        loaded = compute.submit(load, config, tp).result()
    except BaseException:
        if group is not None:
            group.stop()
        raise
    if tp.enabled:
        loaded.leader = Leader(loaded.runner.channel, group, config.tensor_parallel_timeout_s)
        loaded.leader.keepalive(compute, stop)
    try:
        if not stop.is_set():  # told to stop (or the parent died) while loading: never listen
            _listen(config, loaded, compute, stop)
    finally:
        if loaded.leader is not None:
            compute.submit(loaded.leader.close).result()
        compute.shutdown()


def _listen(config: ExecutorConfig, loaded: Loaded, compute: futures.ThreadPoolExecutor, stop: threading.Event) -> None:
    address = f"{config.executor_host}:{config.executor_port}"
    interceptors = [SyncBearerTokenInterceptor(config.executor_token, TOKEN_DENIAL)] if config.executor_token else []
    if not interceptors:
        log.warning(
            "no executor token (CHUNKSERVE_EXECUTOR_TOKEN): any process that reaches %s can drive "
            "this executor; keep it on loopback or an internal network",
            address,
        )
    server = grpc.server(
        # The scheduler's step stream holds a thread for its lifetime; the rest answer health,
        # handshakes, resets and unary steps.
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    epb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(loaded, compute), server)
    # The standard health service, for Kubernetes gRPC probes and grpc_health_probe: the
    # server listens only once the model is loaded, so it is SERVING from its first answer.
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    for name in ("", SERVICE_NAME):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:  # grpcio raises RuntimeError on a bind failure (older versions returned 0)
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ValueError(port_in_use(config.executor_host, config.executor_port))
    server.start()
    log.info(
        "executor listening on %s (pid %d%s)", address, os.getpid(), ", token required" if config.executor_token else ""
    )
    stop.wait()
    checker.enter_graceful_shutdown()  # NOT_SERVING while in-flight calls finish
    server.stop(grace=2).wait()
