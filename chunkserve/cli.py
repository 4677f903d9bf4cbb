"""The `chunkserve` command: `serve` runs both services, `generate` streams a completion.

`serve` runs the scheduler in this process and the executor as a child process (`python -m
executor_svc`), so the two never share an interpreter: this process imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import re
import signal
import sys

from chunkserve_contracts.flags import add_config_flags, config_from_args, config_to_argv, env_name
from chunkserve_contracts.ownership import EXIT_CONFIG_ERROR, ensure_port_free, executor_child_env, new_token

log = logging.getLogger("chunkserve")
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300

# Each command: the line `chunkserve --help` lists it with, the function that adds its parser
# and the one that runs it, as "module:function" (":function": one of this module's own, which
# runs as __main__ under `python -m chunkserve.cli`). Only the command being run is imported,
# so `chunkserve --version` and `--help` import none of them (they work with the scheduler's
# dependencies alone), and one command's missing module or optional dependency never breaks
# another. The lines are the commands' own `help=`: tests/test_packaging.py keeps them equal.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("run the scheduler and an executor child process", ":_serve_parser", ":_serve"),
    "generate": ("stream a completion from a running server", ":_generate_parser", "chunkserve.client:generate_cli"),
    "bench": (
        "load-test a server over gRPC and report latency and throughput",
        "chunkserve.bench.cli:add_bench_parser",
        "chunkserve.bench.cli:run_bench",
    ),
    "admin": (
        "inspect or reconfigure a running server (Admin service)",
        "chunkserve.admin_cli:add_admin_parser",
        "chunkserve.admin_cli:run_admin",
    ),
    "router": (
        "route requests across chunkserve replicas by cached prefix, predicted TTFT and load",
        "chunkserve.router.cli:add_router_parser",
        "chunkserve.router.cli:run_router_cli",
    ),
    "tune": (
        "predict latencies for a grid of scheduler settings by replaying a request log",
        "chunkserve.tune.cli:add_tune_parser",
        "chunkserve.tune.cli:run_tune",
    ),
}


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name) if module else globals()[name]


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from executor_svc.config import DEFAULT_MODEL_HUB_ID, ExecutorConfig
    from scheduler_svc.admin_access import AdminAccess
    from scheduler_svc.config import SchedulerConfig

    p = sub.add_parser(
        "serve",
        help=COMMANDS["serve"][0],
        description="Serve a model: the public gRPC API plus an executor child process.",
    )
    p.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="the model, as vLLM takes it: the same as --model (a local folder, a .gguf file, 'default', or "
        f"{DEFAULT_MODEL_HUB_ID}, which is the default model; nothing is downloaded from a hub)",
    )
    seen: set[str] = set()
    # The executor's address and token are this command's own: a fresh token per launch.
    add_config_flags(p, SchedulerConfig, skip=("executor_address", "executor_token"), seen=seen)
    add_config_flags(p, ExecutorConfig, skip=("executor_token",), seen=seen)
    add_config_flags(p, AdminAccess, seen=seen)  # who may call --admin-port
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=int(os.environ.get(env_name("data_parallel_size")) or 1),
        help="serve this many replicas (a scheduler and an executor each, the CPUs split between them) behind the "
        "cache-aware router on the public ports (chunkserve/dp.py, docs/deploy.md); 1 = one server "
        "[env CHUNKSERVE_DATA_PARALLEL_SIZE]",
    )


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"][0])
    p.add_argument("prompt", help="the prompt text (a user message with --chat)")
    p.add_argument(
        "--address",
        help="host:port of the server's public gRPC API, its `chunkserve serve --port` "
        "(default 127.0.0.1:$CHUNKSERVE_PORT, else 127.0.0.1:50051)",
    )
    # The old spelling, kept for scripts: --host/--port make the address when --address is not given.
    p.add_argument("--host", default=os.environ.get(env_name("host"), "127.0.0.1"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=int(os.environ.get(env_name("port"), "50051")), help=argparse.SUPPRESS)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--presence-penalty", type=float, help="in [-2, 2], OpenAI's meaning (default 0)")
    p.add_argument("--frequency-penalty", type=float, help="in [-2, 2], OpenAI's meaning (default 0)")
    p.add_argument("--repetition-penalty", type=float, help="> 0; > 1 discourages repeats (default 1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--bad-word", action="append", default=[], help="a word never to generate, vLLM's bad_words (repeatable)"
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, help="print each token's logprob and this many alternatives")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    p.add_argument(
        "--api-key",
        default=os.environ.get(env_name("api_key")),
        help="bearer token, when the server has one [env CHUNKSERVE_API_KEY]",
    )
    p.add_argument("--tls-ca-file", help="PEM CA/certificate to trust: connect over TLS")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `chunkserve` parser: `command`'s subparser in full (its module imported), every
    other command's as the line `--help` lists, which parses nothing of its own."""
    from chunkserve_contracts import __version__

    parser = argparse.ArgumentParser(prog="chunkserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"chunkserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_parser, _) in COMMANDS.items():
        if name == command:
            _load(add_parser)(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is no option: `chunkserve` itself takes only
    # -h/--help and --version, neither with a value.
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    sys.exit(_load(COMMANDS[args.command][2])(args))


def _serve(args: argparse.Namespace) -> None:
    import uvloop

    from executor_svc.config import ExecutorConfig
    from scheduler_svc.admin_access import AdminAccess
    from scheduler_svc.config import AUTO_MAX_BATCHED_TOKENS, SchedulerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = new_token()  # this launch's executor answers this scheduler only
    try:
        given = _model_arg(args)
        model = check_model(given)
        auto = {"max_num_batched_tokens": AUTO_MAX_BATCHED_TOKENS} if args.max_num_batched_tokens == 0 else {}
        executor = config_from_args(ExecutorConfig, args, executor_token=token, model=model, **auto)
        host = "127.0.0.1" if executor.executor_host in ("0.0.0.0", "::") else executor.executor_host
        scheduler = config_from_args(
            SchedulerConfig,
            args,
            executor_address=f"{host}:{executor.executor_port}",
            executor_token=token,
            served_model_name=served_name(given, args.served_model_name),
        )
        access = config_from_args(AdminAccess, args)
        if scheduler.admin_port:  # with -dp N, the router's admin port: the same rule
            access.check(scheduler.admin_host)
        # Before anything starts: another server's executor on that port is said in one line.
        ensure_port_free(executor.executor_host, executor.executor_port)
        check_ports(scheduler, executor.executor_port)  # and every port this process listens on
        from scheduler_svc.kv_events_zmq import parse_kv_events_config

        parse_kv_events_config(scheduler.kv_events_config)  # a bad --kv-events-config before anything starts
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    except ValueError as exc:
        print(f"chunkserve serve: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    if args.data_parallel_size > 1:
        from chunkserve.dp import serve_data_parallel

        sys.exit(uvloop.run(serve_data_parallel(args.data_parallel_size, scheduler, executor, model, access)))
    sys.exit(uvloop.run(_serve_async(scheduler, executor, access)))


def served_name(given: str, flag: str | None) -> str | None:
    """The name the API serves: --served-model-name, else (None) the executor's name for the
    model, except the default model, served by its hub id as vLLM names a model by the id it
    was given (its short name stays accepted, openai_protocol.accepted_names)."""
    from executor_svc.config import DEFAULT_MODEL_HUB_ID

    if flag:
        return flag
    return DEFAULT_MODEL_HUB_ID if given in (DEFAULT_MODEL_HUB_ID, "default", "") else None


def _model_arg(args: argparse.Namespace) -> str:
    """The model from the positional MODEL (vLLM's spelling) or --model; both must agree."""
    given, flag = args.model_arg, args.model
    if given is None:
        return flag
    if flag != _serve_model_default() and flag != given:
        raise ValueError(f"the model is given twice, as {given!r} and as --model {flag!r}: give one")
    return given


def _serve_model_default() -> str:
    return os.environ.get(env_name("model")) or "default"


def check_model(model: str) -> str:
    """The model string the executor gets: the default model's hub id becomes 'default'; any
    other hub id (not a local folder or .gguf file) is refused, since nothing is downloaded."""
    from executor_svc.config import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID

    if model == DEFAULT_MODEL_HUB_ID:
        return "default"
    if model in ("", "default", DEFAULT_MODEL) or os.path.exists(os.path.expanduser(model)):
        return model  # the executor checks folders and files (and says what is wrong with them)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith("."):
        raise ValueError(
            f"{model!r} is no local folder, and chunkserve downloads nothing from a model hub: pass a local "
            f"model folder or .gguf file with --model (or 'default' for {DEFAULT_MODEL_HUB_ID})"
        )
    raise ValueError(f"model {model!r}: no such folder or .gguf file (pass a local model folder, or 'default')")


def check_ports(config: object, executor_port: int) -> None:
    """Says, before the executor child starts loading, in one line, that a port this process
    will listen on is taken (or given to two flags). Ports 0 are off, or chosen by the system."""
    ports = [
        ("--port", config.host, config.port),  # type: ignore[attr-defined]
        ("--http-port", config.http_host, config.http_port),  # type: ignore[attr-defined]
        ("--metrics-port", config.metrics_host, config.metrics_port),  # type: ignore[attr-defined]
        ("--admin-port", config.admin_host, config.admin_port),  # type: ignore[attr-defined]
    ]
    seen = {executor_port: "--executor-port"}
    for flag, host, port in ports:
        if not port:
            continue
        if port in seen:
            raise ValueError(f"{flag} {port} is also {seen[port]}: each needs its own port")
        seen[port] = flag
        off = "" if flag == "--port" else f", or {flag} 0 to turn it off"
        try:
            ensure_port_free(host, port, flag)
        except ValueError:
            raise ValueError(
                f"{flag} {port} is in use (cannot listen on {host}:{port}: another process holds it; "
                f"stop it or choose another {flag}{off})"
            ) from None


async def _serve_async(scheduler_config: object, executor_config: object, access: object = None) -> int:
    """Scheduler here, executor as a child; a child that dies is restarted (at most
    MAX_RESTARTS times in RESTART_WINDOW_S) and the scheduler reconnects on its own. A child
    that exits with EXIT_CONFIG_ERROR (a setting that can never work, e.g. its port is taken)
    is not restarted: this process reports it and exits with the same status.

    The child gets the executor token and this pid through its environment (never its
    command line): it answers only this scheduler and exits when this process dies."""
    from scheduler_svc.app import SchedulerApp

    argv = [sys.executable, "-m", "executor_svc", *config_to_argv(executor_config)]  # no secrets in argv
    env = executor_child_env(executor_config.executor_token)  # type: ignore[attr-defined]
    child = await asyncio.create_subprocess_exec(*argv, env=env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = SchedulerApp(scheduler_config, access)  # type: ignore[arg-type]
    restarts: list[float] = []
    try:
        starting = asyncio.create_task(app.start())
        child_exit = asyncio.create_task(child.wait())
        done, _ = await asyncio.wait({starting, child_exit}, return_when=asyncio.FIRST_COMPLETED)
        if starting not in done:
            starting.cancel()
            if child.returncode == EXIT_CONFIG_ERROR:
                log.error("the executor refused its settings during start-up (its reason is above)")
                return EXIT_CONFIG_ERROR
            log.error("the executor exited with code %s during start-up", child.returncode)
            return 1
        starting.result()
        print(f"chunkserve: serving on {scheduler_config.host}:{app.port}", flush=True)  # type: ignore[attr-defined]
        if app.http is not None:
            print(f"chunkserve: OpenAI-compatible HTTP API on {scheduler_config.http_host}:{app.http_port}", flush=True)  # type: ignore[attr-defined]
        stopping = asyncio.create_task(stop.wait())
        while True:
            done, _ = await asyncio.wait({stopping, child_exit}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return 0
            if child.returncode == EXIT_CONFIG_ERROR:  # restarting cannot help
                log.error(
                    "the executor exited with code %d (its reason is above); not restarting it", EXIT_CONFIG_ERROR
                )
                return EXIT_CONFIG_ERROR
            now = loop.time()
            restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(restarts) > MAX_RESTARTS:
                log.error("the executor exited %d times in %ds; giving up", len(restarts), RESTART_WINDOW_S)
                return 1
            log.error("the executor exited with code %s; restarting it", child.returncode)
            child = await asyncio.create_subprocess_exec(*argv, env=env)
            child_exit = asyncio.create_task(child.wait())
    except ValueError as exc:  # a setting that can never work, found at start-up (a port taken since checked)
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR
    finally:
        await app.stop()
        if child.returncode is None:
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()


if __name__ == "__main__":
    main()
