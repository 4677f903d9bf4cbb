"""The Replica service's load report and step-time model (what the router predicts TTFT from)."""

from __future__ import annotations

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.observer import StepRecord
from scheduler_svc.plan import Sampled, StepResult
from scheduler_svc.policy import create_policy
from scheduler_svc.replica import MIN_STEPS, WARM_UP, StepCostWatch, load_of
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_cost import features


def scheduler(budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget)
    return Scheduler(config, BlockPool(256, 16, enable_caching=True), create_policy("fcfs"), max_model_len=1024)


def add(s: Scheduler, n: int, length: int) -> None:
    for i in range(n):
        rid = f"r{len(s.requests)}"
        s.add_request(Request(rid, len(s.requests), [i + 1] * length, SamplingParams(max_tokens=4, ignore_eos=True)))


def test_load_counts_the_prompt_tokens_still_to_prefill():
    s = scheduler(budget=64)
    add(s, 3, 100)
    load = load_of(s, None)
    assert (load.num_waiting, load.num_running, load.pending_prefill_tokens) == (3, 0, 300)
    assert load.pending_prefill_attention == 3 * (100 * 101 // 2)  # each from scratch
    assert not load.step_cost_fitted and list(load.step_cost) == [0.0] * 5
    plan = s.schedule()  # 64 tokens of the first prompt
    s.update(plan, StepResult(plan.step_id, [Sampled(e.seq_id, 7) for e in plan.seqs if e.sample]))
    load = load_of(s, None)
    assert load.pending_prefill_tokens == 300 - plan.num_tokens
    # the rest of the first prompt attends to the 64 tokens already computed, and to itself
    first = s.requests["r0"].num_computed_tokens
    rest = 100 - first
    assert load.pending_prefill_attention == rest * first + rest * (rest + 1) // 2 + 2 * (100 * 101 // 2)
    assert load.num_running >= 1 and load.token_budget == 64 and load.block_size == 16


def test_step_cost_watch_fits_only_once_asked_and_recovers_the_cost():
    s = scheduler(budget=128)
    add(s, 8, 200)
    watch = StepCostWatch()
    records = []
    a, b, c = 0.004, 2e-5, 1e-3  # seconds: per step, per prefill token, per decode
    while s.has_work():
        plan = s.schedule()
        stats = s.step_stats
        x = features(
            (e.num_new_tokens, e.num_computed_tokens, r.num_prompt_tokens) for e, r in zip(plan.seqs, stats.requests)
        )
        seconds = a + b * x[1] + c * x[2]
        s.update(plan, StepResult(plan.step_id, [Sampled(e.seq_id, 7) for e in plan.seqs if e.sample]))
        records.append(StepRecord(plan, stats, StepResult(plan.step_id, []), 0.0, int(seconds * 1e9), s.snapshot()))
    for r in records:
        watch.on_step(r)  # not asked yet: nothing collected
    assert watch.current() is None and watch.enabled
    for _ in range(3):
        for r in records:
            watch.on_step(r)
    assert len(records) * 3 >= MIN_STEPS + WARM_UP
    model = watch.current()
    assert model is not None
    got = model.coef
    assert abs(got[0] - a) < 1e-3 and abs(got[1] - b) < 5e-6 and abs(got[2] - c) < 3e-4
    assert load_of(s, model).step_cost_fitted
