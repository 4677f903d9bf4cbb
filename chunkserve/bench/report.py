"""The JSON report of a run, a comparison of runs, and the headline ratios between them.

A single run's report is flat, with `vllm bench serve`'s keys at the top level (see
metrics.py) plus `per_class` (the same figures per class label), the per-request lists,
the server's description and the step trace. Several runs of one configuration (rounds)
are pooled: their records are concatenated and their durations added, so throughputs
are totals over totals and percentiles come from all requests, which is steadier than
averaging each round's P99.
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkserve.bench.metrics import classes_of, compute_metrics, per_request_lists
from chunkserve.bench.session import Run

# (label, class or None for all requests, key): the figures --compare and the HF baseline
# quote as ratios. "short" falls back to all requests when the workload has no such class.
HEADLINES = (
    ("short-class P99 TTFT", "short", "p99_ttft_ms"),
    ("median TTFT", None, "median_ttft_ms"),
    ("P99 TTFT", None, "p99_ttft_ms"),
    ("P99 ITL", None, "p99_itl_ms"),
    ("median ITL", None, "median_itl_ms"),
    ("P99 TPOT", None, "p99_tpot_ms"),
    ("median E2EL", None, "median_e2el_ms"),
    ("P99 E2EL", None, "p99_e2el_ms"),
    ("output throughput", None, "output_throughput"),
    ("request throughput", None, "request_throughput"),
    ("request goodput", None, "request_goodput"),
)


def measured_queue_delays(runs: Sequence[Run]) -> list[float | None] | None:
    """Queue delay per request from the step trace (first step that computed it - send).

    None when no run has a trace. Server and bench clocks are both wall clocks on the same
    host here; across hosts the figure is only as good as their synchronisation.
    """
    if not any(run.first_scheduled for run in runs):
        return None
    out: list[float | None] = []
    for run in runs:
        for r in run.result.records:
            t = run.first_scheduled.get(r.request_id)
            out.append(max(0.0, t - r.send) if t is not None and r.send is not None else None)
    return out


def pooled_report(
    runs: Sequence[Run],
    percentiles: Sequence[float],
    slos: dict[str, float] | None,
    queue_delays: Sequence[float | None] | None = None,
    lists: bool = True,
) -> dict:
    """The report of one configuration over one or more runs (see the module docstring)."""
    records = [r for run in runs for r in run.result.records]
    duration = sum(run.result.duration for run in runs)
    if queue_delays is None:
        queue_delays = measured_queue_delays(runs)
    out = compute_metrics(records, duration, percentiles, slos, queue_delays)
    out["per_class"] = {}
    for cls in classes_of(records):
        idx = [i for i, r in enumerate(records) if r.cls == cls]
        out["per_class"][cls] = compute_metrics(
            [records[i] for i in idx],
            duration,
            percentiles,
            slos,
            [queue_delays[i] for i in idx] if queue_delays else None,
        )
    if runs and runs[0].server_info:
        out["server_info"] = runs[0].server_info
    if any(run.steps for run in runs):
        # From the step trace (so only with one): how many steps the server ran (a multi-step
        # plan's trace counts its num_steps) and how many requests it preempted while this
        # workload ran. A subscriber that falls far behind loses steps (trace.py), so on an
        # overloaded client these are lower bounds.
        out["num_steps"] = sum(s["num_steps"] for run in runs for s in run.steps)
        out["num_preemptions"] = sum(s["num_preempted"] for run in runs for s in run.steps)
    if len(runs) > 1:
        out["rounds"] = [compute_metrics(run.result.records, run.result.duration, percentiles, slos) for run in runs]
    if lists:
        out.update(per_request_lists(records))
        out["step_trace"] = [s for run in runs for s in run.steps]
        out["trace_error"] = next((run.trace_error for run in runs if run.trace_error), "")
    return out


def headline(report: dict, cls: str | None, key: str) -> float | None:
    """One headline figure of a report (None when absent, e.g. goodput without SLOs)."""
    group = report.get("per_class", {}).get(cls, report) if cls else report
    value = group.get(key)
    return float(value) if value is not None else None


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """b / a for each headline figure, keyed `<class>.<key>` or `<key>`."""
    out: dict[str, float | None] = {}
    for _, cls, key in HEADLINES:
        name = f"{cls}.{key}" if cls and cls in a.get("per_class", {}) else key
        va, vb = headline(a, cls, key), headline(b, cls, key)
        if va is None or vb is None:
            continue
        out[name] = vb / va if va else None
    return out
