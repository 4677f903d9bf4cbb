"""Prefix caching: block manager rules, and scheduler behaviour with the KV-simulating fake."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc import block_pool
from scheduler_svc.block_pool import BlockPool, hash_block
from scheduler_svc.request import Request, SamplingParams


def req(rid: str, tokens: list[int], computed: int = 0) -> Request:
    r = Request(
        request_id=rid, seq_id=hash(rid) % 10**6, prompt_token_ids=list(tokens), sampling=SamplingParams(max_tokens=4)
    )
    r.num_computed_tokens = computed
    return r


def fill(pool: BlockPool, r: Request, salt=None) -> None:
    """Allocate and 'compute' all of r's tokens, registering full blocks."""
    pool.allocate(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens
    pool.cache_full_blocks(r, salt, r.num_computed_tokens)


def test_share_free_reuse_and_ref_counts():
    pool = BlockPool(16, 4, enable_caching=True)
    a = req("a", list(range(10)))
    fill(pool, a)  # 3 blocks, 2 full and cached
    b = req("b", list(range(8)) + [99, 98, 97])
    assert pool.match_prefix(b, None) == 8
    assert b.block_ids == a.block_ids[:2]
    assert [pool.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    pool.free(a)
    assert [pool.blocks[i].ref_count for i in b.block_ids] == [1, 1]
    pool.free(b)
    pool.check_invariants()
    assert pool.num_free_blocks == 16
    # Freed blocks keep their hashes: a third request still hits.
    c = req("c", list(range(9)))
    assert pool.match_prefix(c, None) == 8


def test_at_least_one_token_is_always_computed():
    pool = BlockPool(16, 4, enable_caching=True)
    fill(pool, req("a", list(range(8))))
    same = req("b", list(range(8)))  # fully cached prompt
    assert pool.match_prefix(same, None) == 4  # the last block is recomputed for its last token


def test_salts_isolate_tenants():
    pool = BlockPool(16, 4, enable_caching=True)
    fill(pool, req("a", list(range(9))), salt="tenant-1")
    assert pool.match_prefix(req("b", list(range(9))), "tenant-2") == 0
    assert pool.match_prefix(req("c", list(range(9))), None) == 0
    assert pool.match_prefix(req("d", list(range(9))), "tenant-1") == 8


def test_hash_hits_are_verified_against_token_ids():
    pool = BlockPool(16, 4, enable_caching=True)
    a = req("a", list(range(9)))
    fill(pool, a)
    first = a.block_ids[0]
    pool.free(a)
    # Corrupt the registered content as a colliding hash would look: same hash, other tokens.
    pool.blocks[first].token_ids = (7, 7, 7, 7)
    assert pool.match_prefix(req("b", list(range(9))), None) == 0


def test_block_hash_is_sha256_over_parent_salt_and_tokens():
    digest = hash_block(None, None, [1, 2, 3, 4])
    assert isinstance(digest, bytes) and len(digest) == 32
    variants = {
        digest,
        hash_block(None, "", [1, 2, 3, 4]),
        hash_block(None, "t", [1, 2, 3, 4]),
        hash_block(digest, None, [1, 2, 3, 4]),
        hash_block(None, None, [1, 2, 3, 5]),
        hash_block(None, "\x00", [1, 2, 3, 4]),
    }
    assert len(variants) == 6  # each input part changes the key
    assert hash_block(None, "t", (1, 2, 3, 4)) == hash_block(None, "t", [1, 2, 3, 4])  # deterministic


def test_a_colliding_hash_never_shares_another_prefix_or_tenant(monkeypatch):
    """Whatever the hash function, a hit needs the same parent chain and salt.

    The hash is replaced by one that sees only a block's own tokens, so every block with
    equal tokens collides: the parent and salt checks alone must turn those into misses.
    (Python's `hash()` with a tokens-only check shared both cases below.)"""
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, salt, tokens: bytes(tuple(tokens)))
    pool = BlockPool(16, 4, enable_caching=True)
    fill(pool, req("a", [0, 1, 2, 3, 10, 11, 12, 13, 99]), salt="tenant-1")
    # Same tokens as a's second block, but at the start of the sequence (no parent).
    assert pool.match_prefix(req("b", [10, 11, 12, 13, 5]), "tenant-1") == 0
    # Same tokens as a's first block, another tenant.
    assert pool.match_prefix(req("c", [0, 1, 2, 3, 5]), "tenant-2") == 0
    # The genuine prefix still hits.
    assert pool.match_prefix(req("d", [0, 1, 2, 3, 10, 11, 12, 13, 7]), "tenant-1") == 8


def test_eviction_is_lru_tail_first_and_only_when_needed():
    pool = BlockPool(6, 4, enable_caching=True)
    a = req("a", list(range(13)))  # 4 blocks, 3 full
    fill(pool, a)
    ids = list(a.block_ids)
    pool.free(a)  # free queue: 2 untouched, then a's blocks tail first
    assert len(pool._cached) == 3  # nothing evicted while free blocks remain
    got = pool.take(3)
    assert len(pool._cached) == 3  # the two never-used blocks and a's partial tail went first
    assert got[2] == ids[3]
    pool.take(1)  # now a cached block must go: the last full one (tail first)
    assert ids[2] not in pool._cached.values() and ids[0] in pool._cached.values()


def test_scheduler_hits_a_shared_prefix_and_outputs_match(fakes):
    def run(caching: bool, shared: int):
        sched = fakes.make_scheduler(
            num_blocks=256, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=caching
        )
        fake = fakes.FakeExecutor(256, 4)
        system = list(range(30, 30 + shared))
        reqs = []
        for i in range(4):
            r = fakes.make_request(i, prompt_len=1)
            r.prompt_token_ids = system + [200 + i] * 3
            reqs.append(r)
            sched.add_request(r)
            fakes.run_to_completion(sched, fake)  # one at a time: each finds the previous' blocks
        return [r.output_token_ids for r in reqs], [r.num_cached_tokens for r in reqs]

    for shared, expect_cached in ((10, 8), (12, 12), (13, 12)):  # inside, at, past a boundary
        on, cached = run(True, shared)
        off, none = run(False, shared)
        assert on == off
        assert cached == [0] + [expect_cached] * 3 and none == [0] * 4


def test_recompute_preemption_recovers_cached_blocks(fakes):
    sched = fakes.make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=32)
    fake = fakes.FakeExecutor(20, 4)
    for i in range(6):
        sched.add_request(fakes.make_request(i, prompt_len=25, max_tokens=30))
    recovered = []

    def check(s, plan):
        for e in plan.seqs:
            r = s._by_seq[e.seq_id]
            if r.num_preemptions and any(n.seq_id == e.seq_id for n in plan.new_seqs):
                recovered.append(e.num_computed_tokens)

    fakes.run_to_completion(sched, fake, check=check)
    assert any(p.preempted for p in fake.plans) and any(c > 0 for c in recovered)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6), mode=st.sampled_from(["recompute", "swap"]), num_blocks=st.integers(10, 30))
def test_random_sharing_keeps_invariants_and_outputs(fakes, seed, mode, num_blocks):
    """Prompts over a 2-token vocabulary share blocks constantly; outputs must equal an
    uncached, unconstrained run and nothing may leak."""
    rng = random.Random(seed)
    prompts = [[rng.randint(1, 2) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    lengths = [rng.randint(1, 8) for _ in prompts]

    def run(caching, blocks):
        sched = fakes.make_scheduler(
            num_blocks=blocks,
            block_size=4,
            max_num_batched_tokens=rng.choice([4, 8, 16]),
            enable_prefix_caching=caching,
            preemption_mode=mode,
            num_host_blocks=16,
        )
        fake = fakes.FakeExecutor(blocks, 4, num_host_blocks=16)
        reqs = []
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            r = fakes.make_request(i, prompt_len=1, max_tokens=n)
            r.prompt_token_ids = list(p)
            reqs.append(r)
            sched.add_request(r)
            if i % 3 == 2:
                for _ in range(rng.randint(0, 5)):
                    if sched.has_work():
                        sched.update(plan := sched.schedule(), fake.execute(plan))
                        sched.pool.check_invariants()
        while sched.has_work():
            sched.update(plan := sched.schedule(), fake.execute(plan))
            sched.pool.check_invariants()
        assert sched.pool.num_free_blocks == blocks and sched.pool.num_used_references() == 0
        return [r.output_token_ids for r in reqs]

    assert run(True, num_blocks) == run(False, 400)
