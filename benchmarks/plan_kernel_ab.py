"""Two kernels for one plan bucket, timed in whole decode steps (issue 31, item 7).

The linear plan times each kernel on the model's linears alone; a step adds what the kernel
decides beyond its product (only "packed" and "gemv(-stream)" let a decode step run as the fused native
layers). This loads the default model in float32 as the server does (its kept plan), then for
each batch size swaps the plan's kernel for that size between KERNEL_A and KERNEL_B (the head
keeps its plan), decode steps of the same sequences taking turns, and prints the median step
of each and their ratio.

    .venv/bin/python benchmarks/plan_kernel_ab.py [--batch 1 12 16 32 64] [--kernels mm packed] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import executor_modes as em  # noqa: E402

from chunkserve_contracts.executor.v1 import executor_pb2 as epb  # noqa: E402
from executor_svc.models import kernel_plan as kp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 12, 16, 32, 64])
    ap.add_argument("--kernels", nargs=2, default=["mm", "packed"], choices=kp.KERNELS)
    ap.add_argument("--steps", type=int, default=16, help="steps of each kernel per batch size")
    ap.add_argument("--ctx", type=int, default=128)
    args = ap.parse_args()
    runner = em.build("float32", 2, plan="measure")
    model = runner.model
    body, head = model.model.plan, model.lm_head.plan
    print(f"kept plan: linears {body}; head {head}", flush=True)
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    for batch in args.batch:
        bucket = next(b for b in body.buckets if b >= batch) if batch <= body.buckets[-1] else body.buckets[-1]
        plans = {
            k: kp.Plan(body.buckets, tuple(k if b == bucket else kb for b, kb in zip(body.buckets, body.kernels)))
            for k in args.kernels
        }
        ids = em._prefill(runner, batch, args.ctx, 2 * args.steps + 8, greedy)
        times: dict[str, list[float]] = {k: [] for k in args.kernels}
        done = 0
        for step in range(args.steps + 2):
            for k in args.kernels if step % 2 else args.kernels[::-1]:
                model.use_plan(plans[k], head)
                t = time.perf_counter()
                runner.execute(em._decode_plan(ids, args.ctx, done))
                done += 1
                if step >= 2:
                    times[k].append((time.perf_counter() - t) * 1e3)
        a, b = (statistics.median(times[k]) for k in args.kernels)
        print(
            f"batch {batch:3} (bucket {bucket}): {args.kernels[0]} {a:7.1f} ms, {args.kernels[1]} {b:7.1f} ms, ratio {a / b:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
