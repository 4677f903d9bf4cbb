"""The step loop with a fake executor: streaming, stop strings, aborts, executor failure."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.engine import Engine
from scheduler_svc.errors import QueueFullError, UnavailableError
from scheduler_svc.request import FinishReason, SamplingParams
from scheduler_svc.tokenizer import Tokenizer


def make_engine(fakes, tokenizer_dir, fake=None, max_waiting=100, **cfg):
    sched = fakes.make_scheduler(num_blocks=256, block_size=4, **cfg)
    fake = fake or fakes.FakeExecutor(256, 4)
    return Engine(sched, fake, Tokenizer(tokenizer_dir), frozenset({fakes.EOS}), max_waiting, 5.0), fake


async def collect(stream):
    deltas = []
    while True:
        d = await stream.queue.get()
        deltas.append(d)
        if d.finished or d.error:
            return deltas


def test_streams_text_and_frees_blocks(fakes, byte_tokenizer_dir):
    async def main():
        engine, fake = make_engine(fakes, byte_tokenizer_dir)
        engine.start()
        streams = [engine.add_request(list(range(10 + i, 30 + i)), SamplingParams(max_tokens=7)) for i in range(5)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        await engine.stop()
        return engine, results

    engine, results = asyncio.run(main())
    for deltas in results:
        final = deltas[-1]
        assert final.finished and final.finish_reason is FinishReason.LENGTH
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 7 == final.completion_tokens and final.prompt_tokens == 20
        assert "".join(d.text for d in deltas) == engine.tokenizer.decode(tokens)
        assert sum(d.finished for d in deltas) == 1 and deltas[-1].finished
    assert engine.scheduler.pool.num_free_blocks == 256 and not engine.scheduler.requests


def test_stop_string_finishes_and_frees(fakes, byte_tokenizer_dir):
    async def main():
        engine, fake = make_engine(fakes, byte_tokenizer_dir)
        engine.start()
        prompt = list(range(40, 60))
        # Find the text the fake will produce, then stop on a piece of it.
        probe = await collect(engine.add_request(prompt, SamplingParams(max_tokens=12)))
        text = "".join(d.text for d in probe)
        stop = text[5:8]
        deltas = await collect(engine.add_request(prompt, SamplingParams(max_tokens=12, stop=(stop,))))
        await engine.stop()
        return engine, text, stop, deltas

    engine, text, stop, deltas = asyncio.run(main())
    final = deltas[-1]
    assert final.finish_reason is FinishReason.STOP_SEQUENCE and final.matched_stop == stop
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]
    assert engine.scheduler.pool.num_free_blocks == 256


def test_abort_and_queue_limit(fakes, byte_tokenizer_dir):
    async def main():
        engine, fake = make_engine(fakes, byte_tokenizer_dir, max_waiting=2)
        a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
        b = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
        engine.start()
        await asyncio.sleep(0.01)
        assert engine.abort(a.request_id) and not engine.abort(a.request_id)
        deltas = await collect(a)
        other = await collect(b)
        await engine.stop()
        return engine, deltas, other

    engine, deltas, other = asyncio.run(main())
    assert deltas[-1].finish_reason is FinishReason.ABORTED
    assert other[-1].finish_reason is FinishReason.LENGTH and other[-1].completion_tokens == 50
    assert engine.scheduler.pool.num_free_blocks == 256 and not engine.scheduler.requests


def test_executor_failure_ends_every_stream_with_unavailable(fakes, byte_tokenizer_dir):
    class Broken:
        async def step(self, plan, timeout):
            raise ConnectionError("executor gone")

    async def main():
        engine, _ = make_engine(fakes, byte_tokenizer_dir, fake=Broken())
        engine.start()
        streams = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=5)) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 5)
        with pytest.raises(UnavailableError):
            engine.add_request([5], SamplingParams(max_tokens=5))
        await engine.stop()
        return engine, results

    engine, results = asyncio.run(main())
    assert all(isinstance(r[-1].error, UnavailableError) for r in results)
    assert engine.scheduler.pool.num_free_blocks == 256


def test_a_bug_in_the_step_loop_ends_streams_instead_of_hanging(fakes, byte_tokenizer_dir):
    from scheduler_svc.errors import InternalError

    async def main():
        engine, _ = make_engine(fakes, byte_tokenizer_dir)
        engine.scheduler.schedule = lambda: 1 / 0  # stands in for any bug
        engine.start()
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5))
        deltas = await asyncio.wait_for(collect(stream), 5)
        await engine.stop()
        return deltas

    deltas = asyncio.run(main())
    assert isinstance(deltas[-1].error, InternalError)


def test_a_failed_step_fails_only_its_requests(fakes, byte_tokenizer_dir):
    """An out-of-memory step (executor alive) ends the requests in that step; the rest go on."""
    import grpc

    from scheduler_svc.errors import StepFailedError

    class OomOnce(fakes.FakeExecutor):
        def __init__(self):
            super().__init__(256, 4)
            self.failed = False
            self.victim = None

        async def step(self, plan, timeout):
            if not self.failed and any(s.request_id == self.victim for s in plan.seqs):
                self.failed = True
                # The real executor drops nothing it refused; mimic by not executing the plan.
                raise StepFailedError("step failed: out of memory", grpc.StatusCode.RESOURCE_EXHAUSTED)
            return await super().step(plan, timeout)

    async def main():
        fake = OomOnce()
        # The plain loop: this fake fails a step without first ordering the one sent after it,
        # which a real executor does (failures under async scheduling: test_async_scheduling.py).
        engine, _ = make_engine(fakes, byte_tokenizer_dir, fake=fake, max_num_batched_tokens=8, async_scheduling=False)
        first = engine.add_request(list(range(10, 14)), SamplingParams(max_tokens=30))
        engine.start()
        await first.queue.get()  # first is decoding
        second = engine.add_request(list(range(40, 60)), SamplingParams(max_tokens=5))
        fake.victim = second.request_id
        results = await asyncio.wait_for(asyncio.gather(collect(first), collect(second)), 5)
        third = await asyncio.wait_for(collect(engine.add_request([7, 8, 9], SamplingParams(max_tokens=4))), 5)
        await engine.stop()
        return engine, results, third

    engine, (first, second), third = asyncio.run(main())
    # Both requests of the failed step end with the executor's code; nothing hangs or leaks,
    # and the server keeps serving.
    for deltas in (first, second):
        assert deltas[-1].error is not None and deltas[-1].error.code.name == "RESOURCE_EXHAUSTED"
    assert third[-1].finished and third[-1].completion_tokens == 4
    assert not engine.is_dead and engine.scheduler.pool.num_free_blocks == 256


def test_a_refused_plan_is_resent_its_drops_and_fails_its_swap_victims(fakes, byte_tokenizer_dir):
    """The executor applies a plan whole or not at all: one it refuses neither dropped the
    sequences in its finished list nor copied its swap-outs. The engine drops them again in
    the next plan and fails the swapped-out requests with the step's own, so the executor
    never keeps a sequence the scheduler forgot, and no request resumes from KV that was
    never copied. Everything else finishes with exactly the tokens of an undisturbed run."""
    import grpc

    from scheduler_svc.errors import StepFailedError

    class RefusesTwice(fakes.FakeExecutor):
        """Refuses, without applying anything, the first plan that swaps out and the first
        one that drops sequences."""

        def __init__(self):
            super().__init__(24, 4, num_host_blocks=64)
            self.refused = {"swap_out": None, "finished_seq_ids": None}

        async def step(self, plan, timeout):
            for field, step in self.refused.items():
                if step is None and getattr(plan, field):
                    self.refused[field] = plan.step_id
                    raise StepFailedError(f"step {plan.step_id} refused", grpc.StatusCode.INVALID_ARGUMENT)
            return await super().step(plan, timeout)

    prompts = [[(7 * i + j) % 200 for j in range(6 + 3 * i)] for i in range(10)]

    async def run(fake, **cfg):
        sched = fakes.make_scheduler(
            num_blocks=fake.num_blocks, block_size=4, num_host_blocks=fake.num_host_blocks, **cfg
        )
        engine = Engine(sched, fake, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        engine.start()
        streams = [
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts
        ]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        for _ in range(10_000):  # the last drops travel in one more plan: let it run
            if not sched.has_work() and not fake.seqs:
                break
            await asyncio.sleep(0.001)
        await engine.stop()
        return engine, results

    # The plain loop: this fake refuses a plan without first ordering the one sent after it,
    # which a real executor does (refusals under async scheduling: test_async_scheduling.py).
    _, reference = asyncio.run(run(fakes.FakeExecutor(400, 4, num_host_blocks=1)))
    fake = RefusesTwice()
    engine, results = asyncio.run(run(fake, preemption_mode="swap", max_num_batched_tokens=16, async_scheduling=False))
    assert None not in fake.refused.values(), "the workload no longer swaps and drops: tighten it"
    failed = [i for i, r in enumerate(results) if r[-1].error is not None]
    assert failed and all(results[i][-1].error.code.name == "INVALID_ARGUMENT" for i in failed)
    for i, (got, want) in enumerate(zip(results, reference)):
        if i not in failed:
            assert [t for d in got for t in d.token_ids] == [t for d in want for t in d.token_ids]
    assert not engine.is_dead
    assert fake.seqs == {}, "the executor still holds sequences the scheduler forgot"
    assert engine.scheduler.pool.num_free_blocks == 24
    assert engine.scheduler.host_pool.num_free_blocks == 64


def _run_workload(fakes, tokenizer_dir, work, async_output: bool, eos_after: int | None):
    """Runs `work` (prompt, max_tokens, stop strings, abort after k deltas or None) through an
    engine; returns the engine, the fake executor and per request (token ids, text, finish reason)."""
    fake = fakes.FakeExecutor(96, 4, eos_after=eos_after)
    engine, results = fakes.run_workload(
        tokenizer_dir,
        work,
        fake=fake,
        max_num_batched_tokens=64,
        async_output_processing=async_output,
        async_scheduling=False,  # the plain loop, with and without its deferred output
    )
    return engine, fake, [r[:3] for r in results]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # both stateless
)
@given(data=st.data(), n=st.integers(1, 8), eos_after=st.sampled_from([None, 40, 70]))
def test_async_output_processing_changes_no_request_and_leaks_no_block(fakes, byte_tokenizer_dir, data, n, eos_after):
    """Tokens, text and finish reason of every request are the same with the next step sent
    before a step's output is served: stop strings (which then end a request one step late),
    EOS, max_tokens, context-filling prompts; aborted requests received a prefix of the same
    tokens. Every block is free at the end and the fake executor's plan checks hold."""
    base = [
        (
            [(i * 37 + j * 11) % 200 + 20 for j in range(data.draw(st.integers(1, 60), label="prompt_len"))],
            data.draw(st.integers(1, 24), label="max_tokens"),
        )
        for i in range(n)
    ]
    # The fake's output is a function of each request's own history: probe the texts once,
    # then stop on pieces of them.
    _, _, probe = _run_workload(fakes, byte_tokenizer_dir, [(p, m, (), None) for p, m in base], False, eos_after)
    work = fakes.draw_stops_and_aborts(data, base, [text for _, text, _ in probe])
    runs = {}
    for async_output in (False, True):
        engine, _, results = _run_workload(fakes, byte_tokenizer_dir, work, async_output, eos_after)
        assert engine.scheduler.pool.num_free_blocks == 96 and not engine.scheduler.requests
        runs[async_output] = results
    for (_, _, stop, abort), off, on, (full, _, _) in zip(work, runs[False], runs[True], probe):
        if abort is None:
            assert on == off
        else:  # where an abort lands depends on when the stream is read: a prefix, then ended
            for tokens, _, reason in (off, on):
                assert tokens == full[: len(tokens)] and reason is not None
        if not stop:
            assert on[0] == full[: len(on[0])]


def test_async_output_processing_is_on_when_asked(fakes, byte_tokenizer_dir):
    """The flag really defers output: a request ended by a stop string is in one more step
    (the one sent before its output was read), and its tokens are the same."""
    prompt = list(range(40, 60))
    _, _, [(_, text, _)] = _run_workload(fakes, byte_tokenizer_dir, [(prompt, 12, (), None)], False, None)
    work = [(prompt, 12, (text[5:8],), None)]
    rows, outs = {}, {}
    for async_output in (False, True):
        _, fake, [outs[async_output]] = _run_workload(fakes, byte_tokenizer_dir, work, async_output, None)
        rows[async_output] = sum(1 for plan in fake.plans for s in plan.seqs)
    assert outs[True] == outs[False] and outs[True][2] is FinishReason.STOP_SEQUENCE
    assert rows[True] == rows[False] + 1
