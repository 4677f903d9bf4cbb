"""--compare: the same workload against several server configurations, in alternating rounds.

Each configuration is a string of server flags added to the common --server-args (later
flags win, as on a command line). Rounds alternate the order — A, B in odd rounds, B, A in
even ones (A B B A A B ...) — so a slow drift of a shared machine (thermal state, other
jobs) and any cost of going first or second fall on every configuration alike; with a
fixed A, B order the first configuration always runs first, and on this CPU that alone
once made a 2% gain look like a 6% loss (benchmarks/RESULTS.md, prefix caching at 0% hits). Only one server runs at a time: each is started
fresh for its turn (chunkserve.launch.start_server) and stopped before the next starts.
Every run sends the identical workload: same seed, same prompts, same arrival times.
"""

from __future__ import annotations

import logging
import shlex
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from chunkserve.bench.servers import launch
from chunkserve.bench.session import Run, RunOptions, run_once, server_target
from chunkserve.bench.workloads import BenchRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """A named server configuration: the full flag list it is started with."""

    name: str
    args: tuple[str, ...]

    @property
    def command_line(self) -> str:
        return shlex.join(self.args)


def configs_from(common: str, variants: Sequence[str]) -> list[ServerConfig]:
    """A, B, C... = common flags + each variant's flags."""
    if len(variants) < 2:
        raise ValueError("--compare needs at least two configurations, e.g. --compare '' '--no-enable-chunked-prefill'")
    if len(variants) > 26:
        raise ValueError("--compare takes at most 26 configurations")
    return [
        ServerConfig(name, tuple(shlex.split(common) + shlex.split(v)))
        for name, v in zip(string.ascii_uppercase, variants)
    ]


def run_compare(
    configs: Sequence[ServerConfig],
    rounds: int,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    opts: RunOptions,
    log_dir: Path,
    launch_fn: Callable = launch,
    run_fn: Callable = run_once,
) -> dict[str, list[Run]]:
    """Runs every configuration `rounds` times, in forward then reversed order; returns
    name -> its runs, round by round."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    runs: dict[str, list[Run]] = {c.name: [] for c in configs}
    for k in range(rounds):
        for cfg in configs if k % 2 == 0 else list(reversed(configs)):
            log.warning("round %d/%d, config %s: %s", k + 1, rounds, cfg.name, cfg.command_line or "(defaults)")
            server, admin_address = launch_fn(log_dir / f"{cfg.name}-round{k + 1}", list(cfg.args))
            try:
                runs[cfg.name].append(
                    run_fn(
                        server_target(server, opts.backend),
                        requests,
                        arrivals,
                        opts,
                        admin_address,
                        desc=f"{cfg.name} round {k + 1}/{rounds}",
                    )
                )
            finally:
                server.stop()
    return runs
