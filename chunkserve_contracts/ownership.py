"""One scheduler per executor: the per-launch executor token, the port check, and the
executor child's tie to the process that started it.

- `new_token()` / `executor_child_env()`: `chunkserve serve` and chunkserve.launch make a
  fresh random token per launch and hand it to the executor child through the environment
  (CHUNKSERVE_EXECUTOR_TOKEN), never on its command line, where `ps` would show it. The
  executor then answers only callers that present it, so a second server started on the
  same --executor-port cannot drive the first one's KV cache.
- `ensure_port_free()`: says which port is taken, in one line, before anything loads.
- `tie_to_parent()`: in an executor started as a child (CHUNKSERVE_PARENT_PID set by the
  launcher), stop when that parent dies, even by SIGKILL: PR_SET_PDEATHSIG on Linux when the
  launcher spawned from its main thread (the signal follows the death of the spawning
  *thread*, see prctl(2)), plus a portable watchdog thread that polls getppid().

- GRPC_ENABLE_FORK_SUPPORT=false (unless set): the processes that import this module spawn
  children only by fork + exec, which is what gRPC documents that setting for. With gRPC's
  fork handlers on, `chunkserve serve` restarting its executor while the scheduler's gRPC
  threads were busy once produced a replacement that died of SIGSEGV before exec (log:
  "Other threads are currently calling into gRPC, skipping fork() handlers", then exit -11).
  It must be set before grpc is imported, hence here, at import.

No torch here: the scheduler side and the launchers import it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

log = logging.getLogger(__name__)

TOKEN_ENV = "CHUNKSERVE_EXECUTOR_TOKEN"  # the executor_token flag's variable (chunkserve_contracts.flags)
PARENT_PID_ENV = "CHUNKSERVE_PARENT_PID"  # set by a launcher: the child exits when this pid is gone
PARENT_DEATHSIG_ENV = "CHUNKSERVE_PARENT_DEATHSIG"  # "1": spawned from the main thread, PDEATHSIG is safe
PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL_S = 1.0
EXIT_GRACE_S = 15.0  # after the parent died: time for a graceful stop before a hard exit
# The executor's exit status for a setting that can never work (a taken port, a bad model
# path, argparse's usage errors): `chunkserve serve` reports it and does not restart it.
EXIT_CONFIG_ERROR = 2


def new_token() -> str:
    """A fresh random executor token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def executor_child_env(token: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an executor child of this process: its token, and this process's
    pid so that the child dies with it. PR_SET_PDEATHSIG is requested only when spawning from
    the main thread: it fires when the spawning thread exits, even if the process lives on."""
    env = dict(os.environ if base is None else base)
    env[TOKEN_ENV] = token
    env[PARENT_PID_ENV] = str(os.getpid())
    if threading.current_thread() is threading.main_thread():
        env[PARENT_DEATHSIG_ENV] = "1"
    else:
        env.pop(PARENT_DEATHSIG_ENV, None)
    return env


def ensure_port_free(host: str, port: int, flag: str = "--executor-port") -> None:
    """Raises ValueError naming the port when something already listens on host:port.

    Binds a throwaway socket the way gRPC binds its listener (SO_REUSEADDR, no
    SO_REUSEPORT), so a port in TIME_WAIT counts as free and a listening one as taken.
    Other bind errors (an address that is not local, no IPv6) are left to the real bind."""
    if not port:
        return
    bare = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ValueError(port_in_use(host, port, flag)) from None


def port_in_use(host: str, port: int, flag: str = "--executor-port") -> str:
    return (
        f"cannot listen on {host}:{port}: the port is in use (another chunkserve server's executor? "
        f"each server needs its own {flag})"
    )


def stop_on_signal(stop: threading.Event) -> Callable[[int, Any], None]:
    """A signal handler that sets `stop` without ever blocking: from a short-lived thread,
    once. Why not `stop.set()` in the handler itself: a handler runs on the main thread
    between two bytecodes, so a second SIGTERM can arrive while the first handler is inside
    `Event.set` holding the event's lock, and that lock is not reentrant: the nested handler
    waited on its own thread forever. Seen: a `chunkserve serve` SIGKILLed left its executor
    child alive (1 in 6 tries), four handlers deep in `Event.set`."""
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not fired:
            fired.append(signum)
            threading.Thread(target=stop.set, name="stop-on-signal", daemon=True).start()

    return handler


def tie_to_parent(
    stop: threading.Event, interval_s: float = WATCHDOG_INTERVAL_S, exit_grace_s: float = EXIT_GRACE_S
) -> int | None:
    """In a child started by a launcher that set CHUNKSERVE_PARENT_PID: set `stop` when that
    parent dies, and exit hard if still running `exit_grace_s` later. Returns the parent pid
    being watched, or None when started standalone (by a user, compose, Kubernetes)."""
    raw = os.environ.pop(PARENT_PID_ENV, None)  # popped: not inherited by anything we start
    deathsig = os.environ.pop(PARENT_DEATHSIG_ENV, None) == "1"
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a pid", PARENT_PID_ENV, raw)
        return None
    if deathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if (
                libc.prctl(
                    PR_SET_PDEATHSIG,
                    ctypes.c_ulong(int(signal.SIGTERM)),
                    ctypes.c_ulong(0),
                    ctypes.c_ulong(0),
                    ctypes.c_ulong(0),
                )
                != 0
            ):
                log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on the watchdog", ctypes.get_errno())
        except (OSError, AttributeError) as exc:
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable (%s); relying on the watchdog", exc)
    threading.Thread(
        target=_watch, args=(parent, stop, interval_s, exit_grace_s), daemon=True, name="parent-watchdog"
    ).start()
    return parent


def _watch(parent: int, stop: threading.Event, interval_s: float, exit_grace_s: float) -> None:
    # Checked before the first wait as well: the parent may have died before prctl took effect.
    while os.getppid() == parent:
        if stop.wait(interval_s) and os.getppid() == parent:
            return  # an ordinary shutdown while the parent lives
    log.error("the parent process %d is gone: shutting down", parent)
    stop.set()
    time.sleep(exit_grace_s)
    log.error("still running %g s after the parent died: exiting now", exit_grace_s)
    logging.shutdown()
    os._exit(1)
