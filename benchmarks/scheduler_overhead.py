"""What prefix caching costs the scheduler when nothing hits, without a model.

Drives the real Scheduler (and BlockPool) through a closed-loop workload of distinct
prompts — a 0% hit rate — with an executor that does no work and samples a fixed token, so
the only time measured is the scheduler's own: `schedule()` plus `update()` per step. The
same workload runs with prefix caching on and off, in alternating rounds (ABBA), and the
script prints the steps each needed and a digest of every plan (block-aligned chunking could
change the batches the executor runs), the scheduler's median time per step and the
difference between the two.

Why this and not only the end-to-end bench: on this 2-core CPU one model step of the
default model takes ~100+ ms and run-to-run noise is several percent, far above a 2% goal.
The scheduler's extra work per step, divided by the model's step time, bounds what caching
can cost end to end; the step counts show whether it changes the work the model does.

    .venv/bin/python benchmarks/scheduler_overhead.py            # defaults: the prefix0 bench shape
    .venv/bin/python benchmarks/scheduler_overhead.py --input-len 2048 --concurrency 64
    .venv/bin/python benchmarks/scheduler_overhead.py --kv-events   # caching on both: KV events off vs on

With --kv-events both settings cache, and "on" attaches a KV event log (scheduler_svc/kv_events.py)
with one subscriber: what a router watching the server costs the scheduler. Without an event loop
every pool call is its own batch (a server batches per loop turn), so this is an upper bound.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import time

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_events import KVEventLog
from scheduler_svc.plan import Sampled, StepPlan, StepResult
from scheduler_svc.policy import create_policy
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.scheduler import Scheduler


def run(args: argparse.Namespace, on: bool) -> tuple[int, int, float, str]:
    """One closed-loop run; returns (steps, tokens scheduled, scheduler seconds, a digest of
    every plan's sequences, chunks and block ids: what the executor would be asked to do).
    `on`: prefix caching on, or with --kv-events (caching on either way) the events on."""
    caching = on or args.kv_events
    config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching)
    pool = BlockPool(args.num_blocks, args.block_size, enable_caching=caching)
    if args.kv_events and on:
        KVEventLog().attach(pool)
        pool.events.subscribe(lambda batch: None)  # type: ignore[union-attr]
    sched = Scheduler(config, pool, create_policy("fcfs"), max_model_len=args.input_len + args.output_len + 1)
    rng = random.Random(args.seed)  # the same distinct prompts for both settings
    prompts = [[rng.randrange(1, 49_000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        sched.add_request(
            Request(
                request_id=f"r{submitted}", seq_id=submitted, prompt_token_ids=prompts[submitted], sampling=sampling
            )
        )
        submitted += 1

    while submitted < min(args.concurrency, args.num_prompts):
        submit()
    steps = tokens = 0
    spent = 0.0
    digest = hashlib.sha256()
    gc.collect()
    while sched.has_work():
        t0 = time.perf_counter()
        plan: StepPlan = sched.schedule()
        t1 = time.perf_counter()
        result = StepResult(plan.step_id, [Sampled(s.seq_id, 7) for s in plan.seqs if s.sample])
        t2 = time.perf_counter()
        outputs = sched.update(plan, result)
        spent += (t1 - t0) + (time.perf_counter() - t2)
        steps += 1
        tokens += plan.num_tokens
        digest.update(
            repr(
                [(s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids, s.sample) for s in plan.seqs]
            ).encode()
        )
        for out in outputs:  # closed loop: a finished request makes room for the next one
            if out.finish_reason is not None and submitted < args.num_prompts:
                submit()
    if pool.num_free_blocks != pool.num_blocks:
        raise SystemExit(f"leak: {pool.num_blocks - pool.num_free_blocks} blocks still held")
    return steps, tokens, spent, digest.hexdigest()[:12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=480)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kv-events", action="store_true", help="compare KV events off and on (caching on in both)")
    p.add_argument(
        "--model-step-ms",
        type=float,
        default=135.0,
        help="a model step's time to relate the overhead to (default: the median ITL of the prefix0 bench on this CPU)",
    )
    args = p.parse_args()
    per_step: dict[bool, list[float]] = {True: [], False: []}
    work_of: dict[bool, set[tuple[int, int, str]]] = {True: set(), False: set()}
    for k in range(args.rounds):
        for caching in (True, False) if k % 2 == 0 else (False, True):  # ABBA: drift falls on both
            steps, tokens, spent, digest = run(args, caching)
            per_step[caching].append(spent / steps * 1e6)
            work_of[caching].add((steps, tokens, digest))
            print(
                f"round {k + 1} {'events' if args.kv_events else 'caching'} {'on ' if caching else 'off'}: "
                f"{steps} steps, {tokens} tokens, "
                f"{spent / steps * 1e6:.1f} us/step"
            )
    on, off = statistics.median(per_step[True]), statistics.median(per_step[False])
    print(f"\n(steps, tokens, plan digest) caching on: {sorted(work_of[True])}, off: {sorted(work_of[False])}")
    print(
        "the executor gets identical plans with caching on and off"
        if work_of[True] == work_of[False]
        else "the plans DIFFER: caching changes the executor's work"
    )
    print(
        f"scheduler time per step, median of {args.rounds}: on {on:.1f} us, off {off:.1f} us, "
        f"extra {on - off:+.1f} us ({on / off:.2f}x)"
    )
    print(
        f"extra as a share of a {args.model_step_ms:.0f} ms model step: "
        f"{(on - off) / (args.model_step_ms * 1e3) * 100:+.3f}%"
    )


if __name__ == "__main__":
    main()
