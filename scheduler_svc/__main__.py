"""`python -m scheduler_svc`: the public API and scheduler, connecting to a running executor."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading

import uvloop

from chunkserve_contracts.flags import add_config_flags, config_from_args
from chunkserve_contracts.ownership import tie_to_parent
from scheduler_svc.admin_access import AdminAccess
from scheduler_svc.app import run_forever
from scheduler_svc.config import SchedulerConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    add_config_flags(parser, SchedulerConfig)
    add_config_flags(parser, AdminAccess)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(SchedulerConfig, args)
        access = config_from_args(AdminAccess, args)
        if config.admin_port:
            access.check(config.admin_host)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        uvloop.run(_serve(config, access))
    except ValueError as exc:  # a setting that can never work: say what to change, no traceback
        logging.getLogger("scheduler_svc").error("%s", exc)
        sys.exit(2)


async def _serve(config: SchedulerConfig, access: AdminAccess) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    orphaned = threading.Event()
    if tie_to_parent(orphaned) is not None:  # started by a launcher: stop when it dies
        # A daemon thread, not the loop's default executor: closing the loop joins that
        # executor's threads, and one blocked on this event held every SIGTERM'd scheduler
        # started by a launcher until it was killed.
        def stop_when_orphaned() -> None:
            orphaned.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: it stopped already
                loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=stop_when_orphaned, daemon=True, name="orphan-stop").start()
    try:
        await run_forever(config, stop, access)
    finally:
        orphaned.set()  # an ordinary shutdown: the parent watchdog returns


if __name__ == "__main__":
    main()
