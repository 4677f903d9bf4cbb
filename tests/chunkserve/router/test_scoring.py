"""The router's decision: cache hits win until the queue they sit behind costs more than the
prefill they save; imbalance falls back to least-loaded; the baselines do what they say."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve.router.replicas import parse_replica
from chunkserve.router.scoring import RECENT_TAU_S, ReplicaView, choose, matched_prefix, pool_step_costs, predicted_ttft
from scheduler_svc.step_cost import attention_pairs

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


def test_a_queue_costs_its_attention_when_the_fit_puts_prefill_there():
    # A fit that put the whole prefill cost on attention pairs (per token 0): a replica with
    # 20000 tokens queued is not free. Before the queue's pairs were counted it looked it, and
    # took every request.
    cost = (0.002, 0.0, 4e-4, 0.0, 3e-8)
    queued = 10 * attention_pairs(2000, 0)  # ten 2000-token prompts from scratch
    busy = ReplicaView("busy", pending_prefill_tokens=20_000, pending_prefill_attention=queued, step_cost=cost)
    idle = ReplicaView("idle", step_cost=cost)
    assert predicted_ttft(busy, 1000, BS) > predicted_ttft(idle, 1000, BS) + 3e-8 * queued * 0.99
    assert choose([busy, idle], 1000, BS).replica == "idle"
    # what the router sent and has no report of yet counts the same way
    lagging = ReplicaView("lagging", router_pending_tokens=20_000, router_pending_attention=queued, step_cost=cost)
    assert predicted_ttft(lagging, 1000, BS) == pytest.approx(predicted_ttft(busy, 1000, BS))


def test_alike_replicas_are_costed_with_one_pooled_fit():
    # Two fits of identical replicas: one put the prefill on tokens, the other on attention
    # pairs and a larger per-step cost. Ranked by their own fits, "cheap" took every new prompt
    # whatever "dear" had queued; pooled, the emptier one wins.
    cheap = ReplicaView("cheap", pending_prefill_tokens=4000, step_cost=(0.002, 0.0, 4e-4, 0.0, 2e-8))
    dear = ReplicaView("dear", step_cost=(0.002, 1.2e-4, 1.5e-3, 0.0, 1e-8))
    cheap.pending_prefill_attention = 2 * attention_pairs(2000, 0)
    cheap.step_cost_fitted = dear.step_cost_fitted = True
    assert choose([cheap, dear], 2000, BS).replica == "cheap"  # each by its own fit
    pool_step_costs([cheap, dear], ["m", "m"])
    assert cheap.step_cost == dear.step_cost == pytest.approx((0.002, 6e-5, 9.5e-4, 0.0, 1.5e-8))
    assert choose([cheap, dear], 2000, BS).replica == "dear"


@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.booleans(), st.lists(st.floats(0, 1), min_size=5, max_size=5)),
        min_size=1,
        max_size=6,
    )
)
def test_pooling_is_a_median_within_a_kind_and_never_crosses_kinds(replicas):
    views = [
        ReplicaView(str(i), step_cost=tuple(cost), step_cost_fitted=fitted)
        for i, (_, fitted, cost) in enumerate(replicas)
    ]
    kinds = [kind for kind, _, _ in replicas]
    pool_step_costs(views, kinds)
    for kind in "ab":
        fits = [tuple(cost) for k, fitted, cost in replicas if k == kind and fitted]
        mine = [(v, replicas[i]) for i, v in enumerate(views) if kinds[i] == kind]
        for v, (_, _, cost) in mine:
            if fits:  # every replica of the kind, fitted or not, gets the kind's median
                assert v.step_cost == tuple(statistics.median(c) for c in zip(*fits))
            else:  # none fitted: each keeps its own
                assert v.step_cost == tuple(cost)


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


def test_a_new_prefix_goes_where_fewest_requests_went_lately():
    """Idle replicas tie exactly on TTFT for a prompt none holds: the one sent the fewest
    requests lately takes it (by list order, the first replicas took most prefix groups)."""
    views = [view("a", recent_requests=9.0), view("b", recent_requests=0.5), view("c", recent_requests=3.0)]
    assert choose(views, 1000, BS).replica == "b"
    # A cached prefix still wins over a quieter replica, and so does a clearly shorter queue.
    views[0].matched_blocks = 60
    assert choose(views, 1000, BS).replica == "a"
    views[0].matched_blocks, views[1].pending_prefill_tokens = 0, 5000
    assert choose(views, 1000, BS).replica == "c"


def test_ttfts_closer_than_one_step_count_as_tied():
    quiet = view("quiet", recent_requests=0.0, num_decoding=1)  # 4 steps of +2 ms: +8 ms, below one step (10 ms)
    crowded = view("crowded", recent_requests=12.0)
    assert predicted_ttft(quiet, 1000, BS) > predicted_ttft(crowded, 1000, BS)
    assert choose([crowded, quiet], 1000, BS).replica == "quiet"
    quiet.num_decoding = 20  # 5 steps of +40 ms: clearly slower
    assert choose([crowded, quiet], 1000, BS).replica == "crowded"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.lists(st.integers(0, 15), min_size=16, max_size=120), st.permutations(range(16)))
def test_prefix_groups_spread_evenly_over_idle_replicas(n, follow_ups, first_order):
    """16 prefix groups, each first seen in a random order with follow-ups interleaved, onto
    idle replicas (every request done before the next, as between bursts): each group stays
    where its prefix went, and the groups split as evenly as they can (at most one apart)."""
    views = [view(f"r{k}") for k in range(n)]
    home: dict[int, str] = {}
    stream = [g for g in first_order] + follow_ups
    t = 0.0
    for g in stream:
        t += 0.05  # 20 requests a second
        for v in views:  # decayed counts, as Replica.recent_requests gives them
            v.recent_requests *= math.exp(-0.05 / RECENT_TAU_S)
            v.matched_blocks = 60 if home.get(g) == v.name else 0
        d = choose(views, 1000, BS)
        assert home.setdefault(g, d.replica) == d.replica  # later requests follow the prefix
        next(v for v in views if v.name == d.replica).recent_requests += 1
    groups = [sum(1 for r in home.values() if r == v.name) for v in views]
    assert max(groups) - min(groups) <= 1, groups


def test_recent_requests_decay():
    import asyncio

    from chunkserve.router.replicas import Replica

    async def main() -> list[float]:
        r = Replica(parse_replica("127.0.0.1:1"))  # its grpc.aio channels need a running loop
        try:
            counts = [r.recent_requests(100.0)]
            r.sent(100.0)
            r.sent(100.0)
            return [*counts, r.recent_requests(100.0), r.recent_requests(100.0 + RECENT_TAU_S)]
        finally:
            await r.channel.close()
            await r.admin_channel.close()

    assert asyncio.run(main()) == pytest.approx([0.0, 2.0, 2.0 / math.e])


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


def test_the_router_pools_fits_per_kind_and_pools_again_only_when_a_report_changes():
    import asyncio

    from chunkserve.router.core import Router
    from chunkserve.router.metrics import RouterMetrics
    from chunkserve.router.replicas import Replica, ReplicaAddress, ReplicaSet
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb
    from chunkserve_contracts.v1 import replica_pb2 as rpb

    def load(cost):
        return rpb.ReplicaLoad(token_budget=256, step_cost=cost, step_cost_fitted=True)

    async def main() -> None:
        replicas = ReplicaSet([])
        rs = [Replica(ReplicaAddress("127.0.0.1", port, 0)) for port in (1, 2, 3)]
        for r, model in zip(rs, ("m", "m", "other")):
            r.healthy = True
            r.info = pb.GetInfoResponse(model_name=model, dtype="float32", attention_backend="torch", block_size=BS)
            replicas.replicas[r.name] = r
        rs[0].load = load([0.002, 0.0, 4e-4, 0.0, 2e-8])
        rs[1].load = load([0.004, 1.2e-4, 1.5e-3, 0.0, 1e-8])
        rs[2].load = load([0.1, 0.1, 0.1, 0.1, 0.1])
        router = Router(replicas, RouterMetrics(lambda: rs), None)
        try:
            costs = router._step_costs(rs)
            assert costs[0] == costs[1] == pytest.approx((0.003, 6e-5, 9.5e-4, 0.0, 1.5e-8))
            assert costs[2] == (0.1,) * 5  # another model: its own fit
            assert router._step_costs(rs) is costs  # nothing changed: not pooled again
            rs[1].load = load([0.002, 0.0, 4e-4, 0.0, 2e-8])  # a new report
            assert router._step_costs(rs)[1] == pytest.approx((0.002, 0.0, 4e-4, 0.0, 2e-8))
            ticket = router.place(list(range(3, 40)), None)  # and a decision runs on them
            assert ticket.replica in rs[:2]  # "other" is costed at 0.1 s per token
            ticket.release()
        finally:
            await replicas.close()
            router.close()

    asyncio.run(main())


def test_a_request_for_prompt_logprobs_is_placed_as_if_nothing_were_cached():
    """Replica 1 holds the prompt's blocks and has work queued; replica 2 is idle. A request
    that can use the cache goes to replica 1; one asking for prompt logprobs prefills its whole
    prompt wherever it goes, so the cache does not count and the idle replica wins (its
    blocks are still recorded there)."""
    import asyncio

    from chunkserve.router.core import Router
    from chunkserve.router.metrics import RouterMetrics
    from chunkserve.router.replicas import Replica, ReplicaAddress, ReplicaSet
    from chunkserve_contracts.block_hash import prompt_block_hashes
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb
    from chunkserve_contracts.v1 import replica_pb2 as rpb

    prompt = list(range(3, 3 + 64 * BS))

    async def main() -> None:
        replicas = ReplicaSet([])
        rs = [Replica(ReplicaAddress("127.0.0.1", port, 0)) for port in (1, 2)]
        for r in rs:
            r.healthy = True
            r.info = pb.GetInfoResponse(model_name="m", dtype="float32", attention_backend="torch", block_size=BS)
            r.load = rpb.ReplicaLoad(token_budget=256, step_cost=[0.002, 1e-4, 0.0, 0.0, 0.0], step_cost_fitted=True)
            replicas.replicas[r.name] = r
        rs[0].routed.update(prompt_block_hashes(prompt, BS, None))
        rs[0].pending_tokens = 8 * BS  # some queued prefill: less than the prompt it holds
        router = Router(replicas, RouterMetrics(lambda: rs), None)
        try:
            cached = router.place(prompt, None)
            assert cached.replica is rs[0] and cached.uncached_tokens < len(prompt)
            cached.release()
            scored = router.place(prompt, None, cacheable=False)
            assert scored.replica is rs[1] and scored.uncached_tokens == len(prompt)
            assert set(prompt_block_hashes(prompt, BS, None)) <= set(rs[1].routed)
            scored.release()
        finally:
            await replicas.close()
            router.close()

    asyncio.run(main())


def test_the_http_front_tells_prompt_scoring_bodies_apart():
    from chunkserve.router.http_front import _scores_prompt

    assert _scores_prompt({"prompt": "x", "prompt_logprobs": 0})
    assert _scores_prompt({"prompt": "x", "echo": True, "logprobs": 0})
    assert not _scores_prompt({"prompt": "x", "echo": True})
    assert not _scores_prompt({"prompt": "x", "logprobs": 2})
    assert not _scores_prompt({"messages": [], "prompt_logprobs": None})
    assert not _scores_prompt(["not", "a", "body"])
