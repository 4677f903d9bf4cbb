"""Server configurations the bench starts itself, and where it finds the model's files.

A configuration is a string of `chunkserve serve` flags (`"--max-num-batched-tokens 256
--no-enable-chunked-prefill"`). Each flag is routed by name to the process whose config
dataclass has that field: executor flags (`--model`, `--dtype`, `--block-size`...) to
`python -m executor_svc`, scheduler flags (`--enable-chunked-prefill`, `--max-num-seqs`...)
to `python -m scheduler_svc`, and a flag both know (`--max-num-batched-tokens`) to both,
so one string describes a whole server. Ports and addresses belong to
chunkserve.launch.start_server and are refused here.

Nothing here imports torch: the config modules are plain dataclasses, and the default
model's folder is looked up in the cache (converted in a child process if missing).
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

from chunkserve.launch import Server, start_server

# Chosen by the bench: free loopback ports, and a fresh executor token passed through the
# environment (a token on a command line would show in `ps`).
_OWNED_BY_LAUNCH = {"host", "port", "executor_host", "executor_port", "executor_address", "executor_token"}


def _fields(cls: type) -> dict[str, bool]:
    """Config field name -> whether its flag takes a value (booleans do not)."""
    return {f.name: str(f.type).strip() != "bool" for f in dataclasses.fields(cls) if f.metadata.get("help")}


def split_server_args(args: str | list[str]) -> tuple[list[str], list[str]]:
    """One flag string -> (executor argv, scheduler argv), each flag where it belongs."""
    from executor_svc.config import ExecutorConfig
    from scheduler_svc.config import SchedulerConfig

    executor_fields, scheduler_fields = _fields(ExecutorConfig), _fields(SchedulerConfig)
    tokens = shlex.split(args) if isinstance(args, str) else list(args)
    executor_argv: list[str] = []
    scheduler_argv: list[str] = []
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if not flag.startswith("--"):
            raise ValueError(f"server args: expected a --flag, got {flag!r} in {tokens}")
        name, has_inline, _ = flag[2:].partition("=")
        name = name.replace("-", "_")
        if name in _OWNED_BY_LAUNCH:
            raise ValueError(f"server args: {flag} is chosen by the bench (free loopback ports, its own token)")
        negated = name not in executor_fields and name not in scheduler_fields and name.startswith("no_")
        name = name.removeprefix("no_") if negated else name
        if name not in executor_fields and name not in scheduler_fields:
            raise ValueError(f"server args: unknown flag {flag} (see `chunkserve serve --help`)")
        takes_value = executor_fields.get(name, False) or scheduler_fields.get(name, False)
        if negated and takes_value:
            raise ValueError(f"server args: {flag}: only on/off flags have a --no- form")
        group = [flag]
        if takes_value and not has_inline:
            if i + 1 >= len(tokens):
                raise ValueError(f"server args: {flag} needs a value")
            group.append(tokens[i + 1])
        if name in executor_fields:
            executor_argv += group
        if name in scheduler_fields:
            scheduler_argv += group
        i += len(group)
    return executor_argv, scheduler_argv


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value of `--flag V` / `--flag=V` in an argv, or None."""
    value = None
    for i, tok in enumerate(args):
        if tok == flag and i + 1 < len(args):
            value = args[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def launch(log_dir: Path, args: str | list[str]) -> tuple[Server, str | None]:
    """Starts a server for one configuration; returns it and its admin address (or None).

    start_server opens the scheduler's admin port where it knows how (`Server.admin_address`);
    otherwise the bench passes `--admin-port` itself when the scheduler has that flag. A
    configuration's own `--admin-port` comes last on the command line, so it wins.
    """
    executor_argv, scheduler_argv = split_server_args(args)
    log_dir.mkdir(parents=True, exist_ok=True)
    launch_opens_admin = hasattr(Server, "admin_address")
    own_port = flag_value(scheduler_argv, "--admin-port")
    if not launch_opens_admin and own_port is None and "admin_port" in _scheduler_fields():
        from chunkserve.launch import free_port

        own_port = str(free_port())
        scheduler_argv += ["--admin-port", own_port]
    server = start_server(log_dir, executor_argv, scheduler_argv)
    if own_port is not None:
        return server, f"127.0.0.1:{own_port}" if own_port != "0" else None
    return server, server.admin_address if launch_opens_admin else None  # type: ignore[attr-defined]


def _scheduler_fields() -> dict[str, bool]:
    from scheduler_svc.config import SchedulerConfig

    return _fields(SchedulerConfig)


def default_model_folder() -> Path:
    """The default model's converted folder (converted once, in a child process, if missing)."""
    from executor_svc.config import default_cache_dir

    folder = Path(default_cache_dir()) / "models" / "SmolLM2-135M-Instruct"
    if (folder / "tokenizer.json").is_file():
        return folder
    code = (
        "from pathlib import Path; from executor_svc.config import default_cache_dir; "
        "from executor_svc.model_loader import resolve_model; "
        "print(resolve_model('default', Path(default_cache_dir())))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def model_folder(server_args: str | list[str]) -> Path:
    """The model folder a configuration serves: its --model if a folder, else the default."""
    executor_argv, _ = split_server_args(server_args)
    model = flag_value(executor_argv, "--model")
    if model and model not in ("default", "SmolLM2-135M-Instruct"):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"--model {model}: the bench needs a local model folder for the tokenizer (or pass --tokenizer)"
            )
        return path
    return default_model_folder()
