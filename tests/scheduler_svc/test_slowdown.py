"""The decode-step slowdown (scheduler_svc/slowdown.py): a shape's recent median over its best,
one WARNING once it stays at 3x or more for 30 s, said again only after it recovered. Driven by
synthetic steps with given executor times and timestamps: no wall clock, no real load."""

from __future__ import annotations

import logging

from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc import slowdown
from scheduler_svc.metrics import Metrics
from scheduler_svc.plan import ScheduledSeq, StepPlan, StepResult
from scheduler_svc.slowdown import SlowdownWatch, decode_shape


def _plan(batch: int, context: int = 100, prefill: int = 0) -> StepPlan:
    plan = StepPlan(step_id=0)
    for i in range(batch):
        plan.seqs.append(ScheduledSeq(i, f"r{i}", context, 1, [], [], True))
    if prefill:
        plan.seqs.append(ScheduledSeq(99, "p", 0, prefill, list(range(prefill)), [], False))
    return plan


def _feed(watch: SlowdownWatch, times_ms: list[float], start: float = 0.0, every: float = 1.0, batch: int = 1):
    ratios = []
    for k, ms in enumerate(times_ms):
        ratios.append(watch.observe(_plan(batch), StepResult(0, [], forward_ns=int(ms * 1e6)), start + k * every))
    return ratios


def test_shapes():
    assert decode_shape(_plan(3, 100)) == (3, 0) and decode_shape(_plan(3, 300)) == (3, 1)
    assert decode_shape(_plan(2, 100, prefill=5)) is None and decode_shape(StepPlan(step_id=1)) is None


def test_a_sustained_slowdown_is_said_once_and_again_after_recovery(caplog):
    watch = SlowdownWatch()
    with caplog.at_level(logging.WARNING, logger="scheduler_svc.slowdown"):
        ratios = _feed(watch, [20.0] * 16)  # the machine's speed for this shape
        assert ratios[-1] == 1.0 and not caplog.records
        # 4x from the 9th slow step (the median turns) on: 25.5 s of it is not yet sustained ...
        _feed(watch, [80.0] * 60, start=100.0, every=0.5)
        assert watch.ratio == 4.0 and not caplog.records
        _feed(watch, [80.0] * 10, start=130.0)  # ... past 30 s: one line
        assert len(caplog.records) == 1 and "4.0x" in caplog.text and "--num-threads" in caplog.text
        _feed(watch, [80.0] * 100, start=140.0)  # still slow: said once only
        assert len(caplog.records) == 1
        _feed(watch, [21.0] * 16, start=240.0)  # recovered below 1.5x
        assert watch.ratio < 1.5
        _feed(watch, [70.0] * 60, start=500.0)
        assert len(caplog.records) == 2


def test_bursts_shorter_than_the_period_say_nothing(caplog):
    watch = SlowdownWatch()
    with caplog.at_level(logging.WARNING, logger="scheduler_svc.slowdown"):
        _feed(watch, [20.0] * 16)
        for burst in range(5):  # 20 s slow, then fast again, repeatedly
            _feed(watch, [90.0] * 20, start=1000.0 * (burst + 1))
            _feed(watch, [20.0] * 16, start=1000.0 * (burst + 1) + 20)
    assert not caplog.records


@given(st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=80))
def test_the_ratio_is_at_least_one_and_other_steps_do_not_move_it(times):
    watch = SlowdownWatch()
    ratios = _feed(watch, times)
    assert all(r >= 1.0 for r in ratios)
    before = watch.ratio
    assert watch.observe(_plan(2, prefill=16), StepResult(0, [], forward_ns=10**12), 1e6) == before  # a prefill step
    assert watch.observe(_plan(5), StepResult(0, [], forward_ns=0), 1e6) == before  # no executor time


def test_the_gauge_follows_the_watch_through_the_steps_metrics_sees(fakes):
    """Metrics.on_step feeds the watch every step's record: the gauge moves with decode steps
    five times slower than the best, and a prefill step leaves it."""
    from scheduler_svc.observer import StepRecord
    from scheduler_svc.plan import StepStats

    metrics = Metrics("m")
    gauge = lambda: metrics.registry.get_sample_value("chunkserve_decode_step_slowdown_ratio", {"model_name": "m"})  # noqa: E731
    assert gauge() == 1.0
    state = fakes.make_scheduler().snapshot()

    def step(plan: StepPlan, ms: float) -> None:
        result = StepResult(0, [], forward_ns=int(ms * 1e6))
        metrics.on_step(StepRecord(plan, StepStats(64, "fcfs"), result, 0.0, 0, state))

    for ms in [10.0] * slowdown.WINDOW + [50.0] * slowdown.WINDOW:
        step(_plan(1), ms)
    assert gauge() == 5.0
    step(_plan(1, prefill=16), 1000.0)
    assert gauge() == 5.0


def test_the_thread_gauge_shows_the_count_the_executor_reported(fakes):
    """chunkserve_executor_cpu_threads follows StepResponse.num_threads (executor_svc/threads.py
    moves it); a step that does not report one (0: an older executor) leaves it."""
    from scheduler_svc.observer import StepRecord
    from scheduler_svc.plan import StepStats

    metrics = Metrics("m")
    gauge = lambda: metrics.registry.get_sample_value("chunkserve_executor_cpu_threads", {"model_name": "m"})  # noqa: E731
    state = fakes.make_scheduler().snapshot()
    for threads, expected in [(2, 2.0), (1, 1.0), (0, 1.0), (2, 2.0)]:
        result = StepResult(0, [], forward_ns=1_000_000, num_threads=threads)
        metrics.on_step(StepRecord(_plan(1), StepStats(64, "fcfs"), result, 0.0, 0, state))
        assert gauge() == expected
