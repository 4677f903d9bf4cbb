"""Multi-step decoding (--num-scheduler-steps, scheduler_svc/multi_step.py): a plan of decodes
alone, with nothing waiting, runs several decode steps in the executor.

The fake executor (conftest.py) runs a multi-step plan as the real one does (the plan, then a
decode per entry per step, each feeding back its token) and derives each token from the KV it
reads back, with a block table that must hold exactly the plan's steps: a wrong cursor, block
or token count changes the output or trips a check. The suite runs 25 random workloads; more:
`CHUNKSERVE_MULTI_STEP_EXAMPLES=2000 .venv/bin/python -m pytest tests/scheduler_svc/test_multi_step.py`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.config import AUTO_SCHEDULER_STEPS, MAX_SCHEDULER_STEPS, SchedulerConfig, resolve_auto
from scheduler_svc.plan import Sampled, StepResult
from scheduler_svc.structured import Constraint

BLOCK = 4
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'


@settings(
    max_examples=int(os.environ.get("CHUNKSERVE_MULTI_STEP_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # both stateless
)
@given(
    data=st.data(),
    n=st.integers(1, 6),
    steps=st.integers(2, 9),
    eos_after=st.sampled_from([None, 30, 50]),
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.sampled_from([16, 24, 96]),
    caching=st.booleans(),
    loop=st.sampled_from(["plain", "async scheduling", "async output processing", "speculative"]),
    stream=st.booleans(),
)
def test_multi_step_changes_no_request_and_leaks_no_block(
    fakes, byte_tokenizer_dir, data, n, steps, eos_after, mode, num_blocks, caching, loop, stream
):
    """Every request's tokens, text and finish reason are those of one step a plan: EOS, stop
    strings and stop tokens inside a plan's steps (the tokens after them are dropped),
    max_tokens, a 64-token context, shared prefixes (prefix cache), preemption by recompute or
    swap; the plain loop, async scheduling, async output processing, or n-gram drafts (a drafted
    plan is not extended, the others may be); aborted requests get a prefix of the same tokens;
    a plan's tokens streamed step by step (--multi-step-stream-outputs, a plan whose requests all
    ended cut) or together. No block, host block or executor sequence is left."""
    base = fakes.draw_prompts(data, n)
    cfg = dict(
        preemption_mode=mode,
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 64]), label="budget"),
        enable_prefix_caching=caching,
        max_model_len=64,
        async_scheduling=loop == "async scheduling",
        async_output_processing=loop == "async output processing",
        speculative_config=NGRAM if loop == "speculative" else None,
        multi_step_stream_outputs=stream,
    )

    def go(work, num_scheduler_steps):
        fake = fakes.FakeExecutor(num_blocks, BLOCK, eos_after=eos_after, num_host_blocks=64)
        engine, results = fakes.run_workload(
            byte_tokenizer_dir, work, fake=fake, num_scheduler_steps=num_scheduler_steps, **cfg
        )
        sched = engine.scheduler
        assert sched.pool.num_free_blocks == num_blocks and sched.host_pool.num_free_blocks == 64
        assert not sched.requests and not fake.seqs and not engine.is_dead
        return results, fake

    probe, _ = go([(p, m, (), None) for p, m in base], 1)
    work = fakes.draw_stops_and_aborts(data, base, [text for _, text, _, _ in probe])
    (one, _), (multi, fake) = go(work, 1), go(work, steps)
    for (_, _, _, abort), a, b, full in zip(work, one, multi, probe):
        assert a[3] is None and b[3] is None  # no request failed
        if abort is None:
            assert b == a
        else:  # where an abort lands depends on when the stream is read: a prefix, then ended
            for tokens, _, reason, _ in (a, b):
                assert tokens == full[0][: len(tokens)] and reason is not None
    assert all(1 <= p.num_steps <= steps and p.stream_steps == (stream and p.num_steps > 1) for p in fake.plans)
    if n == 1 and len(multi[0][0]) >= 3 and loop != "speculative":  # a lone request decoded, 2+ tokens left
        assert any(p.num_steps > 1 for p in fake.plans)
        assert (fake.streamed_steps > 0) == stream


def test_one_request_decodes_in_plans_of_k_steps(fakes, byte_tokenizer_dir):
    """A lone request: its prompt in one plan, then plans of 4 steps, the last shrunk to what
    max_tokens leaves; its tokens are those of one step a plan, and its stream gets them in
    a few messages rather than one each."""
    work = [(list(range(40, 50)), 11, (), None)]
    plans, outs = {}, {}
    for k in (1, 4):
        fake = fakes.FakeExecutor(96, BLOCK)
        _, outs[k] = fakes.run_workload(byte_tokenizer_dir, work, fake=fake, num_scheduler_steps=k)
        plans[k] = [(len(p.seqs[0].token_ids), p.num_steps) for p in fake.plans if p.seqs]
    assert outs[4] == outs[1] and len(outs[4][0][0]) == 11
    assert plans[1] == [(10, 1)] + [(0, 1)] * 10
    assert plans[4] == [(10, 1), (0, 4), (0, 4), (0, 2)]  # 1 + 4 + 4 + 2 = 11 tokens


def test_extend_rules(fakes):
    """Only a plan of decodes alone with nothing waiting or swapped is extended; k shrinks to
    max_tokens, the context and the free blocks; a constrained request is never extended; the
    cursor and in-flight count move by the plan's steps, and the blocks the later steps filled
    are cached once their ids are back."""
    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK, num_scheduler_steps=6, enable_prefix_caching=True)
    sched.add_request(fakes.make_request(1, 7, max_tokens=20))
    prefill = sched.schedule()
    assert prefill.num_steps == 1  # a prompt chunk is not a decode
    sched.update(prefill, StepResult(prefill.step_id, [Sampled(1, 50)]))
    request = sched.requests["r1"]
    sched.add_request(fakes.make_request(2, 9, max_tokens=20))
    mixed = sched.schedule()  # r1's decode and r2's prompt
    assert mixed.num_steps == 1 and len(mixed.seqs) == 2
    sched.update(mixed, StepResult(mixed.step_id, [Sampled(1, 51), Sampled(2, 60)]))
    decodes = sched.schedule()
    assert decodes.num_steps == 6 and [s.num_new_tokens for s in decodes.seqs] == [1, 1]
    assert request.num_computed_tokens == 8 + 6 and request.num_inflight_tokens == 6
    assert len(request.block_ids) == 4  # 14 positions of KV at block size 4
    result = [Sampled(seq_id, 70 + j) for seq_id in (1, 2) for j in range(6)]
    outputs = sched.update(decodes, StepResult(decodes.step_id, result, num_steps=6))
    assert [o.sampled.token_id for o in outputs if o.request is request] == list(range(70, 76))
    assert request.num_inflight_tokens == 0 and request.output_token_ids == [50, 51, *range(70, 76)]
    assert len(request.block_hashes) == 14 // BLOCK  # filled by the later steps, cached

    # max_tokens: r1 has 20 - 8 = 12 left, r2 20 - 7 = 13; six each again, then the rest
    again = sched.schedule()
    assert again.num_steps == 6
    sched.update(again, StepResult(again.step_id, [Sampled(s, 80) for s in (1, 2) for _ in range(6)], num_steps=6))
    last = sched.schedule()
    assert last.num_steps == 20 - 14  # r1's last six tokens: 14 + 6 = 20
    sched.update(last, StepResult(last.step_id, [Sampled(s, 81) for s in (1, 2) for _ in range(6)], num_steps=6))
    assert "r1" not in sched.requests and sched.requests["r2"].num_output_tokens == 19

    # a waiting request keeps the plan at one step; so does a constrained one
    sched.add_request(fakes.make_request(3, 200, max_tokens=4))
    sched.add_request(fakes.make_request(4, 200, max_tokens=4))
    sched.config = SchedulerConfig(num_scheduler_steps=6, max_num_batched_tokens=4, max_num_seqs=2)
    plan = sched.schedule()
    assert plan.num_steps == 1 and sched.waiting


def test_a_constrained_request_is_never_extended(fakes):
    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK, num_scheduler_steps=4)
    request = fakes.make_request(1, 5, max_tokens=9, constraint=Constraint.make("regex", "[a-z]+"))
    sched.add_request(request)

    class Matcher:  # the grammar allows anything here; what counts is that there is one
        def token_mask(self):
            return b"\xff" * 8

    request.matcher = Matcher()
    for _ in range(3):
        plan = sched.schedule()
        assert plan.num_steps == 1
        request.matcher = None  # leave the grammar out of update; the constraint alone decides
        sched.update(plan, StepResult(plan.step_id, [Sampled(1, 60)]))
        request.matcher = Matcher()


def test_k_shrinks_to_the_free_blocks_and_never_preempts(fakes):
    sched = fakes.make_scheduler(num_blocks=4, block_size=BLOCK, num_scheduler_steps=8)
    sched.add_request(fakes.make_request(1, 8, max_tokens=12))
    prefill = sched.schedule()
    sched.update(prefill, StepResult(prefill.step_id, [Sampled(1, 50)]))
    plan = sched.schedule()  # position 8 onwards: blocks 3 and 4 are free, 8 slots
    assert plan.num_steps == 8 and sched.pool.num_free_blocks == 0 and not plan.preempted
    sched.update(plan, StepResult(plan.step_id, [Sampled(1, 51)] * 8, num_steps=8))
    assert sched.requests["r1"].num_computed_tokens == 16
    last = sched.schedule()  # no block left for more than the one step
    assert last.num_steps == 1 or last.is_empty or last.preempted


@pytest.mark.parametrize("value", [0, MAX_SCHEDULER_STEPS + 1])
def test_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="--num-scheduler-steps"):
        SchedulerConfig(num_scheduler_steps=value)


def test_the_trace_and_metrics_count_every_step(fakes):
    """A multi-step plan is as many steps as it ran (here 2 of 3: cut short) to the
    iteration_tokens histogram and to the trace (its executor time per step)."""
    from scheduler_svc.metrics import Metrics
    from scheduler_svc.observer import StepRecord
    from scheduler_svc.trace import StepTracer

    sched = fakes.make_scheduler(num_blocks=64, block_size=BLOCK, num_scheduler_steps=3)
    sched.add_request(fakes.make_request(1, 7, max_tokens=20))
    prefill = sched.schedule()
    sched.update(prefill, StepResult(prefill.step_id, [Sampled(1, 50)]))
    plan, stats = sched.schedule(), sched.step_stats
    assert plan.num_steps == 3
    result = StepResult(plan.step_id, [Sampled(1, 51)] * 2, execute_ns=7_000_000, num_steps=2)
    record = StepRecord(plan, stats, result, 0.0, 1, sched.snapshot())
    metrics, tracer = Metrics("m"), StepTracer()
    queue = tracer.subscribe()
    metrics.on_step(record)
    tracer.on_step(record)
    sample = metrics.registry.get_sample_value
    assert sample("chunkserve_iteration_tokens_count", {"model_name": "m"}) == 2
    assert sample("chunkserve_iteration_tokens_sum", {"model_name": "m"}) == 2
    trace = queue.get_nowait()
    assert trace.num_steps == 2 and trace.num_tokens == 1 and trace.executor_ns == 7_000_000

    # the replica's step-time model (the router's load signal) learns a step's time, not the plan's
    from scheduler_svc.replica import WARM_UP, StepCostWatch

    watch = StepCostWatch()
    watch.enabled = True
    record = StepRecord(plan, stats, result, 0.0, 40_000_000, sched.snapshot())
    for _ in range(WARM_UP + 1):
        watch.on_step(record)
    assert watch._steps[-1].seconds == pytest.approx(0.02)  # 40 ms over the 2 steps run


def test_a_cut_plan_moves_cursors_back_over_the_steps_it_did_not_run(fakes):
    """CutSteps ended a 6-step plan after 2: each request keeps 2 tokens, its cursor and
    in-flight count move back over the other 4, its blocks stay for the next tokens, and only
    blocks full of known tokens are cached; the policy is told the tokens computed, not the
    ones planned; the next plan decodes from there."""
    sched = fakes.make_scheduler(
        num_blocks=64, block_size=BLOCK, num_scheduler_steps=6, enable_prefix_caching=True, scheduling_policy="fair"
    )
    sched.add_request(fakes.make_request(1, 7, max_tokens=20))
    prefill = sched.schedule()
    sched.update(prefill, StepResult(prefill.step_id, [Sampled(1, 50)]))
    plan = sched.schedule()
    request = sched.requests["r1"]
    assert plan.num_steps == 6 and len(request.block_ids) == 4  # positions 7..12
    outputs = sched.update(plan, StepResult(plan.step_id, [Sampled(1, 60), Sampled(1, 61)], num_steps=2))
    assert [o.sampled.token_id for o in outputs] == [60, 61]
    assert request.num_computed_tokens == 9 and request.num_inflight_tokens == 0 and request.num_tokens == 10
    assert len(request.block_ids) == 4 and len(request.block_hashes) == 2  # 9 tokens: two full blocks
    assert sched.policy.served[request.tenant] == 7 + 2  # the prompt, then the 2 steps that ran
    after = sched.schedule()
    assert after.seqs[0].num_computed_tokens == 9 and after.seqs[0].new_block_ids == [] and after.num_steps == 6


@pytest.mark.parametrize("cut_to", [1, 3])
def test_a_request_that_arrives_cuts_the_multi_step_plan_in_flight(fakes, byte_tokenizer_dir, cut_to):
    """A lone stream decodes in plans of 8 steps; a request that arrives while one runs asks the
    executor to end it after the step under way (CutSteps), so the new prompt is in the next
    plan rather than 7 steps later. Tokens are those of one step a plan, nothing leaks."""
    import asyncio

    from scheduler_svc.engine import Engine
    from scheduler_svc.output import collect
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    work = [(list(range(40, 50)), 30), (list(range(60, 72)), 5)]
    _, reference = fakes.run_workload(
        byte_tokenizer_dir, [(p, m, (), None) for p, m in work], fake=fakes.FakeExecutor(96, BLOCK)
    )

    async def main():
        fake = fakes.FakeExecutor(96, BLOCK)
        fake.steps_when_cut = lambda plan: cut_to
        client = fakes.FakeExecutorClient(fakes.fake_handshake(), fake)
        client.hold_after = 2  # the prefill, the first 8-step plan, then hold the second
        sched = fakes.make_scheduler(num_blocks=96, block_size=BLOCK, num_scheduler_steps=8)
        engine = Engine(sched, client, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        first = asyncio.ensure_future(collect(engine.add_request(work[0][0], SamplingParams(0.0, max_tokens=30))))
        await asyncio.wait_for(client.held.wait(), 60)
        held = sched.num_steps - 1  # the plan the executor holds
        assert [p.num_steps for p in fake.plans] == [1, 8]
        second = asyncio.ensure_future(collect(engine.add_request(work[1][0], SamplingParams(0.0, max_tokens=5))))
        client.release.set()
        finals = await asyncio.wait_for(asyncio.gather(first, second), 60)
        await engine.stop()
        return fake, held, finals, sched

    fake, held, finals, sched = asyncio.run(main())
    assert fake.cuts == [held]
    cut = next(i for i, p in enumerate(fake.plans) if p.step_id == held)
    assert fake.plans[cut].num_steps == 8 and fake.plans[cut + 1].seqs[-1].token_ids == work[1][0]
    assert [f.token_ids for f in finals] == [r[0] for r in reference]
    assert sched.pool.num_free_blocks == 96 and not sched.requests


@settings(
    max_examples=int(os.environ.get("CHUNKSERVE_MULTI_STEP_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    n=st.integers(2, 5),
    steps=st.integers(2, 8),
    cut_to=st.integers(1, 8),
    eos_after=st.sampled_from([None, 25, 40]),
    async_scheduling=st.booleans(),
    num_blocks=st.sampled_from([16, 96]),
)
def test_requests_arriving_during_multi_step_plans_change_no_tokens(
    fakes, byte_tokenizer_dir, data, n, steps, cut_to, eos_after, async_scheduling, num_blocks
):
    """Requests arrive one by one, each after a drawn number of the executor's plans, so many
    land while a multi-step plan runs and cut it (to a drawn number of steps); preemption
    (16 blocks), EOS and async scheduling mix in. Every request's tokens are those of the same
    prompts run with one step a plan, and nothing is left behind."""
    import asyncio

    from scheduler_svc.engine import Engine
    from scheduler_svc.output import collect
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    work = [
        (
            [(i * 37 + j * 11) % 200 + 20 for j in range(data.draw(st.integers(1, 30), label="prompt_len"))],
            data.draw(st.integers(1, 30), label="max_tokens"),
        )
        for i in range(n)
    ]
    gaps = [data.draw(st.integers(0, 6), label="plans_before_arrival") for _ in range(n)]
    cfg = dict(max_num_batched_tokens=16, max_model_len=64)
    _, reference = fakes.run_workload(
        byte_tokenizer_dir,
        [(p, m, (), None) for p, m in work],
        fake=fakes.FakeExecutor(num_blocks, BLOCK, eos_after=eos_after),
        **cfg,
    )

    async def main():
        fake = fakes.FakeExecutor(num_blocks, BLOCK, eos_after=eos_after)
        fake.steps_when_cut = lambda plan: cut_to
        sched = fakes.make_scheduler(
            num_blocks=num_blocks, block_size=BLOCK, num_scheduler_steps=steps, async_scheduling=async_scheduling, **cfg
        )
        engine = Engine(sched, fake, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        streams = []
        for (prompt, max_tokens), gap in zip(work, gaps):
            target = len(fake.plans) + gap
            for _ in range(100_000):  # until that many more plans ran, or the engine is idle
                if len(fake.plans) >= target or not (sched.has_work() or fake.in_flight):
                    break
                await asyncio.sleep(0)
            streams.append(
                asyncio.ensure_future(collect(engine.add_request(prompt, SamplingParams(0.0, max_tokens=max_tokens))))
            )
        finals = await asyncio.wait_for(asyncio.gather(*streams), 60)
        for _ in range(10_000):  # the last drops travel in one more plan
            if not sched.has_work() and not fake.seqs and not fake.in_flight:
                break
            await asyncio.sleep(0.001)
        await engine.stop()
        return finals, sched, fake

    finals, sched, fake = asyncio.run(main())
    assert [f.token_ids for f in finals] == [r[0] for r in reference]
    assert [f.finish_reason for f in finals] == [r[2] for r in reference]
    assert sched.pool.num_free_blocks == num_blocks and not sched.requests and not fake.seqs


@pytest.mark.parametrize("fault", ["executor dies", "out of memory"])
def test_a_multi_step_plan_that_fails_fails_its_requests_and_leaks_nothing(fakes, byte_tokenizer_dir, fault):
    """Fault injection: the executor dies during a multi-step plan (every stream ends
    UNAVAILABLE and the engine is dead), or refuses it out of memory and lives on (its requests
    end RESOURCE_EXHAUSTED and a request sent afterwards is served with the tokens one step a
    plan gives). Either way no stream hangs and no block is left taken."""
    import asyncio

    import grpc

    from scheduler_svc.engine import Engine
    from scheduler_svc.errors import StepFailedError
    from scheduler_svc.output import collect
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    later = (list(range(80, 90)), 6)
    _, reference = fakes.run_workload(byte_tokenizer_dir, [(*later, (), None)], fake=fakes.FakeExecutor(96, BLOCK))

    class OomOnMultiStep(fakes.FakeExecutor):
        def refusal(self, plan):
            if plan.num_steps > 1 and not self.cuts and not getattr(self, "refused", False):
                self.refused = True
                return StepFailedError("out of memory", grpc.StatusCode.RESOURCE_EXHAUSTED)
            return None

    async def main():
        fake = OomOnMultiStep(96, BLOCK) if fault == "out of memory" else fakes.FakeExecutor(96, BLOCK)
        client = fakes.FakeExecutorClient(fakes.fake_handshake(), fake)
        sched = fakes.make_scheduler(num_blocks=96, block_size=BLOCK, num_scheduler_steps=6, async_scheduling=False)
        engine = Engine(sched, client, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        if fault == "executor dies":
            client.hold_after = 1  # the prefill, then the first multi-step plan waits and dies
        streams = [
            engine.add_request(list(range(40 + 9 * i, 48 + 9 * i)), SamplingParams(0.0, max_tokens=20))
            for i in range(2)
        ]
        if fault == "executor dies":
            await asyncio.wait_for(client.held.wait(), 60)
            # the prefill ran; the plan held is the first multi-step one: 6 tokens in flight each
            assert [p.num_steps for p in fake.plans] == [1]
            assert [r.num_inflight_tokens for r in sched.running] == [6, 6]
            client.die.set()
        finals = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        after = None
        if fault == "out of memory":
            after = await asyncio.wait_for(
                collect(engine.add_request(later[0], SamplingParams(0.0, max_tokens=later[1]))), 60
            )
        dead = engine.is_dead
        await engine.stop()
        return finals, after, dead, sched, fake

    finals, after, dead, sched, fake = asyncio.run(main())
    if fault == "executor dies":
        assert dead and all(f.error is not None and f.error.code is grpc.StatusCode.UNAVAILABLE for f in finals)
    else:
        assert not dead and fake.refused
        assert all(f.error is not None and f.error.code is grpc.StatusCode.RESOURCE_EXHAUSTED for f in finals)
        assert after.error is None and after.token_ids == reference[0][0]
    assert sched.pool.num_free_blocks == 96 and not sched.requests


def test_an_abort_cuts_the_multi_step_plan_in_flight(fakes, byte_tokenizer_dir):
    """A stream cancelled while its 8-step plan runs ends the plan after the step under way:
    its remaining steps would compute tokens nobody reads. The other request in the plan goes
    on with the tokens one step a plan gives."""
    import asyncio

    from scheduler_svc.engine import Engine
    from scheduler_svc.output import collect
    from scheduler_svc.request import FinishReason, SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    work = [(list(range(40, 50)), 30), (list(range(60, 72)), 20)]
    _, reference = fakes.run_workload(
        byte_tokenizer_dir, [(p, m, (), None) for p, m in work], fake=fakes.FakeExecutor(96, BLOCK)
    )

    async def main():
        fake = fakes.FakeExecutor(96, BLOCK)
        fake.steps_when_cut = lambda plan: 2
        client = fakes.FakeExecutorClient(fakes.fake_handshake(), fake)
        client.hold_after = 2  # the prefill, the first 8-step plan, then hold the second
        sched = fakes.make_scheduler(num_blocks=96, block_size=BLOCK, num_scheduler_steps=8, async_scheduling=False)
        engine = Engine(sched, client, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        streams = [engine.add_request(p, SamplingParams(0.0, max_tokens=m)) for p, m in work]
        await asyncio.wait_for(client.held.wait(), 60)
        held = sched.num_steps - 1
        assert engine.abort(streams[0].request_id)
        client.release.set()
        finals = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        await engine.stop()
        return fake, held, finals, sched

    fake, held, finals, sched = asyncio.run(main())
    assert fake.cuts == [held]
    assert finals[0].finish_reason is FinishReason.ABORTED
    assert finals[0].token_ids == reference[0][0][: len(finals[0].token_ids)]
    assert finals[1].token_ids == reference[1][0]
    assert sched.pool.num_free_blocks == 96 and not sched.requests


@pytest.mark.parametrize("stream", [True, False])
def test_a_streamed_plan_gives_its_stream_a_token_a_step(fakes, byte_tokenizer_dir, stream):
    """--multi-step-stream-outputs (the default): a lone request decoding in plans of 4 steps
    has each step's token on its stream the moment the executor answers that step, while the
    plan runs on; off, a plan's 4 tokens reach the stream together, as one message to a reader.
    The same tokens either way, and as with one step a plan."""
    import asyncio

    from scheduler_svc.engine import Engine
    from scheduler_svc.output import stream_deltas
    from scheduler_svc.request import SamplingParams
    from scheduler_svc.tokenizer import Tokenizer

    on_the_stream = []  # after each streamed step's answer: the tokens its stream had been given

    class Watching(fakes.FakeExecutor):
        async def step(self, plan, timeout, on_step=None):
            if on_step is None:
                return await super().step(plan, timeout)

            def answered(result):
                on_step(result)
                queued = len(live.queue._queue)  # the engine puts a delta per token
                on_the_stream.append(sum(len(d.token_ids) for d in read) + queued)

            return await super().step(plan, timeout, answered)

    async def main(k):
        nonlocal live, read
        fake = Watching(96, BLOCK)
        sched = fakes.make_scheduler(
            num_blocks=96,
            block_size=BLOCK,
            num_scheduler_steps=k,
            multi_step_stream_outputs=stream,
            async_scheduling=False,  # no plan goes out before the one before it is served
        )
        engine = Engine(sched, fake, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        live, read = engine.add_request(list(range(40, 50)), SamplingParams(0.0, max_tokens=13)), []
        async for delta in stream_deltas(live):  # as the servicer reads: what queued up comes folded
            read.append(delta)
        await engine.stop()
        return [t for d in read for t in d.token_ids], [len(d.token_ids) for d in read], fake

    live, read = None, []
    one, _, _ = asyncio.run(main(1))
    on_the_stream.clear()
    tokens, sizes, fake = asyncio.run(main(4))
    assert tokens == one and len(one) == 13
    assert [p.num_steps for p in fake.plans if p.seqs] == [1, 4, 4, 4]
    if stream:  # the prefill's token, then each plan's: 3 steps answered before its last
        assert fake.streamed_steps == 9 and on_the_stream == [2, 3, 4, 6, 7, 8, 10, 11, 12]
    else:
        assert fake.streamed_steps == 0 and not on_the_stream and 4 in sizes


def test_the_next_plan_goes_out_once_a_streamed_plans_last_step_is_under_way(fakes, byte_tokenizer_dir):
    """Async scheduling: the plan after a streamed multi-step plan goes out once that plan's
    steps but its last have been answered (a cut can no longer shorten it), so the executor has
    it before it ends the plan; not earlier. The same tokens as one step a plan, nothing left."""
    answered: dict[int, int] = {}  # plan id -> its steps answered so far
    sent_after: list[tuple[int, int]] = []  # (the plan followed, its steps answered) as a plan is sent

    class Watching(fakes.FakeExecutor):
        async def step(self, plan, timeout, on_step=None):
            if plan.follows_step_id is not None:
                sent_after.append((plan.follows_step_id, answered.get(plan.follows_step_id, 0)))
            if on_step is None:
                return await super().step(plan, timeout)

            def counted(result):
                answered[plan.step_id] = answered.get(plan.step_id, 0) + 1
                on_step(result)

            return await super().step(plan, timeout, counted)

    work = [(list(range(40, 50)), 13, (), None)]
    _, reference = fakes.run_workload(byte_tokenizer_dir, work, fake=fakes.FakeExecutor(96, BLOCK))
    fake = Watching(96, BLOCK)
    engine, got = fakes.run_workload(byte_tokenizer_dir, work, fake=fake, num_scheduler_steps=4, async_scheduling=True)
    assert got == reference and len(got[0][0]) == 13
    plans = {p.step_id: p for p in fake.plans if p.seqs}
    assert [p.num_steps for p in plans.values()] == [1, 4, 4, 4]
    assert fake.max_in_flight == 2 and len(sent_after) == 3  # every plan after the first on top of another
    assert [n for _, n in sent_after] == [plans[f].num_steps - 1 for f, _ in sent_after] == [0, 3, 3]
    assert engine.scheduler.pool.num_free_blocks == 96 and not fake.seqs


def test_a_plan_on_top_of_one_that_ends_its_requests_is_cut(fakes, byte_tokenizer_dir):
    """EOS at the last step of a streamed 4-step plan, with the next 4-step plan already sent on
    top of it (async scheduling): the engine cuts that plan as it applies the EOS, not only
    once that plan answers a step for a request that has ended. The tokens are those of one
    step a plan."""
    import asyncio

    from scheduler_svc.request import FinishReason

    class Slow(fakes.FakeExecutor):
        async def step(self, plan, timeout, on_step=None):
            if plan.follows_step_id is not None and plan.num_steps > 1:  # its start waits for a cut, a while
                for _ in range(1000):  # turns of the event loop, no clock: the engine runs meanwhile
                    if plan.step_id in self.cuts:
                        break
                    await asyncio.sleep(0)
            return await super().step(plan, timeout, on_step)

    work = [(list(range(40, 50)), 40, (), None)]
    eos = 14  # the prompt (10): the prefill samples a token, the first 4-step plan 4 (EOS last)
    _, reference = fakes.run_workload(byte_tokenizer_dir, work, fake=fakes.FakeExecutor(96, BLOCK, eos_after=eos))
    fake = Slow(96, BLOCK, eos_after=eos)
    engine, got = fakes.run_workload(byte_tokenizer_dir, work, fake=fake, num_scheduler_steps=4, async_scheduling=True)
    assert got == reference and got[0][2] is FinishReason.STOP and len(got[0][0]) == 5
    multi = [p for p in fake.plans if p.num_steps > 1]
    assert len(multi) == 2 and multi[1].follows_step_id == multi[0].step_id and fake.cuts == [multi[1].step_id]
    assert fake.streamed_steps == 3  # the first plan's; the one on top, cut before it began, ran one step
    assert engine.scheduler.pool.num_free_blocks == 96 and not fake.seqs


def test_a_streamed_plan_whose_requests_all_end_is_cut(fakes, byte_tokenizer_dir):
    """EOS at the third step of an 8-step plan: the engine sees it in that step's answer and
    cuts the plan, so it does not compute the five steps after for nothing (the fake runs a
    cut plan to the step under way); the request's tokens are those of one step a plan, and
    nothing is left."""
    from scheduler_svc.request import FinishReason

    work = [(list(range(40, 50)), 40, (), None)]
    _, reference = fakes.run_workload(byte_tokenizer_dir, work, fake=fakes.FakeExecutor(96, BLOCK, eos_after=13))
    fake = fakes.FakeExecutor(96, BLOCK, eos_after=13)  # the prompt (10), its token, then 2 more steps
    engine, got = fakes.run_workload(byte_tokenizer_dir, work, fake=fake, num_scheduler_steps=8, async_scheduling=False)
    assert got == reference and got[0][2] is FinishReason.STOP
    multi = [p for p in fake.plans if p.num_steps > 1]
    assert len(multi) == 1 and fake.cuts == [multi[0].step_id]
    assert fake.streamed_steps == 3  # answers of steps 1-3; the cut came with the third, step 4 ended it
    assert engine.scheduler.pool.num_free_blocks == 96


@pytest.mark.parametrize(
    ("flags", "handshake", "steps"),
    [
        ({}, {}, AUTO_SCHEDULER_STEPS),  # a CPU executor of one process
        ({}, {"device": "cuda:0"}, 1),
        ({}, {"tensor_parallel_size": 2}, 1),  # its plans run whole: an arrival would wait
        ({"speculative_config": NGRAM}, {}, 1),
        ({"multi_step_stream_outputs": False}, {}, 1),  # bursts only when asked for
        ({"num_scheduler_steps": 1}, {}, 1),  # a value given is kept
        ({"num_scheduler_steps": 4}, {"device": "cuda:0"}, 4),
    ],
)
def test_unset_num_scheduler_steps_is_decided_by_the_executor(fakes, flags, handshake, steps):
    """--num-scheduler-steps unset: multi-step plans that stream each step on a CPU executor of
    one process, one step a plan elsewhere (config.auto_scheduler_steps); the engine before the
    handshake, and a scheduler built without it, plan one step at a time."""
    config = SchedulerConfig(**flags)
    assert resolve_auto(config, fakes.fake_handshake(**handshake)).num_scheduler_steps == steps
    if "num_scheduler_steps" not in flags:
        assert config.num_scheduler_steps is None
        for given, planned in ((None, 1), (4, 4)):  # a decode after the prompt's step
            sched = fakes.make_scheduler(num_blocks=16, block_size=BLOCK, num_scheduler_steps=given)
            sched.add_request(fakes.make_request(1, 3, max_tokens=8))
            first = sched.schedule()
            sched.update(first, StepResult(first.step_id, [Sampled(1, 7)]))
            assert sched.schedule().num_steps == planned
