"""The router's decision: cache hits win until the queue they sit behind costs more than the
prefill they save; imbalance falls back to least-loaded; the baselines do what they say."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkserve.router.replicas import parse_replica
from chunkserve.router.scoring import ReplicaView, choose, matched_prefix, predicted_ttft

BS = 16
COST = (0.01, 1e-3, 2e-3, 0.0, 0.0)  # 10 ms a step, 1 ms a prefill token


def view(name: str, **kw) -> ReplicaView:
    return ReplicaView(name, step_cost=COST, token_budget=256, **kw)


def test_the_replica_holding_the_prefix_wins_when_loads_are_equal():
    a, b = view("a"), view("b", matched_blocks=60)
    d = choose([a, b], prompt_tokens=1000, block_size=BS)
    assert (d.replica, d.reason, d.matched_blocks) == ("b", "cache", 60)
    assert d.predicted_ttft_s == pytest.approx(predicted_ttft(b, 1000, BS))


def test_a_long_queue_outweighs_a_cache_hit():
    # b holds 60 blocks (960 tokens) but has 20000 prompt tokens queued: a computes 1000 now.
    a, b = view("a"), view("b", matched_blocks=60, pending_prefill_tokens=20_000)
    assert choose([a, b], 1000, BS).replica == "a"
    # ... and a short queue does not.
    b.pending_prefill_tokens = 100
    assert choose([a, b], 1000, BS).replica == "b"


def test_router_side_pending_counts_when_the_report_lags():
    a, b = view("a", router_pending_tokens=5000), view("b")
    assert choose([a, b], 500, BS).replica == "b"


def test_imbalance_falls_back_to_least_loaded():
    busy = view("busy", matched_blocks=60, num_running=40, num_waiting=10)
    idle = view("idle", num_running=2)
    d = choose([busy, idle], 1000, BS, balance_abs=32, balance_rel=1.5)
    assert (d.replica, d.reason) == ("idle", "imbalance")
    # Within the thresholds the cache decides.
    busy.num_running, busy.num_waiting = 20, 0
    assert choose([busy, idle], 1000, BS, balance_abs=32, balance_rel=1.5).reason in ("cache", "ttft")


def test_baselines_and_bad_input():
    views = [view("a", num_running=3), view("b", num_running=1, matched_blocks=9), view("c", num_running=2)]
    assert [choose(views, 100, BS, "round_robin", turn=t).replica for t in range(4)] == ["a", "b", "c", "a"]
    assert choose(views, 100, BS, "least_loaded").replica == "b"
    assert choose(views[:1], 100, BS).reason == "only"
    with pytest.raises(ValueError, match="no replica"):
        choose([], 100, BS)
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose(views, 100, BS, "random")


@given(st.integers(0, 80), st.integers(0, 80), st.integers(1, 2000), st.integers(0, 50_000))
def test_ttft_grows_with_work_and_shrinks_with_cache(m1, m2, prompt, pending):
    lo, hi = sorted((m1, m2))
    more_cached = predicted_ttft(view("x", matched_blocks=hi, pending_prefill_tokens=pending), prompt, BS)
    less_cached = predicted_ttft(view("x", matched_blocks=lo, pending_prefill_tokens=pending), prompt, BS)
    assert more_cached <= less_cached
    busier = predicted_ttft(view("x", matched_blocks=lo, pending_prefill_tokens=pending + 100), prompt, BS)
    assert busier >= less_cached


def test_matched_prefix_stops_at_the_first_miss():
    hashes = [b"a", b"b", b"c", b"d"]
    assert matched_prefix(hashes, {b"a", b"c", b"d"}) == 1
    assert matched_prefix(hashes, {b"a"}, {b"b": 1, b"c": 2}) == 3
    assert matched_prefix([], {b"a"}) == 0


def test_replica_addresses():
    r = parse_replica("10.0.0.5:50061,http=8001")
    assert (r.grpc, r.admin, r.http) == ("10.0.0.5:50061", "10.0.0.5:50062", "http://10.0.0.5:8001")
    assert parse_replica("h:1,admin=9").admin == "h:9" and parse_replica("h:1").http is None
    for bad in ("nohost", "h:x", "h:1,grpc=2", "h:1,admin="):
        with pytest.raises(ValueError, match="--replica"):
            parse_replica(bad)


def test_dns_discovery_adds_every_address_and_ipv6_is_bracketed():
    import asyncio

    from chunkserve.router.replicas import Intervals, ReplicaAddress, ReplicaSet

    assert ReplicaAddress("::1", 50051, 50052, 8000).grpc == "[::1]:50051"
    assert ReplicaAddress("::1", 50051, 50052, 8000).http == "http://[::1]:8000"

    async def main() -> set[str]:
        replicas = ReplicaSet([], ("localhost", 1, 2, 0), Intervals(health_s=60, load_s=60, dns_s=60))
        replicas.start()
        try:
            for _ in range(500):  # the first resolution runs as a task: wait for it (bounded)
                if replicas.replicas:
                    break
                await asyncio.sleep(0.01)
            return set(replicas.replicas)
        finally:
            await replicas.close()

    found = asyncio.run(main())
    assert "127.0.0.1:1" in found and found <= {"127.0.0.1:1", "[::1]:1"}
