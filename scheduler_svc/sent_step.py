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
    engine awaited it in `streamed`, to apply them in order."""

    plan: StepPlan
    stats: StepStats
    planned_at: float  # wall clock
    started: int  # perf_counter_ns when planned
    future: asyncio.Future[StepResult] = field(init=False)
    outputs: list[TokenOutput] = field(default_factory=list)
    record: StepRecord | None = None
    streamed: list[StepResult] = field(default_factory=list)
