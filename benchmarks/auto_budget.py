"""The auto token budget against fixed budgets, on the mixed workload at two request rates.

    .venv/bin/python benchmarks/auto_budget.py --out /tmp/auto --target-itl-ms 250,1000 \
        --budgets 256,2048 --rates 0.25,inf --plot benchmarks/auto_budget.png

For each rate, every setting (each fixed budget, then for each target X
`--max-num-batched-tokens <largest fixed> --target-itl-ms X`) runs `chunkserve bench` on a server of its own, in an order that
alternates between rounds (ABC, CBA, ...) so a machine getting busier or quieter does not
favour one setting. Printed per rate: P99 and median ITL, short requests' P99 TTFT, long
requests' median TTFT, output tokens/s, and the auto budget's ratios against the best fixed
budget on each latency figure and against the largest fixed budget's throughput (the issue's
goal: latency at least as good as the best fixed budget, throughput within 5% of the
largest). From the auto run's step trace: the share of steps carrying decodes that took
longer than the target, and the budgets it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = [
    "--workload", "mixed", "--num-prompts", "24", "--long-len", "1024:2048", "--short-len", "16:128",
    "--output-len", "32", "--seed", "1", "--disable-tqdm",
]  # fmt: skip


def run_one(out: Path, name: str, rate: str, server_args: str, round_: int) -> dict:
    tag = f"{name}-r{rate}-{round_}"
    result, trace = out / f"{tag}.json", out / f"{tag}-steps.jsonl"
    trace.unlink(missing_ok=True)
    cmd = [
        str(ROOT / ".venv/bin/chunkserve"), "bench", *WORKLOAD, "--request-rate", rate,
        "--server-args", f"{server_args} --step-trace-file {trace}", "--result-json", str(result),
    ]  # fmt: skip
    print("#", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=open(out / f"{tag}.log", "w"), stderr=subprocess.STDOUT)
    report = json.loads(result.read_text())
    report["_trace"] = str(trace)
    return report


def figures(r: dict) -> dict:
    short, long = r["per_class"].get("short", {}), r["per_class"].get("long", {})
    return {
        "p99_itl_ms": r["p99_itl_ms"],
        "median_itl_ms": r["median_itl_ms"],
        "short_p99_ttft_ms": short.get("p99_ttft_ms", float("nan")),
        "long_median_ttft_ms": long.get("median_ttft_ms", float("nan")),
        "output_tok_s": r["output_throughput"],
        "duration_s": r["duration"],
    }


def trace_summary(path: str, target_ms: float) -> str:
    """Share of decode-carrying steps over the target, and the budgets chosen, from the trace."""
    over = decoding = 0
    reasons: Counter[str] = Counter()
    budgets = []
    for line in open(path):
        t = json.loads(line)
        reasons[t.get("budgetReason", "")] += 1
        if int(t.get("numDecodeTokens", 0)):
            decoding += 1
            budgets.append(int(t.get("tokenBudget", 0)))
            over += int(t.get("stepNs", 0)) / 1e6 > target_ms
    budgets.sort()
    mid = budgets[len(budgets) // 2] if budgets else 0
    return (
        f"{over}/{decoding} steps with decodes over {target_ms:g} ms; budget of those steps: median {mid}, "
        f"min {budgets[0] if budgets else 0}, max {budgets[-1] if budgets else 0}; reasons {dict(reasons)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/auto_budget"))
    ap.add_argument("--target-itl-ms", default="250", help="comma-separated targets, one auto setting each")
    ap.add_argument("--budgets", default="256,512,2048", help="fixed budgets to compare with")
    ap.add_argument("--rates", default="0.25,inf", help="request rates (req/s; inf = all at once)")
    ap.add_argument(
        "--auto-upper", type=int, help="the auto settings' --max-num-batched-tokens (default: largest fixed)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--server-args", default="--dtype float32", help="flags every server gets")
    ap.add_argument("--plot", type=Path, help="bar charts of the figures (needs matplotlib)")
    ap.add_argument("--replot", type=Path, help="only redraw --plot from an earlier run's --out folder")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((args.replot / "summary.json").read_text())  # {"RATE NAME": [figures, ...]}
        rates = list(dict.fromkeys(k.split(" ", 1)[0] for k in saved))
        names = list(dict.fromkeys(k.split(" ", 1)[1] for k in saved))

        def saved_mean(rate: str, name: str, key: str) -> float:
            xs = [f[key] for f in saved[f"{rate} {name}"]]
            return sum(xs) / len(xs)

        plot(args.plot, rates, [(n, "") for n in names], saved_mean)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    fixed = [int(b) for b in args.budgets.split(",")]
    upper = max(fixed)
    auto_upper = args.auto_upper or upper
    settings = [(f"fixed-{b}", f"{args.server_args} --max-num-batched-tokens {b}") for b in fixed]
    targets = {f"auto-{float(t):g}ms": float(t) for t in args.target_itl_ms.split(",")}
    for name, t in targets.items():
        settings.append((name, f"{args.server_args} --max-num-batched-tokens {auto_upper} --target-itl-ms {t:g}"))
    results: dict[tuple[str, str], list[dict]] = {}
    traces: dict[str, list[str]] = {}
    for round_ in range(args.rounds):
        for rate in args.rates.split(","):
            order = settings if round_ % 2 == 0 else settings[::-1]
            for name, server_args in order:
                report = run_one(args.out, name, rate, server_args, round_)
                results.setdefault((rate, name), []).append(figures(report))
                if name in targets:
                    traces.setdefault(rate, []).append((name, report["_trace"]))

    def mean(rate: str, name: str, key: str) -> float:
        xs = [f[key] for f in results[(rate, name)]]
        return sum(xs) / len(xs)

    keys = ("p99_itl_ms", "median_itl_ms", "short_p99_ttft_ms", "long_median_ttft_ms", "output_tok_s")
    print(f"\nauto-X = --max-num-batched-tokens {auto_upper} --target-itl-ms X; {args.rounds} round(s)")
    for rate in args.rates.split(","):
        print(f"\n### request rate {rate} req/s\n")
        print("| setting | P99 ITL ms | median ITL ms | short P99 TTFT ms | long median TTFT ms | output tok/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, _ in settings:
            cells = " | ".join(
                f"{mean(rate, name, k):.1f}" if k == "output_tok_s" else f"{mean(rate, name, k):.0f}" for k in keys
            )
            print(f"| {name} | {cells} |")
        fixed_names = [n for n, _ in settings if n not in targets]
        print()
        for auto in targets:
            for key in ("p99_itl_ms", "short_p99_ttft_ms"):
                best = min(fixed_names, key=lambda n: mean(rate, n, key))
                ratio = mean(rate, auto, key) / mean(rate, best, key)
                print(f"- {auto} {key}: / best fixed ({best}) = {ratio:.2f}")
            largest = f"fixed-{upper}"
            ratio = mean(rate, auto, "output_tok_s") / mean(rate, largest, "output_tok_s")
            print(f"- {auto} output tok/s: / {largest} = {ratio:.3f}")
        for name, path in traces.get(rate, []):
            print(f"- {name}'s trace: {trace_summary(path, targets[name])}")
    json.dump(
        {f"{rate} {name}": v for (rate, name), v in results.items()}, open(args.out / "summary.json", "w"), indent=1
    )
    if args.plot:
        plot(args.plot, args.rates.split(","), settings, mean)


def plot(path: Path, rates: list[str], settings: list[tuple[str, str]], mean) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'chunkserve[bench]'")
    panels = (
        ("p99_itl_ms", "P99 ITL (ms)"),
        ("short_p99_ttft_ms", "short P99 TTFT (ms)"),
        ("output_tok_s", "output tok/s"),
    )
    fig, axes = plt.subplots(len(rates), len(panels), figsize=(12, 3.2 * len(rates)), squeeze=False)
    names = [n for n, _ in settings]
    for i, rate in enumerate(rates):
        for j, (key, label) in enumerate(panels):
            ax = axes[i][j]
            colors = ["#1f77b4" if n.startswith("auto") else "#888" for n in names]
            ax.bar(names, [mean(rate, n, key) for n in names], color=colors)
            ax.set_title(f"{label}, rate {rate}")
            ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
