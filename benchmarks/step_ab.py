"""Batch-1 decode steps of two checkouts in-process, one child process each, taking turns.

Why: through the server (benchmarks/revision_ab.py) a change worth 3-5% of a step is lost in
what the hop and the memory's speed add from request to request (two runs of the same pair
minutes apart gave 1.13 and 0.95). Here each tree's executor is loaded as the server loads it
(`batch1_floor.load_runner`: the tree's own start-up path and kept kernel plan, float32 default
model, fixed threads) in its own process, both stay resident, and they take turns: each round
one child measures the read bandwidth (a 1 GiB sum, best of 2) and the median of `--steps`
decode steps after a 128-token prefill, then the other, the order alternating by round. The
per-round new/old ratio and its median are printed; a round whose two bandwidths differ by more
than 15% is marked, since the memory's speed moved between the halves.

    .venv/bin/python benchmarks/step_ab.py --old /tmp/old [--new .] [--rounds 12] [--steps 40] [--num-steps 8]

With `--num-steps k` each turn times `--steps` plans of k decode steps each (multi-step
decoding, StepRequest.num_steps) and the figure is ms a token: how a multi-step plan's steps
run inside the executor, against the other tree's.

Each child imports its tree's packages through a folder of links (revision_ab.package_links) and
the tree's own benchmarks/batch1_floor.py, so both trees must have one. Nothing is written into
the trees; each tree keeps its kernel plan where its start-up keeps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from revision_ab import package_links  # noqa: E402

CHILD = r"""
import statistics, sys, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import torch
import batch1_floor
from executor_modes import _prefill
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc import memory
runner = batch1_floor.load_runner(int(sys.argv[2]))
steps, k = int(sys.argv[3]), int(sys.argv[4])
x1g = memory.empty(256 * 1024 * 1024, torch.float32).fill_(1.0)


def multi_step_ms():
    # ms a token of `steps` plans of k decode steps each (StepRequest.num_steps), median
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    ctx = len(batch1_floor.PROMPT)
    ids = _prefill(runner, 1, ctx, steps * k, greedy)
    times = []
    for j in range(steps):
        seqs = [epb.ScheduledSequence(seq_id=s, num_computed_tokens=ctx + j * k, num_new_tokens=1, sample=True) for s in ids]
        t = time.perf_counter()
        runner.execute(epb.StepRequest(step_id=1000 + j, seqs=seqs, num_steps=k))
        times.append((time.perf_counter() - t) * 1000 / k)
    return statistics.median(times)


print("ready", flush=True)
for _ in sys.stdin:
    gbs = batch1_floor.bandwidth_gbs(x1g, 2)
    ms = batch1_floor.step_ms(runner, steps) if k == 1 else multi_step_ms()
    print(f"{ms:.3f} {gbs:.1f}", flush=True)
"""


def start(tree: Path, links: Path, cwd: Path, threads: int, steps: int, num_steps: int = 1) -> subprocess.Popen:
    """A child serving one tree's steps; returns once its runner is loaded."""
    env = dict(os.environ, PYTHONPATH=str(links))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tree), str(threads), str(steps), str(num_steps)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    for line in child.stdout:
        if line.strip() == "ready":
            return child
    raise SystemExit(f"the child for {tree} exited before its runner loaded (rc {child.wait()})")


def measure(child: subprocess.Popen) -> tuple[float, float]:
    """(median step ms, read GB/s) of one turn."""
    child.stdin.write("go\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise SystemExit(f"a child exited mid-run (rc {child.wait()}); its error is above")
    ms, gbs = line.split()
    return float(ms), float(gbs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="checkout of the baseline revision")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per turn (the median is taken)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--num-steps",
        type=int,
        default=1,
        help="k > 1: plans of k decode steps (multi-step decoding); the figure is ms a token",
    )
    args = ap.parse_args()
    if args.num_steps < 1 or args.steps < 1:
        ap.error("--steps and --num-steps must be at least 1")
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    tmp = Path(tempfile.mkdtemp())
    children = {}
    try:
        for name, tree in trees.items():  # one at a time: a plan measured beside a loading child is not kept
            links = package_links(tree, tmp / name)
            children[name] = start(tree, links, tmp, args.threads, args.steps, args.num_steps)
        ratios = []
        for rnd in range(args.rounds):
            got = {n: measure(children[n]) for n in (["old", "new"] if rnd % 2 == 0 else ["new", "old"])}
            (old, old_gbs), (new, new_gbs) = got["old"], got["new"]
            ratios.append(new / old)
            moved = "  (memory speed moved)" if max(old_gbs, new_gbs) > 1.15 * min(old_gbs, new_gbs) else ""
            print(
                f"round {rnd + 1}: old {old:.2f} ms ({old_gbs:.0f} GB/s)  new {new:.2f} ms ({new_gbs:.0f} GB/s)"
                f"  new/old {new / old:.3f}{moved}",
                flush=True,
            )
        print(
            f"median new/old {statistics.median(ratios):.3f} over {args.rounds} rounds ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait()


if __name__ == "__main__":
    main()
