"""The executor runs a step after the one it follows (async scheduling's follows_step_id),
whatever order the gRPC threads deliver them in."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.server import ExecutorServicer


class _Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.active = True
        self.callbacks = []

    def time_remaining(self) -> float | None:
        return self.remaining

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, fn) -> bool:
        self.callbacks.append(fn)
        return True

    def cancel(self) -> None:
        self.active = False
        for fn in self.callbacks:
            fn()

    def abort(self, code, details):
        raise grpc.RpcError(code, details)


class _Loaded:
    def __init__(self) -> None:
        self.ran: list[int] = []

    def step(self, request, emit=None):
        self.ran.append(request.step_id)
        return epb.StepResponse(step_id=request.step_id)

    def reset(self) -> None:
        self.ran.append(-1)


@pytest.fixture
def servicer():
    compute = futures.ThreadPoolExecutor(max_workers=1)
    loaded = _Loaded()
    yield ExecutorServicer(loaded, compute), loaded
    compute.shutdown()


def test_the_executor_runs_a_step_after_the_one_it_follows(servicer):
    """Step 8, following 7, arrives first (another gRPC thread): it is queued only once 7 is."""
    svc, loaded = servicer
    svc.Step(epb.StepRequest(step_id=6), _Context(None))
    later = threading.Thread(target=svc.Step, args=(epb.StepRequest(step_id=8, follows_step_id=7), _Context(30.0)))
    later.start()
    while not svc._order._waiters:  # step 8 waits for step 7 (no timing: the wait itself is observed)
        threading.Event().wait(0.001)
    assert loaded.ran == [6]
    svc.Step(epb.StepRequest(step_id=7, follows_step_id=6), _Context(30.0))
    later.join(60)  # only a hang reaches this
    assert loaded.ran == [6, 7, 8]


def test_a_step_following_a_step_that_never_came_fails_precondition(servicer):
    """After a Reset no step is followed (a new scheduler counts from 0 again): a plan that
    follows an earlier step id, or one that never arrived, is refused when its deadline ends."""
    svc, loaded = servicer
    svc.Step(epb.StepRequest(step_id=3), _Context(None))
    svc.Reset(epb.ResetRequest(), _Context(None))
    with pytest.raises(grpc.RpcError) as info:
        svc.Step(epb.StepRequest(step_id=4, follows_step_id=3), _Context(0.01))
    assert info.value.args[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert loaded.ran == [3, -1]


def test_a_cancelled_follower_stops_waiting(servicer):
    """A scheduler that went away (its calls cancelled) leaves no handler thread waiting for
    a step that will never come: the waiting call ends when it is cancelled, queuing nothing."""
    svc, loaded = servicer
    context = _Context(300.0)
    errors = []

    def follower():
        try:
            svc.Step(epb.StepRequest(step_id=2, follows_step_id=1), context)
        except grpc.RpcError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=follower)
    waiting.start()
    while not svc._order._waiters:
        threading.Event().wait(0.001)
    context.cancel()
    waiting.join(60)  # only a hang reaches this
    assert not waiting.is_alive() and errors and loaded.ran == []


def test_a_stream_answers_in_order_and_ends_when_cancelled(servicer):
    """StepStream: each step queued as it arrives and answered in order; a scheduler that goes
    away (the call cancelled while no step is pending) ends the answering thread at once."""
    import queue

    svc, loaded = servicer
    arrivals: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        while (request := arrivals.get()) is not None:
            yield request

    context = _Context(None)
    answers = svc.StepStream(requests(), context)
    arrivals.put(epb.StepRequest(step_id=0))
    arrivals.put(epb.StepRequest(step_id=1, follows_step_id=0))
    assert [next(answers).result.step_id for _ in range(2)] == [0, 1]
    arrivals.put(epb.StepRequest(step_id=3, follows_step_id=2))  # not the step before it
    refused = next(answers)
    assert refused.error.step_id == 3 and refused.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    context.cancel()  # the request iterator still blocks: only the cancellation can end this
    assert list(answers) == []
    assert loaded.ran == [0, 1]
    arrivals.put(None)  # let the reader thread go too
