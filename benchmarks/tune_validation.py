"""Predicted (chunkserve tune's replay) vs measured (chunkserve bench) latencies, per budget.

    .venv/bin/python benchmarks/tune_validation.py --fit-trace steps-512.jsonl \
        --run 256=r-256.json --run 512=r-512.json --run 2048=r-2048.json

Fits the cost model on one step trace, replays each run's own request log (arrivals, prompt
and output lengths from its --result-json) under that run's budget, and prints predicted,
measured and relative error for TTFT and ITL percentiles (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json

from chunkserve.tune.cli import average, summarize
from chunkserve.tune.cost import fit_with_error, load_trace
from chunkserve.tune.replay import replay, requests_from_bench
from scheduler_svc.config import SchedulerConfig

# (label, class in the replay summary, predicted key, class in the bench report or None, measured key)
ROWS = (
    ("short TTFT P50", "short", "ttft_p50_ms", "short", "median_ttft_ms"),
    ("short TTFT P99", "short", "ttft_p99_ms", "short", "p99_ttft_ms"),
    ("long TTFT P50", "long", "ttft_p50_ms", "long", "median_ttft_ms"),
    ("long TTFT P99", "long", "ttft_p99_ms", "long", "p99_ttft_ms"),
    ("ITL P50", "all", "itl_p50_ms", None, "median_itl_ms"),
    ("ITL P99", "all", "itl_p99_ms", None, "p99_itl_ms"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-trace", required=True)
    ap.add_argument("--target", default="step", choices=("step", "executor"))
    ap.add_argument("--noise", action="store_true", help="resample the fit's measured/predicted ratios per step")
    ap.add_argument("--run", action="append", required=True, help="BUDGET=result.json")
    args = ap.parse_args()
    steps = load_trace(args.fit_trace, args.target)
    model, med, p90, n = fit_with_error(steps)
    print(f"cost model from {args.fit_trace} ({len(steps)} steps): {model.describe()}")
    print(f"held-out fit error ({n} steps): median {med:.1%}, P90 {p90:.1%}\n")
    print("| budget | figure | predicted | measured | error |")
    print("| --- | --- | --- | --- | --- |")
    for item in args.run:
        budget, _, path = item.partition("=")
        specs, info = requests_from_bench(path)
        report = json.load(open(path))
        config = SchedulerConfig(max_num_batched_tokens=int(budget), max_num_seqs=int(info.get("max_num_seqs", 128)))
        runs = []
        for seed in range(5 if args.noise else 1):  # as `chunkserve tune`: 5 noise seeds, figures averaged
            result = replay(
                specs,
                config,
                model.noisy(seed) if args.noise else model.predict,
                int(info["num_device_blocks"]),
                int(info.get("block_size", 16)),
                info.get("max_model_len"),
            )
            runs.append(summarize(result))
        pred = average(runs)
        for label, pcls, pkey, mcls, mkey in ROWS:
            p = pred["classes"].get(pcls, {}).get(pkey)
            m = (report["per_class"].get(mcls, {}) if mcls else report).get(mkey)
            if p is None or m is None:
                continue
            err = (p - m) / m if m else float("nan")
            print(f"| {budget} | {label} | {p / 1e3:.2f} s | {m / 1e3:.2f} s | {err:+.0%} |")
        tp = report.get("output_throughput", 0.0)
        print(
            f"| {budget} | output tok/s | {pred['output_throughput']:.2f} | {tp:.2f} | "
            f"{(pred['output_throughput'] - tp) / tp:+.0%} |"
        )


if __name__ == "__main__":
    main()
