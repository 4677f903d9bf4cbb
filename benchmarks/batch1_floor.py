"""Batch-1 float32 decode against this machine's weight-read floor, in-process and through the
server, in one run (issue 31, item 7).

Why: a batch-1 decode step of a float32 model is a stream of weight reads, so the floor is
(weight bytes one step reads) / (read bandwidth), and on a shared VM whose bandwidth moves
1.5x within minutes only a floor measured beside each figure means anything. What a user sees
is the server's token, not the executor's step: the server hop (the result's way back,
streaming, planning the next step) and the scheduler and client sharing the cores with the
executor's threads all count. So each round measures, in turn:

- the read bandwidth (a sum over a 1 GiB float32 tensor in huge pages, as the executor keeps
  its weights: executor_svc/memory.py; best of 3), before and after;
- the executor's step in this process (`ModelRunner.execute`, the server's own start-up path
  and kernel plan, one sequence at context ~128, the median of `--steps` decode steps);
- one greedy request through a real two-process server (default flags plus `--server-args`):
  its decode ms per token after the first, from the stream's arrival times;
- during that request, the CPU every other thread used per token (from /proc): the scheduler
  process, the executor's threads other than its compute threads (gRPC and the step stream's
  threads; a compute thread is one busy more than half the request's time) and this client.
  On a machine whose cores the executor's threads fill, that CPU is taken from the step (a
  product ends at a barrier, so a compute thread the OS preempts stops its partner as well):
  it is what the server adds to the in-process step.

and prints each round and the medians, each figure as a multiple of the floor.

    .venv/bin/python benchmarks/batch1_floor.py [--rounds 3] [--max-tokens 128] [--scheduler-args "--async-scheduling"]

`--scheduler-args` given more than once starts a server per value and measures each every
round, in turns, beside the same floor: the one way to compare settings on a machine whose
memory speed moves (e.g. `--scheduler-args "--num-scheduler-steps 1" --scheduler-args ""`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from executor_modes import _decode_plan, _prefill, build, decode_bytes  # noqa: E402
from spec_decode import generate  # noqa: E402

from executor_svc import memory  # noqa: E402

PROMPT = [(i * 53) % 30000 + 200 for i in range(128)]


def bandwidth_gbs(x: torch.Tensor, passes: int = 3) -> float:
    """GB/s of the best of `passes` sums over x (1 GiB of float32)."""
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def step_ms(runner, steps: int) -> float:
    """Median ms of `steps` batch-1 decode steps after a 128-token prefill."""
    from chunkserve_contracts.executor.v1 import executor_pb2 as epb

    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    ids = _prefill(runner, 1, len(PROMPT), steps, greedy)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        runner.execute(_decode_plan(ids, len(PROMPT), k))
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of process `pid` (Linux /proc)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/stat").read().rpartition(")")[2].split()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def served_token(server, max_tokens: int) -> tuple[float, dict[str, float]]:
    """(ms per decode token of one greedy request, CPU ms per token of the scheduler, of the
    executor's threads other than its compute threads, and of this client)."""
    pids = {"scheduler": server.scheduler.pid, "executor": server.executor.pid}
    before = {name: thread_cpu(pid) for name, pid in pids.items()}
    client, wall = own_cpu(), time.perf_counter()
    tokens, rate = asyncio.run(generate(server.address, PROMPT, max_tokens))
    client, wall = own_cpu() - client, time.perf_counter() - wall
    used = {
        name: [cpu - before[name].get(tid, 0.0) for tid, cpu in thread_cpu(pid).items()] for name, pid in pids.items()
    }
    per_token = {
        "scheduler": sum(used["scheduler"]),
        "executor, other threads": sum(cpu for cpu in used["executor"] if cpu <= wall / 2),
        "client": client,
    }
    return 1000 / rate, {name: cpu * 1000 / len(tokens) for name, cpu in per_token.items()}


def load_runner(threads: int):
    """The float32 default model as the server loads it, with the kernel plan it keeps."""
    runner = build("float32", threads, plan="measure")
    runner.threads = None  # a fixed count: the governor would probe other counts mid-measurement
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="in-process decode steps per round")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of the request through the server")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="in-process torch threads")
    ap.add_argument("--executor-args", default="", help="extra flags of the server's executor, e.g. '--num-threads 1'")
    ap.add_argument(
        "--scheduler-args",
        action="append",
        help="extra flags of its scheduler, e.g. '--async-scheduling'; given more than once, a server per "
        "value, each measured every round (in turns) beside the same floor",
    )
    args = ap.parse_args()
    configs = args.scheduler_args or [""]

    runner = load_runner(args.threads)
    weight_bytes = decode_bytes(runner.model)
    x = memory.empty(256 * 1024 * 1024, torch.float32).fill_(1.0)
    servers = start_servers(args.executor_args, configs)
    rows = []  # per round: floor, in-process, then (server token, CPU beside) per config
    try:
        for rnd in range(args.rounds):
            bw = [bandwidth_gbs(x)]
            got, beside = {}, {}
            names = ["in-process", *range(len(configs))]
            for what in names[rnd % len(names) :] + names[: rnd % len(names)]:  # each goes first in turn
                if what == "in-process":
                    got[what] = step_ms(runner, args.steps)
                else:
                    got[what], beside[what] = served_token(servers[what], args.max_tokens)
            bw.append(bandwidth_gbs(x))
            floor = weight_bytes / (statistics.median(bw) * 1e9) * 1000
            rows.append((floor, got["in-process"], [(got[c], sum(beside[c].values())) for c in range(len(configs))]))
            print(
                f"round {rnd + 1}: read {bw[0]:.1f} / {bw[1]:.1f} GB/s -> floor {floor:.1f} ms; "
                f"in-process step {got['in-process']:.1f} ms ({got['in-process'] / floor:.2f}x)",
                flush=True,
            )
            for c, flags in enumerate(configs):
                print(
                    f"  server token {got[c]:.1f} ms ({got[c] / floor:.2f}x) [{flags or 'defaults'}]; CPU ms per "
                    "token beside the step: "
                    + ", ".join(f"{name} {ms:.2f}" for name, ms in beside[c].items())
                    + f" (sum {sum(beside[c].values()):.2f})",
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
    report(rows, configs, weight_bytes, args)


def start_servers(executor_args: str, configs: list[str]) -> list:
    """A two-process server on the float32 default model per scheduler configuration, warmed."""
    from chunkserve.launch import start_server

    servers = []
    for flags in configs:
        servers.append(
            start_server(
                Path(tempfile.mkdtemp()),
                ["--model", "default", "--dtype", "float32", *shlex.split(executor_args)],
                shlex.split(flags),
            )
        )
        asyncio.run(generate(servers[-1].address, PROMPT, 8))  # warm both processes
    return servers


def report(rows: list, configs: list[str], weight_bytes: int, args: argparse.Namespace) -> None:
    floor, inproc = (statistics.median(r[i] for r in rows) for i in range(2))
    print(
        f"\nfloat32 batch 1, {weight_bytes / 1e6:.0f} MB read per step, {args.threads} in-process threads, "
        f"executor flags: {args.executor_args or 'defaults'}; medians of {args.rounds} rounds"
    )
    print(f"weight-read floor     {floor:6.1f} ms")
    print(f"in-process step       {inproc:6.1f} ms   {inproc / floor:.2f}x the floor")
    for c, flags in enumerate(configs):
        served = statistics.median(r[2][c][0] for r in rows)
        beside = statistics.median(r[2][c][1] for r in rows)
        per_round = statistics.median(r[2][c][0] / r[0] for r in rows)
        print(f"server token          {served:6.1f} ms   {served / floor:.2f}x the floor   [{flags or 'defaults'}]")
        print(f"  CPU beside the step {beside:6.2f} ms a token (scheduler + executor's other threads + client)")
        print(f"  server - in-process {served - inproc:6.2f} ms; median of per-round server/floor {per_round:.2f}x")


if __name__ == "__main__":
    main()
