"""The router's metrics: decisions by replica and reason, replica gauges read at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from chunkserve.router.metrics import RouterMetrics
from chunkserve.router.scoring import Decision
from chunkserve_contracts.v1 import replica_pb2 as rpb


def test_decisions_and_replica_gauges():
    replica = SimpleNamespace(
        name="10.0.0.5:50051",
        healthy=True,
        draining=False,
        events_connected=True,
        index={b"a", b"b"},
        in_flight=3,
        load=rpb.ReplicaLoad(num_running=2, num_waiting=1, kv_cache_usage=0.5, pending_prefill_tokens=700),
    )
    metrics = RouterMetrics(lambda: [replica])
    metrics.decided(Decision("10.0.0.5:50051", "cache", 4, 0.1), prompt_tokens=100, block_size=16, seconds=2e-5)
    text = generate_latest(metrics.registry).decode()
    assert 'chunkserve_router_requests_total{reason="cache",replica="10.0.0.5:50051"} 1.0' in text
    assert 'chunkserve_router_predicted_cached_tokens_total{replica="10.0.0.5:50051"} 64.0' in text
    assert 'chunkserve_router_replica_cached_blocks{replica="10.0.0.5:50051"} 2.0' in text
    replica.healthy, replica.in_flight = False, 0  # read at scrape time
    text = generate_latest(metrics.registry).decode()
    assert 'chunkserve_router_replica_healthy{replica="10.0.0.5:50051"} 0.0' in text
    assert 'chunkserve_router_replica_pending_prefill_tokens{replica="10.0.0.5:50051"} 700.0' in text
