"""PNG plots from reports (matplotlib, Agg backend, imported only when plots are asked for).

Everything is drawn from a report's per-request lists and step trace, so the same plots
can be redrawn later from a --result-json file. With several configurations (--compare,
the HF baseline) each plot overlays them, one colour per configuration.

    ttft_cdf.png         TTFT CDF per class
    itl_over_time.png    every inter-token gap at the time its token arrived
    tokens_per_step.png  prefill and decode tokens of each step over time, and the budget
                         (only when a step trace was recorded: --admin-address)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

_STYLES = ("-", "--", ":", "-.")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(reports: Sequence[tuple[str, dict]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, rep) in enumerate(reports):
        classes = sorted(set(rep["classes"]), key=lambda c: (c != "short", c != "long", c))
        for cls in classes:
            xs = sorted(t * 1000 for t, c in zip(rep["ttfts"], rep["classes"]) if c == cls and t is not None)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = f"{name} {cls}" if len(reports) > 1 else cls
            ax.step(xs, ys, where="post", linestyle=_STYLES[k % len(_STYLES)], label=f"{label} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token, CDF per class")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _itl_points(rep: dict) -> tuple[list[float], list[float]]:
    """(time of each gap's token from the run's start, gap in ms) over all requests."""
    ts: list[float] = []
    gaps: list[float] = []
    for send, ttft, itls in zip(rep["send_times"], rep["ttfts"], rep["itls"]):
        if send is None or ttft is None or not itls:
            continue
        ts += [send + ttft + t for t in accumulate(itls)]
        gaps += [g * 1000 for g in itls]
    return ts, gaps


def itl_over_time(reports: Sequence[tuple[str, dict]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, rep in reports:
        ts, gaps = _itl_points(rep)
        ax.scatter(ts, gaps, s=3, alpha=0.5, label=f"{name} ({len(gaps)} gaps)")
    ax.set_yscale("log")
    ax.set_xlabel("time since the start of the run (s)")
    ax.set_ylabel("inter-token latency (ms, log scale)")
    ax.set_title("Inter-token latency over time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tokens_per_step(reports: Sequence[tuple[str, dict]], path: Path) -> bool:
    """Returns False (and draws nothing) when no report has a step trace."""
    traced = [(n, r) for n, r in reports if r.get("step_trace")]
    if not traced:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(len(traced), 1, figsize=(9, 3.2 * len(traced)), squeeze=False, sharex=True)
    for ax, (name, rep) in zip(axes[:, 0], traced):
        steps = rep["step_trace"]
        t = [s["t"] for s in steps]
        ax.vlines(t, 0, [s["num_decode_tokens"] for s in steps], color="tab:blue", linewidth=1, label="decode")
        ax.vlines(
            t,
            [s["num_decode_tokens"] for s in steps],
            [s["num_tokens"] for s in steps],
            color="tab:orange",
            linewidth=1,
            label="prefill",
        )
        ax.plot(t, [s["token_budget"] for s in steps], color="gray", linestyle="--", linewidth=1, label="budget")
        ax.set_ylabel("tokens per step")
        ax.set_title(f"Tokens per step — {name}" if len(traced) > 1 or name else "Tokens per step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time since the start of the run (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(reports: Sequence[tuple[str, dict]], plot_dir: Path) -> list[Path]:
    """Draws every plot the reports have data for; returns the files written."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_dir / "ttft_cdf.png", plot_dir / "itl_over_time.png"]
    ttft_cdf(reports, written[0])
    itl_over_time(reports, written[1])
    if tokens_per_step(reports, plot_dir / "tokens_per_step.png"):
        written.append(plot_dir / "tokens_per_step.png")
    return written
