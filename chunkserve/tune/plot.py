"""`chunkserve tune --plot`: the trade-off the token budget sets, one point per setting.

x: predicted P99 inter-token latency (all requests); y: predicted P99 TTFT of short requests
(all requests when the log has no `short` class). The SLO's limits on those two figures are
drawn as a shaded box (a limit that is not set leaves that side open), settings that meet the
whole SLO are filled, others hollow, and the recommended one is starred. matplotlib (the
`bench` extra) with the Agg backend, imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def matplotlib_missing() -> str | None:
    """A one-line reason when matplotlib cannot be imported, else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'chunkserve[bench]' (or pip install matplotlib)"
    return None


def _short_class(summary: dict) -> str:
    return "short" if "short" in summary["classes"] else "all"


def _limit(slo: dict[str, float], metric: str, cls: str) -> float | None:
    """The SLO's P99 limit of `metric` for class `cls` (a class-less limit applies to all)."""
    limits = [v for k, v in slo.items() if k in (f"{metric}_p99_ms", f"{cls}.{metric}_p99_ms")]
    return min(limits) if limits else None


def plot_tradeoff(
    rows: Sequence[tuple[object, dict]], slo: dict[str, float], choice: object | None, path: str | Path, meets=None
) -> Path:
    """Writes the PNG; `rows` are (setting, summary) pairs as `chunkserve tune` builds them
    (a setting has label(); a summary has classes[...][itl_p99_ms / ttft_p99_ms])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs, ys = [], []
    for setting, m in rows:
        cls = _short_class(m)
        x, y = m["classes"]["all"]["itl_p99_ms"], m["classes"][cls]["ttft_p99_ms"]
        xs.append(x)
        ys.append(y)
        ok = meets(m, slo) if meets is not None else True
        ax.scatter([x], [y], s=60, color="tab:blue", facecolors="tab:blue" if ok else "none", zorder=3)
        ax.annotate(setting.label(), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7)
    if not xs:
        raise ValueError("no setting to plot")
    cls = _short_class(rows[0][1])
    itl_max, ttft_max = _limit(slo, "itl", "all"), _limit(slo, "ttft", cls)
    if itl_max is not None or ttft_max is not None:
        right = itl_max if itl_max is not None else max(xs) * 10
        top = ttft_max if ttft_max is not None else max(ys) * 10
        ax.add_patch(Rectangle((0, 0), right, top, color="tab:green", alpha=0.12, zorder=1, label="SLO"))
        if itl_max is not None:
            ax.axvline(itl_max, color="tab:green", linestyle="--", linewidth=1)
        if ttft_max is not None:
            ax.axhline(ttft_max, color="tab:green", linestyle="--", linewidth=1)
    if choice is not None:
        for setting, m in rows:
            if setting == choice:
                x, y = m["classes"]["all"]["itl_p99_ms"], m["classes"][_short_class(m)]["ttft_p99_ms"]
                ax.scatter([x], [y], marker="*", s=320, color="tab:red", zorder=4, label="recommended")
    pos_x, pos_y = [v for v in xs if v > 0], [v for v in ys if v > 0]
    if pos_x and max(pos_x) / min(pos_x) > 8:
        ax.set_xscale("log")
    if pos_y and max(pos_y) / min(pos_y) > 8:
        ax.set_yscale("log")
    ax.set_xlim(min(xs) * 0.8 if ax.get_xscale() == "log" else 0, max(xs + [itl_max or 0]) * 1.2)
    ax.set_ylim(min(ys) * 0.8 if ax.get_yscale() == "log" else 0, max(ys + [ttft_max or 0]) * 1.2)
    ax.set_xlabel("predicted P99 ITL, all requests (ms)")
    ax.set_ylabel(f"predicted P99 TTFT, {'short' if cls == 'short' else 'all'} requests (ms)")
    ax.set_title("chunkserve tune: predicted latency per setting (filled: meets the SLO)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
