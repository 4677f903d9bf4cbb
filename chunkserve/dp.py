"""`chunkserve serve --data-parallel-size N` (vLLM's spelling): N replicas on one host behind
the cache-aware router (chunkserve/router/).

Each replica is a whole `chunkserve serve` child (its scheduler and its executor child) on
loopback ports offset from the public ones, so it restarts its own executor like a single
server does; the router, in this process, takes the public ports (--port, --http-port,
--admin-port is then the router's Router service, --metrics-port the router's metrics).

Ports of replica i (0-based): gRPC --port + 100 * (i + 1), admin + 1, HTTP + 2, metrics + 3;
its executor --executor-port + 100 * (i + 1). --kv-events-config endpoints are offset by i
as vLLM offsets them per data-parallel rank. CPU: unless --num-threads is given, each executor
gets an equal share of the usable CPUs less one per replica for its scheduler (at least 1),
and with as many CPUs as threads plus schedulers each replica is pinned to its own CPUs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from chunkserve_contracts.flags import config_to_argv
from chunkserve_contracts.ownership import EXIT_CONFIG_ERROR

log = logging.getLogger("chunkserve.dp")
PORT_STRIDE = 100


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    rank: int
    argv: list[str]  # `chunkserve serve` flags
    spec: str  # the router's --replica value
    cpus: list[int] | None  # pinned CPUs, or None


def plan_replicas(n: int, scheduler: object, executor: object, cpus: list[int]) -> list[ReplicaPlan]:
    """The children's flags and the router's view of them (pure: tested without processes)."""
    from scheduler_svc.kv_events_zmq import offset_endpoint

    if scheduler.tls_cert_file:  # type: ignore[attr-defined]
        raise ValueError("--data-parallel-size does not serve TLS yet (the router's public port is plain gRPC)")
    given_threads = executor.num_threads  # type: ignore[attr-defined]
    threads = given_threads or max(1, (len(cpus) - n) // n)
    per_replica = threads + 1  # its executor's threads and its scheduler
    pin = not given_threads and len(cpus) >= n * per_replica
    plans = []
    for i in range(n):
        off = PORT_STRIDE * (i + 1)
        port = scheduler.port + off  # type: ignore[attr-defined]
        changes = dict(
            host="127.0.0.1",
            port=port,
            admin_host="127.0.0.1",
            admin_port=port + 1,
            http_host="127.0.0.1",
            http_port=port + 2 if scheduler.http_port else 0,  # type: ignore[attr-defined]
            metrics_host="127.0.0.1",
            metrics_port=port + 3 if scheduler.metrics_port else 0,  # type: ignore[attr-defined]
        )
        kv = scheduler.kv_events_config  # type: ignore[attr-defined]
        if kv:
            raw = json.loads(kv)
            for key in ("endpoint", "replay_endpoint"):
                if raw.get(key):
                    raw[key] = offset_endpoint(raw[key], i)
            if "endpoint" not in raw:
                raw["endpoint"] = offset_endpoint("tcp://*:5557", i)
            changes["kv_events_config"] = json.dumps(raw)
        sched_i = dataclasses.replace(scheduler, **changes)
        exec_i = dataclasses.replace(
            executor,
            executor_port=executor.executor_port + off,  # type: ignore[attr-defined]
            executor_host="127.0.0.1",
            num_threads=threads,
        )
        # The scheduler's flags last: its --max-num-batched-tokens (0 = auto) wins over the
        # executor's (the child gives its executor the auto limit itself, as this process did).
        argv = config_to_argv(exec_i) + config_to_argv(sched_i, skip=("executor_address",))
        spec = f"127.0.0.1:{port},admin={port + 1}" + (f",http={port + 2}" if changes["http_port"] else "")
        mine = cpus[i * per_replica : (i + 1) * per_replica] if pin else None
        plans.append(ReplicaPlan(i, argv, spec, mine))
    return plans


def tokenizer_folder(scheduler: object, model: str) -> str | None:
    """Where the replicas' tokenizer is, for the router: --tokenizer, the model folder, or the
    default model's converted folder (the executor converts it before it serves)."""
    if scheduler.tokenizer:  # type: ignore[attr-defined]
        return scheduler.tokenizer  # type: ignore[attr-defined]
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model)
    if model in ("", "default") or not model.endswith(".gguf"):
        from executor_svc.config import DEFAULT_MODEL, default_cache_dir

        return str(Path(default_cache_dir()).expanduser() / "models" / DEFAULT_MODEL)
    return None  # a .gguf file: text prompts are routed by load (token-id prompts by cache)


def replica_env(scheduler: object, access: object, base: dict[str, str] | os._Environ) -> dict[str, str]:
    """The replicas' environment. Secrets never go on a command line: the API key and the admin
    tokens reach the replicas here, so they refuse calls without them (the router forwards the
    client's key and reads their Replica service with the read token, else the admin token)."""
    env = dict(base)
    secrets = {
        "CHUNKSERVE_API_KEY": scheduler.api_key,  # type: ignore[attr-defined]
        "CHUNKSERVE_ADMIN_TOKEN": getattr(access, "admin_token", None),
        "CHUNKSERVE_ADMIN_READ_TOKEN": getattr(access, "admin_read_token", None),
    }
    env.update({name: value for name, value in secrets.items() if value})
    return env


async def serve_data_parallel(n: int, scheduler: object, executor: object, model: str, access: object = None) -> int:
    """Starts the N replica children, then the router on the public ports; stops all on a
    signal. A replica that exits is reported and left out by the router's health checks.
    `access` (scheduler_svc.admin.AdminAccess): --admin-token guards the router's admin port and
    reaches the replicas (loopback) through their environment, the router then using it on
    their Replica service (or --admin-read-token, when given)."""
    from chunkserve.router.app import RouterApp, RouterConfig
    from chunkserve.router.replicas import parse_replica
    from chunkserve_contracts.cpu import cpu_budget

    try:
        cpus = sorted(os.sched_getaffinity(0))[: cpu_budget().cpus]
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    try:
        plans = plan_replicas(n, scheduler, executor, cpus)
    except ValueError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR
    children: list[asyncio.subprocess.Process] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    env = replica_env(scheduler, access, os.environ)
    admin_token = getattr(access, "admin_token", None)
    read_token = getattr(access, "admin_read_token", None)
    for plan in plans:
        log.info("replica %d: chunkserve serve %s", plan.rank, " ".join(plan.argv))
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "chunkserve.cli", "serve", *plan.argv, env=env
        )
        if plan.cpus is not None:
            os.sched_setaffinity(child.pid, plan.cpus)  # its executor inherits the mask
        children.append(child)
    config = RouterConfig(
        replicas=[parse_replica(p.spec) for p in plans],
        host=scheduler.host,  # type: ignore[attr-defined]
        port=scheduler.port,  # type: ignore[attr-defined]
        http_host=scheduler.http_host,  # type: ignore[attr-defined]
        http_port=scheduler.http_port,  # type: ignore[attr-defined]
        admin_host=scheduler.admin_host,  # type: ignore[attr-defined]
        admin_port=scheduler.admin_port,  # type: ignore[attr-defined]
        metrics_host=scheduler.metrics_host,  # type: ignore[attr-defined]
        metrics_port=scheduler.metrics_port,  # type: ignore[attr-defined]
        tokenizer=tokenizer_folder(scheduler, model),
        api_key=scheduler.api_key,  # type: ignore[attr-defined]
        admin_token=admin_token,
        admin_allow_unauthenticated=bool(getattr(access, "admin_allow_unauthenticated", False)),
        replica_admin_token=read_token or admin_token,
    )
    app = RouterApp(config)
    try:
        await app.start()
        print(f"chunkserve: {n} data-parallel replicas behind the router on {config.host}:{app.port}", flush=True)
        if app.http is not None:
            print(f"chunkserve: OpenAI-compatible HTTP API on {config.http_host}:{app.http_port}", flush=True)
        exits = [loop.create_task(c.wait()) for c in children]
        stopping = loop.create_task(stop.wait())
        while True:
            done, _ = await asyncio.wait({stopping, *exits}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return 0
            for task in [t for t in exits if t in done]:
                rank = exits.index(task)
                code = task.result()
                log.error("replica %d exited with code %s; the router routes around it", rank, code)
                exits[rank] = loop.create_future()  # reported once
                if all(c.returncode is not None for c in children):
                    return EXIT_CONFIG_ERROR if code == EXIT_CONFIG_ERROR else 1
    except ValueError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR
    finally:
        await app.stop()
        for child in children:
            if child.returncode is None:
                child.terminate()
        for child in children:
            try:
                await asyncio.wait_for(child.wait(), 20)
            except TimeoutError:
                child.kill()
