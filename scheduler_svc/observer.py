"""What the step loop (engine.py) tells its observers: metrics, the step trace, the replica's
load report. Here rather than in engine.py so an observer depends on what it is told, not on
the loop that tells it."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.plan import StepPlan, StepResult, StepStats
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.snapshot import SchedulerSnapshot


@dataclass(slots=True)
class StepRecord:
    """One completed step, for observers."""

    plan: StepPlan
    stats: StepStats
    result: StepResult
    planned_at: float  # wall clock, seconds since the epoch
    step_ns: int  # from planning to the result applied
    state: SchedulerSnapshot  # queues and KV usage after the step


class Observer:
    """What the loop tells metrics and the step trace, on the event loop (keep it cheap); a hook
    does nothing unless overridden. on_token sees the previous token's last_token_time."""

    def on_step(self, record: StepRecord) -> None: ...
    def on_state(self, state: SchedulerSnapshot) -> None:
        """Queues or KV usage changed between steps (an abort): load gauges would otherwise
        show the last step's load until the next step, which may never come."""

    def on_token(self, request: Request, now: float) -> None: ...
    def on_finish(self, request: Request, reason: FinishReason, now: float) -> None: ...
