"""A step the engine sent to the executor (engine.py), and what it needs of the executor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.observer import StepRecord
from scheduler_svc.plan import StepPlan, StepResult, StepStats, TokenOutput


class StepRunner(Protocol):
    """What the loop needs from the executor (the gRPC client, or a fake in tests). `step`
    gets `on_step` only for a plan with stream_steps (ExecutorClient.step)."""

    async def step(
        self, plan: StepPlan, timeout: float, on_step: Callable[[StepResult], None] | None = None
    ) -> StepResult: ...
    def cut_steps(self, step_id: int) -> None: ...


@dataclass(slots=True)
class SentStep:
    """A step sent to the executor; once the engine has applied its result to the scheduler,
    its outputs and record wait here until they are served to streams and observers. A plan
    that streams its steps (multi_step.py) keeps the steps' answers that came before the
    engine awaited it in `streamed`, to apply them in order, and counts them (`answered`): once
    all but its last have come, that last one is under way and can no longer be cut, so a plan
    may be sent on top of it (`may_follow`), as on top of a plan of one step."""

    plan: StepPlan
    stats: StepStats
    planned_at: float  # wall clock
    started: int  # perf_counter_ns when planned
    future: asyncio.Future[StepResult] = field(init=False)
    outputs: list[TokenOutput] = field(default_factory=list)
    record: StepRecord | None = None
    streamed: list[StepResult] = field(default_factory=list)
    answered: int = 0  # steps answered before the last (stream_steps)
    # Set once a plan may be sent on top of this one (its last step is under way) or it ended.
    last_step: asyncio.Event = field(default_factory=asyncio.Event)

    def on_answer(self, result: StepResult) -> None:
        """Keeps a streamed step's answer (not its plan's last) for the engine, and counts it."""
        self.streamed.append(result)
        self.answered += 1
        if self.answered >= self.plan.num_steps - 1:
            self.last_step.set()

    def may_follow(self, limit: int | None) -> bool:
        """Whether the next plan may be sent before this one's result (async scheduling): at most
        `limit` sequences (config.overlap_limit; None: any), and its last step under way. A plan
        of several steps may be cut short until then (multi_step.py), and the next one, planned
        as if it ran whole, would then start from the wrong place."""
        return (limit is None or len(self.plan.seqs) <= limit) and self.answered >= self.plan.num_steps - 1
