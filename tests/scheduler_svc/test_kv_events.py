"""KV cache events: a subscriber's index, built from the replay then the live batches, always
equals the pool's cached set, whatever the pool did and whenever the subscriber joined."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.block_hash import hash_block, prompt_block_hashes
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventLog, apply
from scheduler_svc.request import Request, SamplingParams

BS = 4


def cached_set(pool: BlockPool) -> set[bytes]:
    return {b.block_hash for b in pool.blocks if b.block_hash is not None}


class Subscriber:
    """Applies batches to an index, checking they come in sequence (a replay may restart it)."""

    def __init__(self) -> None:
        self.index: set[bytes] = set()
        self.last_seq: int | None = None
        self.batches: list[EventBatch] = []

    def __call__(self, batch: EventBatch) -> None:
        if batch.replay:
            assert isinstance(batch.events[0], AllBlocksCleared)
        elif self.last_seq is not None:
            assert batch.seq == self.last_seq + 1, (batch.seq, self.last_seq)
        self.last_seq = batch.seq
        self.batches.append(batch)
        apply(self.index, batch)


# An operation: (kind, prompt family, prompt length, salt, subscriber index to join or leave).
ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "finish", "finish", "reset", "join", "catch_up"]),
        st.integers(0, 3),
        st.integers(1, 6 * BS + 3),
        st.sampled_from([None, None, "t"]),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(4, 24), st.integers(1, 8))
def test_subscriber_index_equals_cached_set(operations, num_blocks, buffer_steps):
    pool = BlockPool(num_blocks, BS, enable_caching=True)
    log = KVEventLog(buffer_steps=buffer_steps)
    log.attach(pool)
    subs = [Subscriber()]
    log.subscribe(subs[0])
    behind = Subscriber()  # unsubscribed, rejoins by sequence number (history, or a snapshot)
    log.subscribe(behind)
    log.unsubscribe(behind)
    running: list[Request] = []
    for n, (kind, family, length, salt) in enumerate(operations):
        if kind == "admit":
            tokens = [family * 100 + i for i in range(length)]
            r = Request(f"r{n}", n, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
            r.num_computed_tokens = pool.match_prefix(r, salt)
            if not pool.can_allocate(r, r.num_tokens - r.num_computed_tokens):
                pool.free(r)  # what the scheduler's _unmatch does
                continue
            pool.allocate(r, r.num_tokens - r.num_computed_tokens)  # may evict
            r.num_computed_tokens = r.num_tokens
            pool.cache_full_blocks(r, salt, r.num_tokens)
            running.append(r)
        elif kind == "finish" and running:
            pool.free(running.pop(family % len(running)))
        elif kind == "reset":
            pool.reset_cache()
        elif kind == "join":
            subs.append(Subscriber())
            log.subscribe(subs[-1])
        elif kind == "catch_up":
            log.subscribe(behind, from_seq=(behind.last_seq or 0) + 1)
            log.unsubscribe(behind)
        pool.check_invariants()
        for s in subs:
            assert s.index == cached_set(pool)
    log.subscribe(behind, from_seq=(behind.last_seq or 0) + 1)
    assert behind.index == cached_set(pool)


def test_stored_events_carry_the_chain_and_tokens():
    pool = BlockPool(8, BS, enable_caching=True)
    log = KVEventLog()
    log.attach(pool)
    sub = Subscriber()
    log.subscribe(sub)
    tokens = list(range(11))  # two full blocks and a partial one
    r = Request("a", 1, tokens, SamplingParams(max_tokens=1))
    pool.allocate(r, 11)
    r.num_computed_tokens = 11
    pool.cache_full_blocks(r, None, 11)
    (stored,) = sub.batches[-1].events
    assert isinstance(stored, BlockStored)
    h0 = hash_block(None, None, tokens[:4])
    assert stored.block_hashes == (h0, hash_block(h0, None, tokens[4:8]))
    assert stored.parent_block_hash is None and stored.token_ids == tuple(tokens[:8]) and stored.block_size == BS
    # The router's hashes of a prompt are the pool's (one function, chunkserve_contracts.block_hash).
    assert prompt_block_hashes(tokens + [99], BS, None)[:2] == list(stored.block_hashes)
    pool.free(r)
    pool.take(8)  # evicts both
    (removed,) = sub.batches[-1].events
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == set(stored.block_hashes)


def test_one_batch_per_event_loop_turn_and_a_new_pool_clears():
    async def main() -> list[EventBatch]:
        log = KVEventLog()
        pool = BlockPool(8, BS, enable_caching=True)
        log.attach(pool)
        got: list[EventBatch] = []
        log.subscribe(got.append)
        for i in range(2):  # two requests registered in the same turn: one batch
            r = Request(f"r{i}", i, [i * 10 + t for t in range(5)], SamplingParams(max_tokens=1))
            pool.allocate(r, 5)
            pool.cache_full_blocks(r, None, 5)
        await asyncio.sleep(0)
        log.attach(BlockPool(8, BS, enable_caching=True))  # the executor came back: a fresh pool
        await asyncio.sleep(0)
        return got

    got = asyncio.run(main())
    assert [b.replay for b in got] == [True, False, False]
    assert [len(b.events) for b in got[1:]] == [2, 1] and isinstance(got[2].events[0], AllBlocksCleared)
    assert [b.seq for b in got[1:]] == [0, 1]


def test_snapshot_lists_parents_first():
    pool = BlockPool(16, BS, enable_caching=True)
    log = KVEventLog()
    log.attach(pool)
    for i, tokens in enumerate([list(range(13)), list(range(8)) + [50] * 5, list(range(100, 109))]):
        r = Request(f"r{i}", i, tokens, SamplingParams(max_tokens=1))
        r.num_computed_tokens = pool.match_prefix(r, None)
        pool.allocate(r, r.num_tokens - r.num_computed_tokens)
        pool.cache_full_blocks(r, None, r.num_tokens)
    seen: set[bytes | None] = {None}
    for event in log.snapshot().events[1:]:
        assert isinstance(event, BlockStored) and event.parent_block_hash in seen
        seen.update(event.block_hashes)
    assert seen - {None} == cached_set(pool)
