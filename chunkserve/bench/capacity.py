"""Capacity: the highest request rate a server sustains within latency SLOs (Sarathi-Serve).

A rate is *feasible* when, running the workload at that Poisson (or --burstiness) rate,
the P99 time-between-tokens (every inter-token gap of every request, i.e. P99 ITL) is at
most `slo_p99_tbt_ms` and the median scheduling delay *of every request class* is at most
`max_median_queue_ms`.

Why per class: Sarathi-Serve bounds the median scheduling delay of all requests, which
detects overload under FCFS, where a backlog delays everyone. Our scheduler lets short
prompts start beside (or ahead of) a long one that waits for the long-prefill slot, so an
overloaded server can keep the overall median low — 70% of the mix is short — while its
long requests queue without bound. The worst class's median catches that; for a workload
with one class it is Sarathi's figure.

The search doubles (or halves) the start rate until it brackets the boundary, then
bisects, and stops after `max_probes` runs or when the bracket is within `tolerance`.

Scheduling delay = time from sending a request until a step first computes it. With a
step trace (--admin-address, or --step-trace) it is measured: the first step whose entries carry the
request's id. Without one it is *estimated* as TTFT minus the request's own prefill time,
where the prefill time of a prompt length is calibrated first by sending a few workload
prompts alone (max_tokens 1) and interpolating linearly between their TTFTs. Under load
a chunked prefill shares its steps with decodes and takes longer than alone, so the
estimate includes that stretch and errs high: capacity found this way is conservative.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from chunkserve.bench.metrics import itls, percentile, ttft
from chunkserve.bench.report import pooled_report
from chunkserve.bench.runner import RequestRecord
from chunkserve.bench.session import Run, RunOptions, run_once
from chunkserve.bench.workloads import BenchRequest

log = logging.getLogger(__name__)


@dataclass
class Probe:
    """One probed rate and its verdict."""

    rate: float
    p99_tbt_ms: float
    median_queue_ms: float  # the worst class's median scheduling delay
    queue_measured: bool  # True: from the step trace; False: TTFT - calibrated prefill
    feasible: bool
    report: dict


class PrefillModel:
    """Prefill time of a lone prompt as a function of its length (piecewise linear)."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        if not points:
            raise ValueError("prefill calibration produced no points")
        best: dict[int, float] = {}
        for n, t in points:
            best[n] = min(t, best.get(n, t))
        self.lengths = sorted(best)
        self.times = [best[n] for n in self.lengths]

    def __call__(self, n: int) -> float:
        xs, ys = self.lengths, self.times
        if len(xs) == 1:
            return ys[0] * n / xs[0]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def calibrate_prefill(
    address: str, requests: Sequence[BenchRequest], opts: RunOptions, num_points: int = 4, repeats: int = 2
) -> PrefillModel:
    """Sends prompts of a spread of the workload's lengths one at a time, max_tokens 1."""
    by_len = sorted(requests, key=lambda r: len(r.prompt_ids))
    picks = {by_len[round(k * (len(by_len) - 1) / max(1, num_points - 1))] for k in range(num_points)}
    probes = [
        replace(r, index=-1000 - k, prompt_ids=r.prompt_ids[::-1], output_len=1)
        for k, r in enumerate(sorted(picks, key=lambda r: len(r.prompt_ids)))
        for _ in range(repeats)
    ]
    lone = replace(opts, max_concurrency=1, num_warmups=1, progress=False)
    run = run_once(address, probes, [0.0] * len(probes), lone, desc="calibrating prefill")
    return PrefillModel([(r.input_len, ttft(r)) for r in run.result.records if r.ok])


def queue_delays(run: Run, prefill: PrefillModel | None) -> tuple[list[float | None], bool]:
    """Per-request scheduling delay (seconds): measured from the trace, else estimated."""
    records: list[RequestRecord] = run.result.records
    if run.first_scheduled:
        return [
            max(0.0, run.first_scheduled[r.request_id] - r.send)
            if r.ok and r.request_id in run.first_scheduled
            else None
            for r in records
        ], True
    if prefill is None:
        return [None] * len(records), False
    return [max(0.0, ttft(r) - prefill(r.input_len)) if r.ok else None for r in records], False


def worst_class_median_ms(records: Sequence[RequestRecord], delays: Sequence[float | None]) -> float:
    """The largest per-class median of the known delays (seconds in, ms out); inf when a
    class has no known delay (its requests all failed or never showed up in the trace)."""
    by_class: dict[str, list[float]] = {}
    for r, d in zip(records, delays):
        by_class.setdefault(r.cls, [])
        if d is not None:
            by_class[r.cls].append(d * 1000)
    if not by_class:
        return float("inf")
    return max(percentile(v, 50) if v else float("inf") for v in by_class.values())


def search_capacity(
    probe: Callable[[float], Probe], start_rate: float, max_probes: int = 8, tolerance: float = 0.1
) -> tuple[float | None, list[Probe]]:
    """Highest feasible rate found (None if even the lowest probed rate fails) and the probes."""
    if max_probes < 1 or start_rate <= 0:
        raise ValueError("capacity search needs --capacity-probes >= 1 and a finite --request-rate > 0")
    probes: list[Probe] = []

    def run(rate: float) -> bool:
        p = probe(rate)
        probes.append(p)
        log.warning(
            "capacity probe %d/%d: %.3f req/s -> P99 TBT %.1f ms, worst class median queue %.1f ms: %s",
            len(probes),
            max_probes,
            rate,
            p.p99_tbt_ms,
            p.median_queue_ms,
            "ok" if p.feasible else "over the SLO",
        )
        return p.feasible

    lo: float | None = None
    hi: float | None = None
    rate = start_rate
    while len(probes) < max_probes and (lo is None or hi is None):  # bracket the boundary
        if run(rate):
            lo = rate
            rate = rate * 2
        else:
            hi = rate
            rate = rate / 2
    while len(probes) < max_probes and lo is not None and hi is not None and hi > lo * (1 + tolerance):
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def make_probe(
    address: str,
    admin_address: str | None,
    requests: Sequence[BenchRequest],
    arrivals_for: Callable[[float], list[float]],
    opts: RunOptions,
    percentiles: Sequence[float],
    slos: dict[str, float] | None,
    slo_p99_tbt_ms: float,
    max_median_queue_ms: float,
    prefill: PrefillModel | None,
) -> Callable[[float], Probe]:
    """A probe function for search_capacity: one run of the workload at the given rate.

    A probe with failed requests is infeasible whatever its latencies.
    """

    def probe(rate: float) -> Probe:
        run = run_once(
            address, requests, arrivals_for(rate), replace(opts, num_warmups=0), admin_address, desc=f"{rate:.3g} req/s"
        )
        delays, measured = queue_delays(run, prefill)
        report = pooled_report([run], percentiles, slos, delays, lists=False)
        p99_tbt = percentile([g * 1000 for r in run.result.records if r.ok for g in itls(r)], 99)
        median_queue = worst_class_median_ms(run.result.records, delays)
        ok = report["failed"] == 0 and p99_tbt <= slo_p99_tbt_ms and median_queue <= max_median_queue_ms
        return Probe(rate, p99_tbt, median_queue, measured, ok, report)

    return probe
