"""The periodic stats line (vLLM's LoggingStatLogger, off with --disable-log-stats).

Every LOG_STATS_INTERVAL_S the scheduler logs one INFO line: prompt and generation
throughput since the last line, running and waiting requests, KV cache usage and the prefix
cache hit rate, all read from the Prometheus registry the metrics endpoint serves, so the
line and the dashboards can never disagree. An idle server logs once, then stays quiet until
something happens again (as vLLM does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

log = logging.getLogger("chunkserve.stats")
LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default
_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")
_GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")


@dataclass
class Sample:
    """The registry's values at one moment (counters are totals since start)."""

    at: float
    values: dict[str, float]


def sample(registry: CollectorRegistry, model_name: str, now: float) -> Sample:
    label = {"model_name": model_name}
    values = {name: registry.get_sample_value(f"chunkserve_{name}_total", label) or 0.0 for name in _COUNTERS}
    values.update({name: registry.get_sample_value(f"chunkserve_{name}", label) or 0.0 for name in _GAUGES})
    return Sample(now, values)


def stats_line(before: Sample, now: Sample) -> str:
    """One line, vLLM's wording: throughputs over the interval, the current load, and the
    prefix-cache hit rate over the interval (0 when nothing was looked up)."""
    elapsed = max(now.at - before.at, 1e-9)
    delta = {name: now.values[name] - before.values[name] for name in _COUNTERS}
    queries = delta["prefix_cache_queries"]
    hit_rate = 100.0 * delta["prefix_cache_hits"] / queries if queries else 0.0
    v = now.values
    return (
        f"Avg prompt throughput: {delta['prompt_tokens'] / elapsed:.1f} tokens/s, "
        f"Avg generation throughput: {delta['generation_tokens'] / elapsed:.1f} tokens/s, "
        f"Running: {v['num_requests_running']:.0f} reqs, Waiting: {v['num_requests_waiting']:.0f} reqs, "
        f"Swapped: {v['num_requests_swapped']:.0f} reqs, KV cache usage: {100 * v['kv_cache_usage_perc']:.1f}%, "
        f"Prefix cache hit rate: {hit_rate:.1f}%"
    )


def _idle(before: Sample, now: Sample) -> bool:
    moved = any(now.values[name] != before.values[name] for name in _COUNTERS)
    return not moved and now.values["num_requests_running"] == 0 and now.values["num_requests_waiting"] == 0


async def log_stats_forever(
    source: Callable[[], tuple[CollectorRegistry, str] | None], interval: float = LOG_STATS_INTERVAL_S
) -> None:
    """Logs a stats line every `interval` s while `source` gives the registry and model name
    (None while not serving); an idle interval after an idle line is not logged."""
    before: Sample | None = None
    quiet = False
    while True:
        await asyncio.sleep(interval)
        state = source()
        if state is None:
            before = None
            continue
        now = sample(*state, time.monotonic())
        if before is not None:
            idle = _idle(before, now)
            if not (idle and quiet):
                log.info("%s", stats_line(before, now))
            quiet = idle
        before = now
