"""The step scheduler against a fake executor that checks every plan (no model)."""

from __future__ import annotations

import pytest

from scheduler_svc.block_pool import blocks_needed
from scheduler_svc.request import FinishReason


def test_budget_seq_cap_and_blocks_follow_the_work(fakes):
    sched = fakes.make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=64, max_num_seqs=5)
    fake = fakes.FakeExecutor(512, 4)
    for i in range(8):
        sched.add_request(fakes.make_request(i, prompt_len=10 + 37 * i, max_tokens=6))

    def check(s, plan):
        assert plan.num_tokens <= 64
        assert len(plan.seqs) <= 5
        for req in s.running:
            # A request holds exactly the blocks its computed tokens need, this step's
            # included (the plan moved the cursor when it was built).
            assert len(req.block_ids) == blocks_needed(req.num_computed_tokens, 4)

    outputs = fakes.run_to_completion(sched, fake, check=check)
    assert all(len(o) == 6 for o in outputs.values())
    assert sched.pool.num_free_blocks == 512
    sched.pool.check_invariants()


def test_decodes_are_never_stalled_by_a_long_prefill(fakes):
    sched = fakes.make_scheduler(num_blocks=4096, block_size=16, max_num_batched_tokens=512)
    fake = fakes.FakeExecutor(4096, 16)
    for i in range(16):
        sched.add_request(fakes.make_request(i, prompt_len=20, max_tokens=200))
    for _ in range(3):  # all 16 prefilled and decoding
        sched.update(plan := sched.schedule(), fake.execute(plan))
    assert all(not r.is_prefilling for r in sched.running)
    sched.add_request(fakes.make_request(99, prompt_len=8192, max_tokens=4))
    chunks = []
    while any(r.seq_id == 99 and r.is_prefilling for r in list(sched.running) + sched.waiting):
        plan = sched.schedule()
        decodes = [s for s in plan.seqs if s.seq_id != 99]
        assert len(decodes) == 16 and all(s.num_new_tokens == 1 for s in decodes)
        assert plan.seqs[:16] == decodes  # decodes come first
        chunk = [s.num_new_tokens for s in plan.seqs if s.seq_id == 99]
        chunks += chunk
        assert plan.num_tokens <= 512
        sched.update(plan, fake.execute(plan))
    assert sum(chunks) == 8192 and max(chunks) == 512 - 16


def test_only_the_chunk_reaching_the_last_token_samples(fakes):
    sched = fakes.make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=16)
    fake = fakes.FakeExecutor(256, 4)
    sched.add_request(fakes.make_request(1, prompt_len=50, max_tokens=3))
    fakes.run_to_completion(sched, fake)
    entries = [s for p in fake.plans for s in p.seqs]
    prefill = [s for s in entries if s.num_computed_tokens < 50]
    assert [s.num_new_tokens for s in prefill] == [16, 16, 16, 2]
    assert [s.sample for s in prefill] == [False, False, False, True]
    # Decode entries carry no token id: the executor feeds back what it sampled.
    assert all(s.token_ids == [] for s in entries if s.num_computed_tokens >= 50)


@pytest.mark.parametrize("budget", [1, 4, 7, 64, 4096])
def test_outputs_do_not_depend_on_chunk_size(fakes, budget):
    def run(budget, chunked=True):
        sched = fakes.make_scheduler(
            num_blocks=1024, block_size=4, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        )
        fake = fakes.FakeExecutor(1024, 4)
        for i in range(6):
            sched.add_request(fakes.make_request(i, prompt_len=1 + 19 * i, max_tokens=10))
        return fakes.run_to_completion(sched, fake)

    assert run(budget) == run(4096, chunked=False)


def test_chunking_off_prefill_steps_carry_no_decodes(fakes):
    sched = fakes.make_scheduler(
        num_blocks=1024, block_size=4, max_num_batched_tokens=256, enable_chunked_prefill=False
    )
    fake = fakes.FakeExecutor(1024, 4)
    sched.add_request(fakes.make_request(0, prompt_len=30, max_tokens=20))
    sched.update(plan := sched.schedule(), fake.execute(plan))
    sched.add_request(fakes.make_request(1, prompt_len=200, max_tokens=5))

    def check(s, plan):
        prefill = [e for e, r in zip(plan.seqs, s.step_stats.requests) if e.num_computed_tokens < r.num_prompt_tokens]
        assert len(prefill) in (0, len(plan.seqs)), "a step mixed prefill and decode with chunking off"
        assert all(e.num_computed_tokens == 0 and e.sample for e in prefill)  # whole prompt at once

    fakes.run_to_completion(sched, fake, check=check)


def test_small_pool_preempts_instead_of_failing_and_outputs_match(fakes):
    def run(num_blocks):
        sched = fakes.make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        fake = fakes.FakeExecutor(num_blocks, 4)
        for i in range(6):
            sched.add_request(fakes.make_request(i, prompt_len=25, max_tokens=30))
        out = fakes.run_to_completion(sched, fake)
        assert sched.pool.num_free_blocks == num_blocks
        return out, sum(len(p.preempted) for p in fake.plans)

    small, n_small = run(20)  # one request needs 14 blocks at most
    big, n_big = run(1000)
    assert n_small > 0 and n_big == 0
    assert small == big


def test_stop_conditions(fakes):
    sched = fakes.make_scheduler()
    fake = fakes.FakeExecutor(64, 4, eos_after=12)
    eos = fakes.make_request(1, prompt_len=10, max_tokens=50)
    ignore = fakes.make_request(2, prompt_len=10, max_tokens=5, ignore_eos=True)
    min_tok = fakes.make_request(3, prompt_len=10, max_tokens=5, min_tokens=4)
    for r in (eos, ignore, min_tok):
        sched.add_request(r)
    fakes.run_to_completion(sched, fake)
    # History reaches 12 tokens after two outputs, so the third output is EOS.
    assert eos.finish_reason is FinishReason.STOP and len(eos.output_token_ids) == 3
    assert eos.output_token_ids[-1] == fakes.EOS and fakes.EOS not in eos.output_token_ids[:-1]
    assert ignore.finish_reason is FinishReason.LENGTH and len(ignore.output_token_ids) == 5
    # EOS from the third output on, but min_tokens=4 ignores it until the fourth.
    assert min_tok.finish_reason is FinishReason.STOP and min_tok.output_token_ids[2:] == [fakes.EOS] * 2

    sched = fakes.make_scheduler()
    fake = fakes.FakeExecutor(64, 4)
    first = fake.next_token(fakes.make_request(4, 10).prompt_token_ids)
    stop_id = fakes.make_request(4, prompt_len=10, max_tokens=50, stop_token_ids=(first,))
    sched.add_request(stop_id)
    fakes.run_to_completion(sched, fake)
    assert stop_id.output_token_ids == [first] and stop_id.finish_reason is FinishReason.STOP


def test_abort_in_every_state_frees_everything(fakes):
    sched = fakes.make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    fake = fakes.FakeExecutor(64, 4)
    reqs = [fakes.make_request(i, prompt_len=30, max_tokens=20) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()  # r0 mid-prefill, others waiting
    sched.update(plan, fake.execute(plan))
    assert reqs[0].is_prefilling and reqs[0].block_ids
    assert sched.abort("r0") is reqs[0] and sched.abort("r0") is None
    assert sched.abort("r3") is reqs[3]  # waiting
    fakes.run_to_completion(sched, fake)
    assert sched.pool.num_free_blocks == 64 and not sched.requests and not sched.running and not sched.waiting
    # The executor was told to drop the aborted sequence's state.
    assert any(0 in p.finished_seq_ids for p in fake.plans)
    assert reqs[0].finish_reason is FinishReason.ABORTED


def test_late_result_of_an_aborted_request_is_dropped(fakes):
    sched = fakes.make_scheduler()
    fake = fakes.FakeExecutor(64, 4)
    req = fakes.make_request(1, prompt_len=5, max_tokens=5)
    sched.add_request(req)
    plan = sched.schedule()
    result = fake.execute(plan)
    sched.abort("r1")  # while the step is "in flight"
    assert sched.update(plan, result) == []
    assert req.output_token_ids == [] and sched.pool.num_free_blocks == 64


def test_partial_prefill_caps_hold_in_every_step(fakes):
    sched = fakes.make_scheduler(
        num_blocks=8192,
        block_size=16,
        max_num_batched_tokens=512,
        max_num_partial_prefills=3,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=256,
    )
    fake = fakes.FakeExecutor(8192, 16)
    for i in range(12):  # alternating long (3000) and short (100) prompts
        sched.add_request(fakes.make_request(i, prompt_len=3000 if i % 2 == 0 else 100, max_tokens=4))
    seen_long = 0

    def check(s, plan):
        nonlocal seen_long
        # After this step (its plan moved the cursors): who is mid-prefill?
        mid = [r for r in s.running if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        assert len(mid) <= 3
        longs = [r for r in mid if r.num_prompt_tokens == 3000]
        assert len(longs) <= 1
        seen_long = max(seen_long, len(longs))

    out = fakes.run_to_completion(sched, fake, check=check)
    assert seen_long == 1 and all(len(o) == 4 for o in out.values())


def test_short_prompt_behind_two_long_ones_gets_its_first_token_at_once(fakes):
    sched = fakes.make_scheduler(num_blocks=8192, block_size=16, max_num_batched_tokens=1024)
    fake = fakes.FakeExecutor(8192, 16)
    for i in range(2):
        sched.add_request(fakes.make_request(i, prompt_len=8000, max_tokens=4))
    sched.update(plan := sched.schedule(), fake.execute(plan))
    short = fakes.make_request(9, prompt_len=60, max_tokens=4)
    sched.add_request(short)
    plan = sched.schedule()
    sched.update(plan, fake.execute(plan))
    # The next step already prefilled it whole and sampled its first token.
    assert len(short.output_token_ids) == 1
    # ...while the long prompt that was running kept going with the rest of the budget
    # (its chunk ends on a block boundary, so up to one block of it may be left unused).
    assert 1024 - 16 < sum(e.num_new_tokens for e in plan.seqs) <= 1024


def test_a_long_prefill_alone_uses_the_whole_budget(fakes):
    sched = fakes.make_scheduler(num_blocks=8192, block_size=16, max_num_batched_tokens=2048)
    fake = fakes.FakeExecutor(8192, 16)
    sched.add_request(fakes.make_request(0, prompt_len=8192 - 100, max_tokens=2))
    fakes.run_to_completion(sched, fake)
    chunks = [e.num_new_tokens for p in fake.plans for e in p.seqs if e.num_computed_tokens < 8192 - 100]
    assert chunks == [2048, 2048, 2048, 1948]
