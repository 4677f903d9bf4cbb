"""The scheduler's live state and settings as one frozen value (Scheduler.snapshot): the one
way GetInfo, the Admin service and the app read them, never the queues or pools themselves."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Taken between two steps, so every number belongs to the same moment."""

    config: SchedulerConfig
    policy: str
    max_model_len: int
    next_step: int  # the id of the next plan: a change made now applies from this step
    num_running: int
    num_waiting: int  # not admitted yet, or preempted by recompute
    num_swapped: int  # preempted with their KV in host memory
    num_free_device_blocks: int  # held by no request (cached prefix blocks included)
    kv_cache_usage: float  # fraction of device blocks held, 0 to 1
    token_budget: int = 0  # of the last step planned (the auto budget's choice, or the fixed one)
    budget_reason: str = ""  # the auto budget's why (StepTrace.budget_reason); "" when fixed
