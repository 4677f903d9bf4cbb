"""Preemption by recompute and by swap, against the KV-simulating fake executor."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.block_pool import blocks_needed
from scheduler_svc.request import RequestStatus


def run(fakes, num_blocks, mode, num_host_blocks=0, n=6, prompt_len=25, max_tokens=30, budget=32, **cfg):
    sched = fakes.make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        num_host_blocks=num_host_blocks,
        **cfg,
    )
    fake = fakes.FakeExecutor(num_blocks, 4, num_host_blocks=num_host_blocks)
    for i in range(n):
        sched.add_request(fakes.make_request(i, prompt_len=prompt_len, max_tokens=max_tokens))
    stats = []  # each step's StepStats

    def check(s, plan):
        check_invariants(s)
        stats.append(s.step_stats)

    out = fakes.run_to_completion(sched, fake, check=check)
    check_drained(sched)
    return out, stats, fake


def check_invariants(sched) -> None:
    sched.pool.check_invariants()
    if sched.host_pool is not None:
        sched.host_pool.check_invariants()
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING and not r.host_block_ids
    for r in sched.swapped:
        assert r.status is RequestStatus.SWAPPED and not r.block_ids
        assert len(r.host_block_ids) == blocks_needed(r.num_computed_tokens, sched.pool.block_size)
    for r in sched.waiting:
        assert not r.block_ids and not r.host_block_ids
    used = sum(len(r.block_ids) for r in sched.running)
    assert used == sched.pool.num_blocks - sched.pool.num_free_blocks, "device accounting"
    if sched.host_pool is not None:
        held = sum(len(r.host_block_ids) for r in sched.swapped)
        assert held == sched.host_pool.num_blocks - sched.host_pool.num_free_blocks, "host accounting"


def check_drained(sched) -> None:
    assert not sched.running and not sched.waiting and not sched.swapped and not sched.requests
    assert sched.pool.num_free_blocks == sched.pool.num_blocks
    if sched.host_pool is not None:
        assert sched.host_pool.num_free_blocks == sched.host_pool.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_gives_the_same_tokens(fakes, mode):
    reference, _, _ = run(fakes, 1000, mode, num_host_blocks=1000)
    out, stats, fake = run(fakes, 20, mode, num_host_blocks=100)
    assert sum(len(p.preempted) for p in fake.plans) > 0
    assert out == reference
    swaps = sum(len(p.swap_out) for p in fake.plans)
    assert (swaps > 0) == (mode == "swap")
    if mode == "swap":
        assert sum(len(p.swap_in) for p in fake.plans) == swaps
        assert sum(s.recomputed_tokens for s in stats) == 0


def test_swap_keeps_a_mid_prefill_cursor_exactly(fakes):
    sched = fakes.make_scheduler(
        num_blocks=24, block_size=4, max_num_batched_tokens=8, preemption_mode="swap", num_host_blocks=64
    )
    fake = fakes.FakeExecutor(24, 4, num_host_blocks=64)
    old = fakes.make_request(0, prompt_len=30, max_tokens=60)
    sched.add_request(old)
    while old.num_output_tokens < 1:
        sched.update(plan := sched.schedule(), fake.execute(plan))
    late = fakes.make_request(1, prompt_len=60, max_tokens=2)
    sched.add_request(late)
    cursor_at_swap = None
    for _ in range(200):
        plan = sched.schedule()
        if late.status is RequestStatus.SWAPPED and cursor_at_swap is None:
            cursor_at_swap = late.num_computed_tokens
            assert 0 < cursor_at_swap < late.num_prompt_tokens  # preempted mid-prefill
        if cursor_at_swap is not None and any(e.seq_id == 1 for e in plan.seqs):
            entry = next(e for e in plan.seqs if e.seq_id == 1)
            assert entry.num_computed_tokens == cursor_at_swap and entry.replace_block_table
            sched.update(plan, fake.execute(plan))
            break
        sched.update(plan, fake.execute(plan))
    else:
        raise AssertionError("the late request was never swapped out and back in")
    fakes.run_to_completion(sched, fake)
    check_drained(sched)


def test_swap_falls_back_to_recompute_when_host_space_runs_out(fakes):
    out, stats, fake = run(fakes, 20, "swap", num_host_blocks=2)
    assert sum(s.recomputed_tokens for s in stats) > 0
    reference, _, _ = run(fakes, 1000, "recompute")
    assert out == reference


def test_livelock_workload_finishes_in_bounded_steps(fakes):
    """Each request needs 60% of the pool by its end: two cannot both finish resident, and a
    scheduler that always evicts the newcomer's rival thrashes forever."""
    for mode in ("recompute", "swap"):
        sched = fakes.make_scheduler(
            num_blocks=40,
            block_size=4,
            max_num_batched_tokens=64,
            preemption_mode=mode,
            num_host_blocks=200 if mode == "swap" else 0,
        )
        fake = fakes.FakeExecutor(40, 4, num_host_blocks=200)
        for i in range(4):
            sched.add_request(fakes.make_request(i, prompt_len=40, max_tokens=56))
        steps = 0
        while sched.has_work():
            sched.update(plan := sched.schedule(), fake.execute(plan))
            steps += 1
            assert steps < 4 * 60 * 3, f"{mode}: no forward progress"
        check_drained(sched)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)  # fakes is stateless
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.integers(12, 40),
    budget=st.sampled_from([4, 8, 16, 64]),
    chunked=st.booleans(),
    host=st.sampled_from([0, 4, 64]),
)
def test_random_workloads_keep_every_invariant(fakes, seed, mode, num_blocks, budget, chunked, host):
    """Random arrivals, aborts and steps on tiny pools; invariants after every step."""
    rng = random.Random(seed)
    block = 4
    max_len = min(num_blocks * block, budget if not chunked else 10**9)
    sched = fakes.make_scheduler(
        num_blocks=num_blocks,
        block_size=block,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        num_host_blocks=host,
        max_num_seqs=6,
    )
    fake = fakes.FakeExecutor(num_blocks, block, num_host_blocks=host, eos_after=rng.choice([None, 30]))
    next_id = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.25:
            prompt = rng.randint(1, max(1, max_len - 2))
            sched.add_request(
                fakes.make_request(next_id, prompt_len=prompt, max_tokens=rng.randint(1, max(1, max_len - prompt)))
            )
            next_id += 1
        elif action < 0.32 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        if sched.has_work():
            sched.update(plan := sched.schedule(), fake.execute(plan))
            assert plan.num_tokens <= budget and len(plan.seqs) <= 6
        check_invariants(sched)
    for _ in range(20_000):
        if not sched.has_work():
            break
        sched.update(plan := sched.schedule(), fake.execute(plan))
        check_invariants(sched)
    check_drained(sched)
