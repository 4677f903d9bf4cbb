"""Serving metrics from request records, with `vllm bench serve`'s names and definitions.

Per completed request (milliseconds in the summary keys, seconds in the per-request lists):

    TTFT  first token - send
    TPOT  (end - first token) / (output tokens - 1): time per output token after the first
          (requests with one output token have none)
    ITL   every gap between consecutive token-carrying messages of a request
    E2EL  end - send

Summary keys are `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<P>_<m>_ms` for every
requested percentile P (`p99_itl_ms`, `p99.9_ttft_ms`), percentiles interpolated linearly
as numpy does. Throughputs divide by the run's duration (first arrival to last finish).
A request counts for goodput only if it completed and meets every SLO given (ttft, tpot,
e2el in ms; a one-token request's TPOT is 0, as in vLLM). The prefix-cache hit rate is
cached prompt tokens / prompt tokens, both from the server's final `usage`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

from chunkserve.bench.runner import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation, numpy's default; 0 if empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def pct_name(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def ttft(r: RequestRecord) -> float:
    return r.first_token - r.send  # type: ignore[operator]


def e2el(r: RequestRecord) -> float:
    return r.end - r.send  # type: ignore[operator]


def tpot(r: RequestRecord) -> float | None:
    n = r.output_tokens
    return (r.end - r.first_token) / (n - 1) if n > 1 else None  # type: ignore[operator]


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:100'] -> {'ttft': 500.0, 'tpot': 100.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r} in {item!r} (use {', '.join(SLO_METRICS)})")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not NAME:MILLISECONDS") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput: {item!r} must be > 0 ms")
    return slos


def is_good(r: RequestRecord, slos: dict[str, float]) -> bool:
    if not r.ok:
        return False
    got = {"ttft": ttft(r), "tpot": tpot(r) or 0.0, "e2el": e2el(r)}
    return all(got[name] * 1000.0 <= limit for name, limit in slos.items())


def _summary(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in percentiles:
        out[f"{pct_name(p)}_{name}_ms"] = percentile(ms, p)
    return out


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (50, 95, 99),
    slos: dict[str, float] | None = None,
    queue_delays: Sequence[float | None] | None = None,
) -> dict:
    """The summary figures of one group of records (a whole run, or one class of it).

    `queue_delays` (seconds, aligned with `records`, None where unknown) adds
    `*_queue_ms` figures; see capacity.py for how they are measured.
    """
    done = [r for r in records if r.ok]
    failed = Counter(r.error_code for r in records if not r.ok)
    input_tokens = sum(r.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict = {
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_code": dict(sorted(failed.items())),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "finish_reasons": dict(sorted(Counter(r.finish_reason for r in done).items())),
    }
    if slos:
        good = sum(is_good(r, slos) for r in records)
        out.update(good_requests=good, request_goodput=per_s(good))
    series = {
        "ttft": [ttft(r) for r in done],
        "tpot": [t for r in done if (t := tpot(r)) is not None],
        "itl": [g for r in done for g in itls(r)],
        "e2el": [e2el(r) for r in done],
    }
    for name in LATENCIES:
        out.update(_summary(name, series[name], percentiles))
    if queue_delays is not None:
        out.update(_summary("queue", [q for r, q in zip(records, queue_delays) if r.ok and q is not None], percentiles))
    return out


def per_request_lists(records: Sequence[RequestRecord]) -> dict[str, list]:
    """vLLM-style per-request lists, in request order, seconds; null for a failed request."""

    def ok(r: RequestRecord, f):
        return f(r) if r.ok else None

    return {
        "ttfts": [ok(r, ttft) for r in records],
        "tpots": [ok(r, tpot) for r in records],
        "itls": [itls(r) if r.ok else [] for r in records],
        "e2els": [ok(r, e2el) for r in records],
        "input_lens": [r.input_len for r in records],
        "output_lens": [r.output_tokens for r in records],
        "classes": [r.cls for r in records],
        "arrivals": [r.arrival for r in records],
        "send_times": [r.send for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "prefix_groups": [r.prefix_group for r in records],  # shared-prefix structure (`chunkserve tune`)
        "prefix_lens": [r.prefix_len for r in records],
        "finish_reason_list": [r.finish_reason for r in records],
        "errors": [f"{r.error_code}: {r.error}" if r.error_code else "" for r in records],
    }


def classes_of(records: Sequence[RequestRecord]) -> list[str]:
    """Class labels in a stable order: short, long, then the rest sorted."""
    present = {r.cls for r in records}
    head = [c for c in ("short", "long", "fixed") if c in present]
    return head + sorted(present - set(head), key=lambda c: (len(c), c))
