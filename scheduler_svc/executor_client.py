"""The scheduler's side of chunkserve.executor.v1: plan objects in, result objects out."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import grpc

from chunkserve_contracts import __version__
from chunkserve_contracts.auth import bearer_metadata
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from scheduler_svc.errors import StepFailedError
from scheduler_svc.plan import PromptLogprob, Sampled, StepPlan, StepResult
from scheduler_svc.request import SamplingParams

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)  # the executor lives on
_CODES = {code.value[0]: code for code in grpc.StatusCode}
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # The handshake waits for an executor that is still loading (wait_for_ready): gRPC's
    # default reconnect backoff grows 1.6x per attempt to 120 s, so an executor ready after
    # 30 s was found up to ~13 s late (attempts at 26 s, then 43 s). Loopback or LAN
    # connection attempts are cheap; one a second at most finds it within a second.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def sampling_to_proto(params: SamplingParams) -> epb.SamplingParams:
    return epb.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
        num_prompt_logprobs=0 if params.prompt_logprobs is None else params.prompt_logprobs + 1,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=[epb.BadWord(token_ids=ids) for ids in params.bad_words],
    )


def plan_to_proto(plan: StepPlan) -> epb.StepRequest:
    return epb.StepRequest(
        step_id=plan.step_id,
        new_seqs=[
            epb.NewSequence(
                seq_id=n.seq_id,
                sampling=sampling_to_proto(n.sampling),
                prompt_token_ids=n.prompt_token_ids,
                output_token_ids=n.output_token_ids,
            )
            for n in plan.new_seqs
        ],
        seqs=[
            epb.ScheduledSequence(
                seq_id=s.seq_id,
                num_computed_tokens=s.num_computed_tokens,
                num_new_tokens=s.num_new_tokens,
                token_ids=s.token_ids,
                block_ids=s.new_block_ids,
                replace_block_table=s.replace_block_table,
                sample=s.sample,
                token_masks=[epb.TokenMask(position=m.position, bits=m.bits) for m in s.token_masks],
                draft_token_ids=s.draft_token_ids,
                prompt_logprob_first=s.prompt_logprob_first,
                prompt_logprob_rows=s.prompt_logprob_rows,
                next_token_id=s.next_token_id,
            )
            for s in plan.seqs
        ],
        finished_seq_ids=plan.finished_seq_ids,
        swap_out=[epb.BlockCopy(src=d, dst=h) for d, h in plan.swap_out],
        swap_in=[epb.BlockCopy(src=h, dst=d) for h, d in plan.swap_in],
        follows_step_id=plan.follows_step_id,
        num_steps=plan.num_steps,
        stream_steps=plan.stream_steps,
    )


def result_from_proto(msg: epb.StepResponse) -> StepResult:
    """A step's result, its times per step run (StepResult)."""
    num_steps = max(1, msg.num_steps)
    return StepResult(
        step_id=msg.step_id,
        sampled=[
            Sampled(s.seq_id, s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top]) for s in msg.sampled
        ],
        prompt_logprobs=[
            PromptLogprob(p.seq_id, p.position, p.token_id, p.logprob, [(t.token_id, t.logprob) for t in p.top], p.rank)
            for p in msg.prompt_logprobs
        ],
        execute_ns=msg.execute_ns // num_steps,
        forward_ns=msg.forward_ns // num_steps,
        sample_ns=msg.sample_ns // num_steps,
        swap_ns=msg.swap_ns // num_steps,
        start_unix_ns=msg.start_unix_ns,
        num_threads=msg.num_threads,
        num_steps=num_steps,
    )


class ExecutorGoneError(RuntimeError):
    """The step stream ended, broke or went unanswered: the executor is gone or unusable."""


class StepStream:
    """One StepStream call: plans written in order, each outcome matched to its plan in order.

    Why a stream: a unary call per step pays a call's setup both ways (~0.3 ms of a round trip
    of ~0.7 ms on loopback), at every step. With async scheduling two plans are in flight; the
    executor answers them in the order written. A plan whose caller stopped waiting (its task
    was cancelled) keeps its place in the order, and its outcome is dropped. Anything that
    breaks the order (a write that did not finish, a timeout, the stream's end) breaks the
    stream: every plan still waiting fails, and the client opens a new stream for the next."""

    def __init__(self, stub: epb_grpc.ExecutorStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._call = stub.StepStream(metadata=metadata)
        # (step id, its outcome, what takes its earlier steps' answers where it streams them)
        self._waiting: deque[tuple[int, asyncio.Future[epb.StepOutcome], Callable[[epb.StepResponse], None] | None]]
        self._waiting = deque()
        self._write = asyncio.Lock()  # FIFO: plans go out in the order they were queued
        self.broken: BaseException | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="executor-step-stream")

    async def step(
        self, request: epb.StepRequest, timeout: float, on_step: Callable[[epb.StepResponse], None] | None = None
    ) -> epb.StepOutcome:
        """Writes one plan and waits (up to timeout) for its outcome; `on_step` gets the answers
        of a streamed plan's steps before its last (StepRequest.stream_steps) as they arrive."""
        if self.broken is not None:
            raise ExecutorGoneError(f"step stream broken: {self.broken}")
        future: asyncio.Future[epb.StepOutcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((request.step_id, future, on_step))
        # Shielded: a caller that stops waiting mid-write (an engine stopping) must not cut the
        # write off, or whether the plan went out, and so the order of outcomes, is unknown.
        await asyncio.shield(asyncio.ensure_future(self._send(request)))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            error = ExecutorGoneError(f"step {request.step_id} had no answer from the executor within {timeout:g} s")
            self.close(error)
            raise error from None

    async def _send(self, request: epb.StepRequest) -> None:
        try:
            async with self._write:
                await self._call.write(request)
        except Exception:  # noqa: BLE001 - the call ended (the reader fails this plan with its status) or broke
            if not self._call.done():
                self.close(ExecutorGoneError("a plan could not be written to the step stream"))

    async def _read(self) -> None:
        try:
            while (outcome := await self._call.read()) is not grpc.aio.EOF:
                step_id, future, on_step = self._waiting[0] if self._waiting else (None, None, None)
                got = outcome.result.step_id if outcome.HasField("result") else outcome.error.step_id
                if got != step_id:
                    raise ExecutorGoneError(f"the executor answered step {got} where step {step_id} was next")
                if outcome.result.more_steps:  # one step of a streamed plan; its answer follows
                    if on_step is None:
                        raise ExecutorGoneError(f"the executor streamed the steps of plan {got}, not asked to")
                    if not future.done():
                        on_step(outcome.result)
                    continue
                self._waiting.popleft()
                if not future.done():  # its caller may have stopped waiting
                    future.set_result(outcome)
            raise ExecutorGoneError("the executor ended the step stream")
        except asyncio.CancelledError:
            self.close(ExecutorGoneError("step stream closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - the executor failed or went away: so does every waiting step
            self.close(exc)

    def close(self, reason: BaseException) -> None:
        """Breaks the stream: cancels the call and fails every plan still waiting with `reason`."""
        if self.broken is None:
            self.broken = reason
            self._call.cancel()
        while self._waiting:
            _, future, _ = self._waiting.popleft()
            if not future.done():
                future.set_exception(reason)
                future.exception()  # marks it seen: a caller that stopped waiting never reads it
        if self._reader is not asyncio.current_task():
            self._reader.cancel()


class ExecutorClient:
    """An async client for the executor; create it inside the running event loop. With a
    token, every call carries `authorization: Bearer <token>` (the executor's check). Steps go
    over one StepStream, opened at the first step and again after one broke."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = epb_grpc.ExecutorStub(self._channel)
        self._metadata = bearer_metadata(token)
        self._steps: StepStream | None = None
        self._cuts: set[asyncio.Task[None]] = set()  # CutSteps calls under way (held: a task needs a reference)

    async def handshake(self, timeout: float) -> epb.HandshakeResponse:
        """Waits (up to timeout) for the executor to come up, then asks its capabilities."""
        return await self._stub.Handshake(
            epb.HandshakeRequest(scheduler_version=__version__),
            timeout=timeout,
            wait_for_ready=True,
            metadata=self._metadata,
        )

    async def step(
        self, plan: StepPlan, timeout: float, on_step: Callable[[StepResult], None] | None = None
    ) -> StepResult:
        """Runs one step. A step the executor refused while staying alive (out of memory, a
        rejected plan) raises StepFailedError; anything else means the executor is gone. A plan
        with stream_steps hands its steps before the last to `on_step` as they come, on the
        stream's reader task; the result is then the last step's."""
        if self._steps is None or self._steps.broken is not None:
            self._steps = StepStream(self._stub, self._metadata)
        each = None if on_step is None else (lambda msg: on_step(result_from_proto(msg)))
        outcome = await self._steps.step(plan_to_proto(plan), timeout, each)
        if outcome.HasField("result"):
            return result_from_proto(outcome.result)
        code = _CODES.get(outcome.error.code, grpc.StatusCode.UNKNOWN)
        if code in REFUSALS:
            raise StepFailedError(f"step {plan.step_id} failed: {outcome.error.message}", code)
        raise ExecutorGoneError(f"step {plan.step_id} failed ({code.name}): {outcome.error.message}")

    def _end_steps(self) -> None:
        if self._steps is not None:
            self._steps.close(ExecutorGoneError("the client closed the step stream"))
            self._steps = None

    def cut_steps(self, step_id: int) -> None:
        """Asks the executor to end multi-step plan `step_id` after the step under way (CutSteps),
        without waiting: the plan's answer says how many steps it ran. A call that fails only
        leaves the plan whole, so it is logged and dropped."""

        async def call() -> None:
            try:
                await self._stub.CutSteps(epb.CutStepsRequest(step_id=step_id), timeout=5.0, metadata=self._metadata)
            except Exception as exc:  # noqa: BLE001 - refused, executor gone, channel closed: the plan runs whole
                log.debug("CutSteps(%d) failed: %r", step_id, exc)

        task = asyncio.get_running_loop().create_task(call())
        self._cuts.add(task)
        task.add_done_callback(self._cuts.discard)

    async def reset(self, timeout: float = 10.0) -> None:
        """Drops every sequence on the executor; a new engine's steps start on a new stream."""
        self._end_steps()
        await self._stub.Reset(epb.ResetRequest(), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        self._end_steps()
        await self._channel.close()
