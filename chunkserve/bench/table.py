"""Plain-text tables for the terminal: one run broken down by class, or runs side by side."""

from __future__ import annotations

from collections.abc import Sequence

from chunkserve.bench.metrics import LATENCIES, pct_name
from chunkserve.bench.report import HEADLINES, headline

_W = 12  # width of a value column


def _num(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _rows(report: dict, percentiles: Sequence[float]) -> list[tuple[str, object, int]]:
    """(label, value, digits) for every line of a run's table."""
    rows: list[tuple[str, object, int]] = [
        ("completed", report["completed"], 0),
        ("failed", report["failed"], 0),
        ("duration (s)", report["duration"], 2),
        ("input tokens", report["total_input_tokens"], 0),
        ("output tokens", report["total_output_tokens"], 0),
        ("request throughput (req/s)", report["request_throughput"], 3),
        ("output throughput (tok/s)", report["output_throughput"], 1),
        ("total token throughput (tok/s)", report["total_token_throughput"], 1),
    ]
    if "request_goodput" in report:
        rows += [
            ("good requests", report["good_requests"], 0),
            ("request goodput (req/s)", report["request_goodput"], 3),
        ]
    rows.append(("prefix cache hit rate", report["prefix_cache_hit_rate"], 3))
    names = LATENCIES + (("queue",) if "mean_queue_ms" in report else ())
    for name in names:
        label = name.upper()
        rows.append((f"{label} mean (ms)", report[f"mean_{name}_ms"], 1))
        rows.append((f"{label} median (ms)", report[f"median_{name}_ms"], 1))
        rows += [
            (f"{label} {pct_name(p).upper()} (ms)", report[f"{pct_name(p)}_{name}_ms"], 1)
            for p in percentiles
            if p != 50
        ]  # P50 is the median, already there
    return rows


def run_table(report: dict, percentiles: Sequence[float], title: str = "chunkserve bench") -> str:
    """One run: a column for all requests and one per class."""
    classes = list(report.get("per_class", {}))
    groups = [("all", report)] + ([(c, report["per_class"][c]) for c in classes] if len(classes) > 1 else [])
    columns = [_rows(g, percentiles) for _, g in groups]
    width = 32 + _W * len(groups)
    lines = [f" {title} ".center(width, "="), f"{'':32}" + "".join(f"{name:>{_W}}" for name, _ in groups)]
    for i, (label, _, digits) in enumerate(columns[0]):
        lines.append(f"{label:32}" + "".join(f"{_num(col[i][1], digits):>{_W}}" for col in columns))
    if "num_preemptions" in report:  # server-wide, so a line of its own rather than a row per class
        lines.append(f"step trace: {report['num_steps']} steps, {report['num_preemptions']} preemptions")
    codes = report.get("failed_by_code") or {}
    if codes:
        lines.append("failed by code: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    if report.get("trace_error"):
        lines.append(f"step trace: {report['trace_error']}")
    lines.append("=" * width)
    return "\n".join(lines)


def comparison_table(reports: Sequence[tuple[str, dict]], baseline: int = 0, title: str = "comparison") -> str:
    """Headline figures of several configurations, and each one's ratio to the baseline."""
    base_name, base = reports[baseline]
    others = [(n, r) for i, (n, r) in enumerate(reports) if i != baseline]
    heads = [n for n, _ in reports] + [f"{n}/{base_name}" for n, _ in others]
    w = max(_W, max(len(h) for h in heads) + 2)
    width = 28 + w * len(heads)
    lines = [f" {title} ".center(width, "="), f"{'':28}" + "".join(f"{h:>{w}}" for h in heads)]
    for label, cls, key in HEADLINES:
        if cls and cls not in base.get("per_class", {}):
            continue
        values = [headline(r, cls, key) for _, r in reports]
        if values[baseline] is None:
            continue
        cells = [_num(v, 3 if "throughput" in key or "goodput" in key else 1) for v in values]
        b = values[baseline]
        cells += [f"{v / b:.2f}x" if v is not None and b else "-" for i, v in enumerate(values) if i != baseline]
        lines.append(f"{label:28}" + "".join(f"{c:>{w}}" for c in cells))
    lines.append("=" * width)
    return "\n".join(lines)
