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
    ap.add_argument("--plot", help="PNG of predicted against measured, one point per budget and figure")
    args = ap.parse_args()
    points: list[tuple[str, str, float, float]] = []  # (budget, figure, predicted s, measured s)
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
            points.append((budget, label, p / 1e3, m / 1e3))
        tp = report.get("output_throughput", 0.0)
        print(
            f"| {budget} | output tok/s | {pred['output_throughput']:.2f} | {tp:.2f} | "
            f"{(pred['output_throughput'] - tp) / tp:+.0%} |"
        )
    if args.plot:
        plot(points, args.plot)


def plot(points: list[tuple[str, str, float, float]], path: str) -> None:
    """Predicted against measured on log axes, the y = x line and the +-15% band of the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    lo = min(min(p, m) for _, _, p, m in points) * 0.7
    hi = max(max(p, m) for _, _, p, m in points) * 1.4
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between(
        [lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="#cfc", alpha=0.6, label="within 15%"
    )
    markers = dict(zip(sorted({f for _, f, _, _ in points}), "os^vD<>p"))
    budgets = sorted({b for b, _, _, _ in points}, key=int)
    colors = dict(zip(budgets, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]))
    for b, f, p, m in points:
        ax.scatter(m, p, marker=markers[f], color=colors[b], s=45)
    for f, mk in markers.items():
        ax.scatter([], [], marker=mk, color="gray", label=f)
    for b, c in colors.items():
        ax.scatter([], [], marker="s", color=c, label=f"budget {b}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured (s)", ylabel="predicted (s)")
    ax.set_title("chunkserve tune: predicted vs measured")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
