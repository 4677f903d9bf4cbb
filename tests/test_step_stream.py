"""The scheduler's step stream to the executor (StepStream): the real ExecutorClient against the
real ExecutorServicer on a loopback gRPC server, with a scripted stand-in for the model.

What must hold whatever happens on the stream: every plan gets its own outcome (never its
neighbour's), a refused plan fails only itself, and a stream that broke (the executor failed,
a step went unanswered, a write was cut off) fails every plan still waiting and is replaced at
the next step. No test here waits on a clock except the step timeout, which is asked of a step
that is held until the test releases it."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve_contracts.auth import SyncBearerTokenInterceptor, bearer_metadata
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from executor_svc.plan_check import PlanError
from executor_svc.server import ExecutorServicer
from scheduler_svc.errors import StepFailedError
from scheduler_svc.executor_client import ExecutorClient, ExecutorGoneError
from scheduler_svc.plan import StepPlan

FAILSAFE_S = 300  # only a hang reaches this


class ScriptedModel:
    """Stands in for the loaded model: answers each step with its id, unless told to refuse it
    (a PlanError), run out of memory in it, fail (the executor breaks) or hold it until released."""

    def __init__(self) -> None:
        self.ran: list[int] = []
        self.refuse: set[int] = set()
        self.oom: set[int] = set()
        self.crash: set[int] = set()
        self.hold: dict[int, threading.Event] = {}
        self.held = threading.Condition()
        self.holding: set[int] = set()
        self.emitted: dict[int, int] = {}  # step id -> steps it streamed
        self.refuse_after: dict[int, int] = {}

    def step(self, request: epb.StepRequest, emit=None) -> epb.StepResponse:
        """A multi-step plan's steps are its step id + 1000 * j; with `emit` (stream_steps) all
        but the last go to it; a step in `refuse_after` fails after that many were emitted."""
        sid = request.step_id
        if emit is not None:
            self.emitted[sid] = 0
            for j in range(request.num_steps - 1):
                if self.refuse_after.get(sid) == j:
                    raise PlanError(f"step {sid}: refused after {j} steps on purpose")
                emit(epb.StepResponse(step_id=sid, sampled=[epb.SampledToken(seq_id=1, token_id=sid + 1000 * j)]))
                self.emitted[sid] += 1
            last = epb.SampledToken(seq_id=1, token_id=sid + 1000 * (request.num_steps - 1))
            return epb.StepResponse(step_id=sid, sampled=[last], num_steps=request.num_steps)
        if sid in self.hold:
            with self.held:
                self.holding.add(sid)
                self.held.notify_all()
            self.hold[sid].wait(FAILSAFE_S)
        self.ran.append(sid)
        if sid in self.refuse:
            raise PlanError(f"step {sid}: refused on purpose")
        if sid in self.oom:
            raise torch.OutOfMemoryError(f"step {sid}: out of memory on purpose")
        if sid in self.crash:
            raise RuntimeError(f"step {sid}: the executor broke")
        return epb.StepResponse(step_id=sid, num_tokens=len(request.seqs))

    def reset(self) -> None:
        self.ran.append(-1)

    def wait_holding(self, sid: int) -> None:
        with self.held:
            assert self.held.wait_for(lambda: sid in self.holding, FAILSAFE_S)


@pytest.fixture
def executor():
    """(address, model): an ExecutorServicer over a ScriptedModel on a loopback port."""
    model = ScriptedModel()
    compute = futures.ThreadPoolExecutor(max_workers=1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    epb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(model, compute), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", model
    for event in model.hold.values():
        event.set()
    server.stop(None)
    compute.shutdown()


def plan(step_id: int, follows: int | None = None, num_steps: int = 1, stream: bool = False) -> StepPlan:
    p = StepPlan(step_id=step_id, num_steps=num_steps, stream_steps=stream)
    p.follows_step_id = follows
    return p


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, FAILSAFE_S))


def test_plans_in_flight_get_their_own_results_in_order(executor):
    address, model = executor

    async def main():
        client = ExecutorClient(address)
        try:
            first = await client.step(plan(0), 60)
            stream = client._steps
            # Async scheduling: the next plan goes out before the one before it is answered.
            a = asyncio.ensure_future(client.step(plan(1), 60))
            b = asyncio.ensure_future(client.step(plan(2, follows=1), 60))
            results = await asyncio.gather(a, b)
            assert client._steps is stream  # one stream for all of them
            return [first.step_id] + [r.step_id for r in results]
        finally:
            await client.close()

    assert run(main()) == [0, 1, 2]
    assert model.ran == [0, 1, 2]


@pytest.mark.parametrize(
    "kind, code", [("refuse", grpc.StatusCode.INVALID_ARGUMENT), ("oom", grpc.StatusCode.RESOURCE_EXHAUSTED)]
)
def test_a_refused_step_fails_alone_and_the_stream_goes_on(executor, kind, code):
    address, model = executor
    getattr(model, kind).add(1)

    async def main():
        client = ExecutorClient(address)
        try:
            await client.step(plan(0), 60)
            stream = client._steps
            refused = asyncio.ensure_future(client.step(plan(1), 60))
            after = asyncio.ensure_future(client.step(plan(2, follows=1), 60))  # planned on top of it
            with pytest.raises(StepFailedError) as info:
                await refused
            assert info.value.code is code and "step 1" in str(info.value)
            assert (await after).step_id == 2
            assert client._steps is stream
        finally:
            await client.close()

    run(main())
    assert model.ran == [0, 1, 2]


def test_an_executor_failure_fails_every_waiting_step_and_the_next_step_opens_a_new_stream(executor):
    address, model = executor
    model.crash.add(1)
    model.hold[1] = threading.Event()

    async def main():
        client = ExecutorClient(address)
        try:
            await client.step(plan(0), 60)
            broken = client._steps
            crashing = asyncio.ensure_future(client.step(plan(1), 60))
            behind = asyncio.ensure_future(client.step(plan(2, follows=1), 60))
            await asyncio.to_thread(model.wait_holding, 1)
            model.hold[1].set()
            errors = await asyncio.gather(crashing, behind, return_exceptions=True)
            # The failure ended the stream: both steps fail with it, neither with a result.
            assert all(isinstance(e, grpc.aio.AioRpcError | ExecutorGoneError) for e in errors), errors
            assert broken.broken is not None
            assert (await client.step(plan(3), 60)).step_id == 3  # a fresh stream
            assert client._steps is not broken
        finally:
            await client.close()

    run(main())
    assert model.ran[:2] == [0, 1] and model.ran[-1] == 3


def test_a_step_without_an_answer_times_out_and_breaks_the_stream(executor):
    address, model = executor
    model.hold[1] = threading.Event()

    async def main():
        client = ExecutorClient(address)
        try:
            await client.step(plan(0), 60)
            broken = client._steps
            with pytest.raises(ExecutorGoneError, match="step 1 had no answer"):
                await client.step(plan(1), 0.5)  # held until released below: it cannot answer in time
            assert broken.broken is not None
            model.hold[1].set()
            assert (await client.step(plan(2), 60)).step_id == 2
            assert client._steps is not broken
        finally:
            await client.close()

    run(main())


def test_a_step_whose_caller_stopped_waiting_keeps_its_place(executor):
    """An engine that stops cancels the step it awaited; its outcome arrives later and is
    dropped, and the plan behind it still gets its own."""
    address, model = executor
    model.hold[1] = threading.Event()

    async def main():
        client = ExecutorClient(address)
        try:
            cancelled = asyncio.ensure_future(client.step(plan(1), 60))
            behind = asyncio.ensure_future(client.step(plan(2, follows=1), 60))
            await asyncio.to_thread(model.wait_holding, 1)
            cancelled.cancel()
            model.hold[1].set()
            assert (await behind).step_id == 2
            assert cancelled.cancelled()
        finally:
            await client.close()

    run(main())
    assert model.ran == [1, 2]


def test_a_reset_closes_the_stream_and_the_next_engine_counts_from_zero(executor):
    address, model = executor

    async def main():
        client = ExecutorClient(address)
        try:
            await client.step(plan(0), 60)
            await client.step(plan(1, follows=0), 60)
            old = client._steps
            await client.reset()
            assert old.broken is not None and client._steps is None
            assert (await client.step(plan(0), 60)).step_id == 0
        finally:
            await client.close()

    run(main())
    assert model.ran == [0, 1, -1, 0]


def test_a_step_following_another_than_the_last_one_queued_is_refused_unrun(executor):
    """On a stream the step a plan follows was written just before it; anything else is a
    scheduler bug, answered FAILED_PRECONDITION without running, and the executor is not trusted
    further by that scheduler (the engine fails)."""
    address, model = executor

    async def main():
        client = ExecutorClient(address)
        try:
            await client.step(plan(5), 60)
            with pytest.raises(ExecutorGoneError, match="FAILED_PRECONDITION"):
                await client.step(plan(7, follows=6), 60)
        finally:
            await client.close()

    run(main())
    assert model.ran == [5]


def test_the_step_stream_needs_the_executor_token():
    model, compute = ScriptedModel(), futures.ThreadPoolExecutor(max_workers=1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[SyncBearerTokenInterceptor("s3cret")])
    epb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(model, compute), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    async def main():
        for token in (None, "wrong"):
            # The stream itself, opened and nothing written: refused before a plan is read.
            async with grpc.aio.insecure_channel(address) as channel:
                call = epb_grpc.ExecutorStub(channel).StepStream(metadata=bearer_metadata(token))
                assert await call.code() is grpc.StatusCode.UNAUTHENTICATED
            # Through the client, whose first plan's write races the refusal: grpc.aio reports a
            # write that lost the race as INTERNAL ("Internal error from Core"; seen once in CI),
            # one that did not as the server's status. Either way the step fails and nothing ran
            # (model.ran below). The engine's handshake, a unary call, meets the refusal first.
            client = ExecutorClient(address, token)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.step(plan(0), 60)
                assert info.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
            finally:
                await client.close()
        client = ExecutorClient(address, "s3cret")
        try:
            assert (await client.step(plan(0), 60)).step_id == 0
        finally:
            await client.close()

    try:
        run(main())
    finally:
        server.stop(None)
        compute.shutdown()
    assert model.ran == [0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["ok", "refuse", "oom", "cancel"]), min_size=1, max_size=12), st.booleans())
def test_every_plan_gets_its_own_outcome_whatever_happens_around_it(executor, script, pipelined):
    """Random runs of plans, some refused, some out of memory, some whose caller stops waiting,
    sent one at a time or two in flight: every plan still awaited gets exactly its own outcome
    (a result with its step id, or StepFailedError naming it), and the stream never breaks:
    a caller that stops waiting, even mid-write, leaves its plan's place in the order."""
    address, model = executor
    base = len(model.ran) * 100 + 1000  # fresh step ids for each example
    ids = [base + i for i in range(len(script))]
    model.refuse |= {i for i, what in zip(ids, script, strict=True) if what == "refuse"}
    model.oom |= {i for i, what in zip(ids, script, strict=True) if what == "oom"}

    async def main():
        client = ExecutorClient(address)
        outcomes: dict[int, str] = {}
        try:
            tasks = []
            for sid, what in zip(ids, script, strict=True):
                task = asyncio.ensure_future(client.step(plan(sid), 60))
                if what == "cancel":
                    await asyncio.sleep(0)  # its write starts; then its caller stops waiting
                    task.cancel()
                tasks.append((sid, what, task))
                if not pipelined or len(tasks) % 2 == 0:
                    await asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True)
            await asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True)
            for sid, what, task in tasks:
                if what == "cancel" and task.cancelled():
                    continue
                try:
                    outcomes[sid] = f"ok {task.result().step_id}"
                except StepFailedError as exc:
                    outcomes[sid] = f"failed {exc.code.name} {'step ' + str(sid) in str(exc)}"
            assert client._steps is not None and client._steps.broken is None
            return outcomes
        finally:
            await client.close()

    outcomes = run(main())
    expected = {
        "ok": "ok {}",
        "cancel": "ok {}",
        "refuse": "failed INVALID_ARGUMENT True",
        "oom": "failed RESOURCE_EXHAUSTED True",
    }
    for sid, what in zip(ids, script, strict=True):
        if sid in outcomes:
            assert outcomes[sid] == expected[what].format(sid), (script, outcomes)


def test_cut_steps_reaches_the_runner_only_with_the_executor_token():
    """CutSteps (multi-step plans): the client's call, sent without waiting, sets the plan to
    end early on the runner the compute thread reads; one without the token is refused and
    changes nothing (the client only logs it: a failed cut leaves the plan whole)."""
    import types

    model, compute = ScriptedModel(), futures.ThreadPoolExecutor(max_workers=1)
    model.runner = types.SimpleNamespace(cut_step_id=None)
    model.runner.cut_steps = lambda step_id: setattr(model.runner, "cut_step_id", step_id)  # ModelRunner's
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[SyncBearerTokenInterceptor("s3cret")])
    epb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(model, compute), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    async def cut(token: str, step_id: int) -> None:
        client = ExecutorClient(address, token)
        try:
            client.cut_steps(step_id)
            await asyncio.gather(*list(client._cuts))
        finally:
            await client.close()

    try:
        run(cut("wrong", 5))
        assert model.runner.cut_step_id is None
        run(cut("s3cret", 7))
        assert model.runner.cut_step_id == 7
    finally:
        server.stop(None)
        compute.shutdown()


def test_a_streamed_plan_answers_each_step_in_order_and_the_plans_behind_it_their_own(executor):
    """StepRequest.stream_steps: the steps before the last reach on_step as they come, in
    order and before the plan's own answer (its last step, num_steps all of them); a plan sent
    on top of it gets its own answer after."""
    address, model = executor

    async def main():
        client = ExecutorClient(address)
        seen = []
        try:
            streamed = asyncio.ensure_future(
                client.step(plan(1, num_steps=4, stream=True), 60, lambda r: seen.append((r.step_id, r.sampled)))
            )
            behind = asyncio.ensure_future(client.step(plan(2, follows=1), 60))
            last = await streamed
            assert [(sid, [s.token_id for s in sampled]) for sid, sampled in seen] == [
                (1, [1]),
                (1, [1001]),
                (1, [2001]),
            ]
            assert [s.token_id for s in last.sampled] == [3001] and last.num_steps == 4
            assert (await behind).step_id == 2
        finally:
            await client.close()

    run(main())
    assert model.emitted == {1: 3}


def test_a_plan_without_stream_steps_and_a_unary_step_get_one_answer(executor):
    address, model = executor

    async def main():
        client = ExecutorClient(address)
        try:
            whole = await client.step(plan(1, num_steps=4), 60)
            assert whole.step_id == 1 and model.emitted == {}
        finally:
            await client.close()
        async with grpc.aio.insecure_channel(address) as channel:
            unary = await epb_grpc.ExecutorStub(channel).Step(
                epb.StepRequest(step_id=2, num_steps=4, stream_steps=True)
            )
        assert unary.step_id == 2 and not unary.more_steps and model.emitted == {}

    run(main())


def test_a_streamed_plan_refused_midway_fails_after_the_steps_it_answered_and_the_stream_goes_on(executor):
    address, model = executor
    model.refuse_after[1] = 2

    async def main():
        client = ExecutorClient(address)
        seen = []
        try:
            with pytest.raises(StepFailedError, match="refused after 2 steps"):
                await client.step(plan(1, num_steps=4, stream=True), 60, seen.append)
            assert [r.sampled[0].token_id for r in seen] == [1, 1001]
            stream = client._steps
            assert (await client.step(plan(2), 60)).step_id == 2 and client._steps is stream
        finally:
            await client.close()

    run(main())
