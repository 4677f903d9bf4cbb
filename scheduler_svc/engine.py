"""The step loop: schedule, send the plan to the executor, apply the result, stream tokens.

One asyncio task runs the loop; it sleeps on an event when there is no work and on the
executor's reply otherwise, so the scheduler never busy-polls a core the executor needs.
With async scheduling it plans and sends step N+1 before awaiting step N's result
(`_loop_async`; by default on a CPU only for small steps, config.overlap_limit): the executor
then has its next plan when it finishes a step.
Requests talk to the loop through `add_request` / `abort` and read their tokens from a
per-request `RequestStream` (output.py turns sampled tokens into its deltas). Everything runs
on one event loop, so the scheduler's state is only touched between awaits and needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid

from scheduler_svc.config import overlap_limit
from scheduler_svc.errors import InternalError, QueueFullError, ServingError, StepFailedError, UnavailableError
from scheduler_svc.grammar import CompileTasks, GrammarCompiler, check_constrained
from scheduler_svc.observer import Observer, StepRecord
from scheduler_svc.output import LiveRequest, RequestStream, StreamDelta
from scheduler_svc.plan import StepPlan, StepResult
from scheduler_svc.request import FinishReason, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, TokenOutput
from scheduler_svc.sent_step import SentStep, StepRunner
from scheduler_svc.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    """Owns the scheduler and drives the executor one step at a time, telling its observers."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepRunner,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        max_waiting: int,
        step_timeout_s: float,
        observers: tuple[Observer, ...] = (),
        grammars: GrammarCompiler | None = None,
        device: str = "cpu",
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_waiting = max_waiting
        self.step_timeout_s = step_timeout_s
        self._live: dict[str, LiveRequest] = {}
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._dead: str | None = None
        self.dead = asyncio.Event()  # set once the executor failed; this engine is then done
        self._task: asyncio.Task[None] | None = None
        self.observers = observers
        self.overlap_max_seqs = overlap_limit(scheduler.config, device)
        self._cuttable: SentStep | None = None  # a multi-step plan in flight, not cut yet (multi_step.py)
        self._awaiting: SentStep | None = None  # the step whose result the loop awaits (`_result`)
        # Structured output: constraints compile off the loop while prefill runs (grammar.py).
        self.grammars = CompileTasks(grammars, lambda _: self._wake.set(), self._compile_failed)

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        tenant: str = "",
    ) -> RequestStream:
        """Queues a validated request; its tokens arrive on the returned stream."""
        if self._dead is not None:
            raise UnavailableError(f"not serving: {self._dead}")
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests waiting; retry later")
        check_constrained(sampling)
        request = Request(
            request_id=uuid.uuid4().hex,
            seq_id=next(self._seq_ids),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            priority=priority,
            tenant=tenant,
        )
        live = LiveRequest.start(request, self.tokenizer)
        self.grammars.start(request)  # before anything is queued: it may refuse
        self._live[request.request_id] = live
        self.scheduler.add_request(request)
        self._wake.set()
        self._cut()  # a multi-step plan's remaining steps would hold this request back
        return live.stream

    def abort(self, request_id: str) -> bool:
        """Aborts a request; False when it is unknown or already finished (not an error)."""
        if (live := self._live.get(request_id)) is None:
            return False
        self._end(live, live.final(FinishReason.ABORTED, ""), time.monotonic())
        self._cut()  # a multi-step plan would go on computing its tokens for nothing
        state = self.scheduler.snapshot()
        for observer in self.observers:
            observer.on_state(state)
        self._wake.set()
        return True

    def _cut(self) -> None:
        """Ends the multi-step plan in flight after the step under way (multi_step.py), once."""
        if self._cuttable is not None:
            self.executor.cut_steps(self._cuttable.plan.step_id)
            self._cuttable = None

    # ---- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="chunkserve-step-loop")

    async def stop(self) -> None:
        self.grammars.cancel_all()  # no compile outlives the loop
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    async def _run(self) -> None:
        try:
            if self.overlap_max_seqs == 0:
                await self._loop()
            else:
                await self._loop_async()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: never leave streams waiting on a dead loop
            log.exception("the step loop failed")
            self._fail_all("internal error in the step loop (see the server log)", InternalError)

    async def _loop(self) -> None:
        # With --async-output-processing a step's streams and observers are served after the
        # next step is sent, while the executor computes it (vLLM's async output processing):
        # `done` holds them meanwhile and is delivered before any wait, failure or cancellation.
        done: SentStep | None = None
        while not self.is_dead:  # until the executor is gone (a failure path below)
            cycle_start = time.perf_counter_ns()
            sent = self._plan_and_send(None)
            if sent is None:
                done = self._deliver(done)
                self._wake.clear()
                await self._wake.wait()
                continue
            if done is not None:
                try:
                    # Two turns of the loop: one runs the step's coroutine up to creating the
                    # gRPC call, the next the call's own task, which hands the request to gRPC's
                    # core (it goes out on gRPC's threads from there); then the last step's output.
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                    done = self._deliver(done)
                except asyncio.CancelledError:  # stopped: the last step's streams still get it
                    sent.future.cancel()
                    self._deliver(done)
                    raise
                except BaseException:  # a bug in the output path: _run reports it
                    sent.future.cancel()
                    raise
            if (result := await self._result(sent)) is None:
                continue
            done = self._apply(sent, result)
            if not self.scheduler.config.async_output_processing:
                done = self._deliver(done)
            if self.scheduler.config.target_itl_ms is not None:
                # The auto budget learns what a stream waits per step: this whole iteration (a
                # multi-step plan's over the steps it ran).
                seconds = (time.perf_counter_ns() - cycle_start) / 1e9 / result.num_steps
                self.scheduler.budget.observe(sent.plan, sent.stats, seconds)

    async def _loop_async(self) -> None:
        """The loop under async scheduling: plan and send step N+1, then await step N's result,
        apply it and serve it while N+1 runs. At most two steps are at the executor; N+1's
        follows_step_id makes the executor run it after N. The scheduler committed N when it
        planned it (scheduler.py), so N+1 can hold a decode of the token N samples."""
        inflight: SentStep | None = None
        done: SentStep | None = None
        last_applied, limit = time.perf_counter_ns(), self.overlap_max_seqs
        try:
            while not self.is_dead:  # until the executor is gone (a failure path below)
                # Not on top of a step too big to overlap, nor of a multi-step plan before its last
                # step is under way (SentStep.may_follow: a streamed one's steps are served till then).
                ahead = inflight is None or inflight.may_follow(limit)
                if not ahead and inflight.plan.stream_steps and not inflight.last_step.is_set():
                    await self._until_last_step(inflight)
                    continue
                sent = self._plan_and_send(inflight) if ahead else None
                if inflight is None:
                    if sent is None:
                        self._wake.clear()
                        await self._wake.wait()
                        last_applied = time.perf_counter_ns()  # no stream waited while idle
                    inflight = sent
                    continue
                done, inflight = inflight, sent
                if sent is not None:
                    # Two turns of the loop (as in `_loop`), then the finished step is served.
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                if (result := await self._result(done)) is None:
                    if inflight is not None and not self.is_dead:  # planned on top of the failed step
                        later, inflight = inflight, None
                        await self._restart_step(later)  # its requests start over
                    continue
                now = time.perf_counter_ns()
                self._deliver(self._apply(done, result))
                if self.scheduler.config.target_itl_ms is not None:
                    # What a stream waits per step: from the previous result (or wake-up) to this one.
                    seconds = (now - last_applied) / 1e9 / result.num_steps
                    self.scheduler.budget.observe(done.plan, done.stats, seconds)
                last_applied = now
        finally:  # stopped or failed: no step result is awaited any more
            for pending in (done, inflight):
                if pending is not None:
                    pending.future.cancel()

    async def _result(self, step: SentStep, refused_ok: bool = False) -> StepResult | None:
        """A step's result, or None when it failed: the one failure path of both loops. A step
        the executor refused (or ran out of memory in) and survived fails its requests, unless
        `refused_ok` (a step planned on top of a failed one: `_restart_step` starts them over);
        an executor that failed or vanished fails every request and this engine (`is_dead`).
        The steps a streamed plan answers before its last are applied and served as they come
        while it is awaited (`_streamed`); those that came earlier, first (not when refused_ok:
        its requests start over)."""
        if not refused_ok:
            self._awaiting = step
            self._apply_streamed(step)
        try:
            return await step.future
        except asyncio.CancelledError:
            step.future.cancel()
            raise
        except StepFailedError as exc:  # the executor is fine; this step's requests are not
            if not refused_ok:
                log.error("%s; failing its %d requests", exc, len(step.plan.seqs))
                self._fail_step(step.plan, exc)
        except Exception as exc:  # the executor failed or vanished
            log.exception("step %d failed", step.plan.step_id)
            self._fail_all(f"executor unavailable: step failed: {type(exc).__name__}: {exc}")
        finally:
            self._awaiting = None
        return None

    async def _until_last_step(self, step: SentStep) -> None:
        """Serves a streamed multi-step plan's steps as they come until its last one is under way
        or it ended (a cut, a failure); the loop awaits it from now on, up to `_result`'s end."""
        self._awaiting = step
        self._apply_streamed(step)
        await step.last_step.wait()

    def _streamed(self, step: SentStep, result: StepResult) -> None:
        """A step of a plan sent with stream_steps, not its last (on the step stream's reader task):
        served now if the loop awaits that plan, else once it does (`_result`; a step before it comes first)."""
        step.on_answer(result)  # the loop, woken by it, runs after this: the tokens are applied first
        if self._awaiting is step:
            self._apply_streamed(step)

    def _apply_streamed(self, step: SentStep) -> None:
        """Gives the plan's streamed steps' tokens to their requests and streams them. The multi-step
        plan in flight is cut once its requests all ended (EOS, a stop string; in its own steps, or
        in the plan it was sent on top of, before the loop awaits it): its later steps would be for nothing."""
        for result in step.streamed:
            self._emit(self.scheduler.apply_tokens(result))
        step.streamed.clear()
        if (cuttable := self._cuttable) is not None and not any(e.request_id in self._live for e in cuttable.plan.seqs):
            self._cut()

    def _apply(self, step: SentStep, result: StepResult) -> SentStep:
        """Applies a step's result to the scheduler; its outputs and record are not served yet."""
        step.outputs = self.scheduler.update(step.plan, result)
        self._cuttable = None if self._cuttable is step else self._cuttable
        step_ns, state = time.perf_counter_ns() - step.started, self.scheduler.snapshot()
        step.record = StepRecord(step.plan, step.stats, result, step.planned_at, step_ns, state)
        return step

    def _plan_and_send(self, inflight: SentStep | None) -> SentStep | None:
        """Plans the next step and sends it (after `inflight`); None when there is nothing to send."""
        if not self.scheduler.has_work():
            return None
        plan, stats = self.scheduler.schedule(), self.scheduler.step_stats
        if plan.is_empty:  # nothing fits now (it will once something ends), or all wait for a token in flight
            return None
        plan.follows_step_id = None if inflight is None else inflight.plan.step_id
        plan.stream_steps = plan.num_steps > 1 and self.scheduler.config.multi_step_stream_outputs
        step = SentStep(plan, stats, time.time(), time.perf_counter_ns())
        self._cuttable = step if plan.num_steps > 1 else None
        streamed = [lambda result: self._streamed(step, result)] if plan.stream_steps else []  # StepRunner
        step.future = asyncio.ensure_future(self.executor.step(plan, self.step_timeout_s, *streamed))
        step.future.add_done_callback(lambda _: step.last_step.set())
        return step

    async def _restart_step(self, step: SentStep) -> None:
        """Waits out a step planned on top of one that failed and starts its live requests over
        (Scheduler.restart: new sequence ids, their old results ignored), its swap victims
        too: whether the executor refused it (its sequences were unknown or behind there) or
        ran it on state the failure left, nothing it computed is used. Nothing to restart
        when the executor is gone (every request failed)."""
        await self._result(step, refused_ok=True)
        if self.is_dead:
            return
        requests = self.scheduler.failed_plan(step.plan)  # refused or not
        for request in requests:
            self.scheduler.restart(request, next(self._seq_ids))
        log.warning("step %d followed a failed step: %d of its requests start over", step.plan.step_id, len(requests))

    def _deliver(self, done: SentStep | None) -> None:
        """Streams a step's tokens and tells the observers; returns None (the new `done`). Deferred
        under async output processing, a stop string ends its request a step late: the step sent
        computes a token `update` drops, and its blocks are freed while that step runs (the
        executor runs steps in order, and the next plan is made after it)."""
        if done is not None:
            self._emit(done.outputs)
            for observer in self.observers:
                observer.on_step(done.record)
        return None

    def _fail_step(self, plan: StepPlan, error: ServingError) -> None:
        """Fails the requests of a step the executor refused (or ran out of memory in) and
        survived (a refused plan changed nothing there): its requests, and those it swapped out
        (Scheduler.failed_plan)."""
        now = time.monotonic()
        for request in self.scheduler.failed_plan(plan):
            if (live := self._live.get(request.request_id)) is not None:
                self._end(live, StreamDelta(error=error), now)

    def _compile_failed(self, request: Request, error: ServingError) -> None:
        """A constraint that does not compile ends its request with the error (INVALID_ARGUMENT)."""
        if (live := self._live.get(request.request_id)) is not None:
            self._end(live, StreamDelta(error=error), time.monotonic())
            self._wake.set()

    def fail(self, reason: str) -> None:
        """Declares the executor gone: every open stream ends with UNAVAILABLE, new requests
        are refused, and the loop stops (the app builds a fresh engine on reconnect)."""
        self._fail_all(reason)
        if self._task is not None:
            self._task.cancel()

    def _fail_all(self, reason: str, error: type[ServingError] = UnavailableError) -> None:
        self._dead = reason
        self.dead.set()
        now = time.monotonic()
        for live in list(self._live.values()):
            self._end(live, StreamDelta(error=error(reason)), now)

    # ---- output ------------------------------------------------------------------------

    def _emit(self, outputs: list[TokenOutput]) -> None:
        """Streams each sampled token's delta (output.py), timing tokens for the observers."""
        now = time.monotonic()
        for out in outputs:
            if (live := self._live.get(out.request.request_id)) is None:
                continue
            request = out.request
            if request.first_token_time is None:
                request.first_token_time = now
            for observer in self.observers:
                observer.on_token(request, now)
            request.last_token_time = now
            delta = live.token_delta(out, self.tokenizer)
            if delta.finished:
                self._end(live, delta, now)
            else:
                live.stream.put(delta)

    def _end(self, live: LiveRequest, final: StreamDelta, now: float) -> None:
        """Ends a live request with its final delta (or error): the scheduler finishes it if it
        has not (a stop string, an abort, a failure: its blocks are freed and its executor state
        dropped), the observers are told, and the stream gets the delta."""
        reason = final.finish_reason or FinishReason.ABORTED
        del self._live[live.request.request_id]
        self.grammars.cancel(live.request.request_id)
        self.scheduler.finish(live.request, reason)
        for observer in self.observers:
            observer.on_finish(live.request, reason, now)
        live.stream.put(final)
