"""The router's Prometheus metrics (`--metrics-port`): its decisions and each replica's state.

Names under `chunkserve_router_`; every per-replica series has a `replica` label (its gRPC
address). Gauges of replica state are read at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from chunkserve.router.scoring import Decision

PREFIX = "chunkserve_router_"


class _ReplicaCollector(Collector):
    """Per-replica gauges, from the live replica objects at scrape time."""

    def __init__(self, replicas: Callable[[], Iterable[object]]) -> None:
        self._replicas = replicas

    def collect(self):
        specs = [
            ("replica_healthy", "1 when the replica passes health checks", lambda r: float(r.healthy)),
            ("replica_draining", "1 when an operator drained the replica", lambda r: float(r.draining)),
            ("replica_events_connected", "1 while its KV event stream is up", lambda r: float(r.events_connected)),
            ("replica_cached_blocks", "KV blocks in the router's index for the replica", lambda r: len(r.index)),
            ("replica_in_flight", "requests the router has in flight on the replica", lambda r: r.in_flight),
            ("replica_num_requests_running", "requests running there (its last report)", lambda r: r.load.num_running),
            ("replica_num_requests_waiting", "requests waiting there (its last report)", lambda r: r.load.num_waiting),
            ("replica_kv_cache_usage_perc", "its KV cache usage, 0..1 (last report)", lambda r: r.load.kv_cache_usage),
            (
                "replica_pending_prefill_tokens",
                "prompt tokens it still has to prefill (last report)",
                lambda r: r.load.pending_prefill_tokens,
            ),
        ]
        replicas = list(self._replicas())
        for name, doc, value in specs:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["replica"])
            for r in replicas:
                family.add_metric([r.name], value(r))
            yield family


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[object]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(replicas))
        self.requests = Counter(
            PREFIX + "requests",
            "Requests routed, by replica and reason (cache, ttft, imbalance, least_loaded, round_robin, only)",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of routed requests", ["replica"], registry=self.registry
        )
        self.cached_tokens = Counter(
            PREFIX + "predicted_cached_tokens",
            "Prompt tokens the chosen replica was predicted to hold in its prefix cache",
            ["replica"],
            registry=self.registry,
        )
        self.retries = Counter(
            PREFIX + "retries",
            "Requests moved to another replica before any token was streamed, by the replica that failed and why",
            ["replica", "code"],
            registry=self.registry,
        )
        self.failed = Counter(
            PREFIX + "failed_streams",
            "Streams that ended with an error after tokens were streamed (not retried), by replica and code",
            ["replica", "code"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            PREFIX + "decision_seconds",
            "Time to choose a replica (hashing and scoring; tokenization not included)",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=self.registry,
        )

    def decided(self, d: Decision, prompt_tokens: int, block_size: int, seconds: float) -> None:
        self.requests.labels(d.replica, d.reason).inc()
        self.prompt_tokens.labels(d.replica).inc(prompt_tokens)
        self.cached_tokens.labels(d.replica).inc(min(d.matched_blocks * block_size, prompt_tokens))
        self.decision_seconds.observe(seconds)

    def serve(self, host: str, port: int) -> None:
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ValueError(f"cannot serve /metrics on {host}:{port}: {exc.strerror}") from None
