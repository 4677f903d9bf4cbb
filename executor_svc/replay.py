"""`python -m executor_svc.replay`: run recorded step plans through a real executor, no gRPC.

For tests and step-time measurements of the executor alone (tensor parallelism included):
loads the model as `python -m executor_svc` would with the same flags (with
--tensor-parallel-size N > 1 it starts ranks 1..N-1, which run the ordinary worker path),
then runs every StepRequest of --plans in order and writes the StepResponses to --out.
A refused plan is written as an empty response with step_id and no sampled tokens, and
the error text goes to the log. Both files are length-delimited: a 4-byte little-endian
length, then the serialized message.
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.flags import add_config_flags, config_from_args
from executor_svc.config import ExecutorConfig

log = logging.getLogger("executor_svc.replay")


def write_messages(path: Path, messages: Iterable[object]) -> None:
    with open(path, "wb") as f:
        for m in messages:
            data = m.SerializeToString()  # type: ignore[attr-defined]
            f.write(struct.pack("<I", len(data)) + data)


def read_messages(path: Path, cls: type) -> Iterator[object]:
    data = Path(path).read_bytes()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        yield cls.FromString(data[pos + 4 : pos + 4 + n])
        pos += 4 + n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executor_svc.replay", description=__doc__)
    parser.add_argument("--plans", type=Path, required=True, help="length-delimited StepRequests")
    parser.add_argument("--out", type=Path, required=True, help="where the StepResponses go")
    parser.add_argument(
        "--comm-out",
        type=Path,
        help="JSON list: per plan, [wall ns of the step including the plan's broadcast, rank 0's ns inside collectives]",
    )
    add_config_flags(parser, ExecutorConfig)
    args = parser.parse_args(argv)
    config = config_from_args(ExecutorConfig, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s replay: %(message)s")

    from concurrent import futures

    from executor_svc.collectives import CommClock
    from executor_svc.plan_check import PlanError
    from executor_svc.tp_group import Leader, join_group
    from executor_svc.worker import load

    plans = list(read_messages(args.plans, epb.StepRequest))
    tp, group = join_group(config)
    try:
        # One compute thread, as in the server (the group's keepalive is not needed here:
        # the plans follow each other without idle time).
        compute = futures.ThreadPoolExecutor(max_workers=1)
        loaded = compute.submit(load, config, tp).result()
        if tp.enabled:
            loaded.leader = Leader(loaded.runner.channel, group, config.tensor_parallel_timeout_s)
        responses, comm = [], []
        for plan in plans:
            before, start = CommClock.ns, time.perf_counter_ns()
            try:
                responses.append(compute.submit(loaded.step, plan).result())
            except PlanError as exc:
                log.error("refused: %s", exc)
                responses.append(epb.StepResponse(step_id=plan.step_id))
            comm.append([time.perf_counter_ns() - start, CommClock.ns - before])
        write_messages(args.out, responses)
        if args.comm_out:
            args.comm_out.write_text(json.dumps(comm))
        if loaded.leader is not None:
            compute.submit(loaded.leader.close).result()
            group = None
        compute.shutdown()
    finally:
        if group is not None:
            group.stop()


if __name__ == "__main__":
    sys.exit(main())
