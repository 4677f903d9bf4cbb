"""`python -m executor_svc`: load the model and serve steps to a scheduler."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from chunkserve_contracts.flags import add_config_flags, config_from_args
from chunkserve_contracts.ownership import EXIT_CONFIG_ERROR, ensure_port_free, stop_on_signal, tie_to_parent
from executor_svc.config import ExecutorConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__)
    add_config_flags(parser, ExecutorConfig)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(ExecutorConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s executor: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_on_signal(stop))  # not stop.set() in the handler: see there
    # Started as a child (`chunkserve serve`, chunkserve.launch): die with the parent, even
    # when it is SIGKILLed, so no orphan keeps the port and a KV cache nobody owns.
    tie_to_parent(stop)
    try:
        # Before torch is imported or anything loads: a taken port is said in one line, now.
        # Tensor-parallel ranks other than 0 (RANK set by rank 0 or torchrun) do not listen.
        if config.tensor_parallel_size == 1 or os.environ.get("RANK", "0") == "0":
            ensure_port_free(config.executor_host, config.executor_port)
        from executor_svc.server import serve  # imports torch: after the flags are parsed

        serve(config, stop)
    except ValueError as exc:  # a setting that cannot work: say what to change, no traceback
        logging.getLogger("executor").error("%s", exc)
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
