"""The executor's thread governor (executor_svc/threads.py): it moves to the count that runs the
steps faster, comes back when the machine frees up, and changes speed only, never tokens.

The governor is driven here by a simulated machine: a step's time is a function of its key,
the thread count and the machine's condition (idle, a busy neighbour), with seeded noise. No
test reads a clock."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.cpu import CpuBudget
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.threads import ThreadGovernor, choose_counts, ladder

IDLE = {2: 0.028, 1: 0.038}  # seconds per batch-1 step: the default model, measured on 2 cores
BUSY = {2: 0.095, 1: 0.040}  # one other busy process: two threads stall at every barrier


class Machine:
    """Step times by thread count and condition, +-`noise` uniform, seeded; `now` is its clock
    (steps back to back: each step moves it by the step's time)."""

    def __init__(self, seed: int = 0, noise: float = 0.05) -> None:
        self.rng = random.Random(seed)
        self.noise = noise
        self.costs = IDLE
        self.now = 0.0

    def step(self, threads: int, key: int = 1) -> float:
        seconds = self.costs[threads] * key * (1 + self.rng.uniform(-self.noise, self.noise))
        self.now += seconds
        return seconds


def run(governor: ThreadGovernor, machine: Machine, steps: int, key: int = 1) -> list[int]:
    """The thread count each step ran with."""
    used = []
    for _ in range(steps):
        used.append(governor.prepare(key, machine.now))
        seconds = machine.step(governor.running, key)
        governor.observe(key, seconds, machine.now)
    return used


def make(applied: list[int] | None = None, counts=(2, 1)) -> ThreadGovernor:
    sink = applied if applied is not None else []
    return ThreadGovernor(counts, sink.append)


def test_ladder_starts_with_every_usable_cpu() -> None:
    assert ladder(1) == (1,)
    assert ladder(2) == (2, 1)
    assert ladder(4) == (4, 3, 2, 1)
    assert ladder(16) == (16, 15, 8, 1)


def test_counts_fixed_by_the_flag_or_tensor_parallel() -> None:
    assert choose_counts(3, 1, CpuBudget(8, None, ""))[0] == (3,)
    counts, why = choose_counts(0, 1, CpuBudget(2, None, ""))
    assert counts == (2, 1) and "2 usable" in why
    assert choose_counts(0, 1, CpuBudget(8, 1.5, "cpu.max"))[0] == (1,)  # a 1.5-CPU quota: one thread
    assert len(choose_counts(0, 2, CpuBudget(8, None, ""))[0]) == 1  # tensor parallel: fixed rule


def test_an_idle_machine_keeps_every_thread_and_probes_less_and_less() -> None:
    applied: list[int] = []
    governor = make(applied)
    used = run(governor, Machine(), 1000)  # 28 s
    assert governor.switches == 0
    assert used.count(1) == governor.probes  # each probe: one step at one thread (it lost), then back
    assert governor.probes <= 10  # 0.5 s after the start, then 1, 2, 4, 4, 4, ... s apart
    assert applied[0] == 2 and applied[-1] == 2


def test_a_busy_neighbour_moves_it_down_within_a_few_steps_and_its_departure_back_up() -> None:
    machine = Machine(seed=1)
    governor = make()
    run(governor, machine, 300)
    assert governor.current() == 2
    machine.costs = BUSY
    used = run(governor, machine, 400)
    first_down = next(i for i in range(len(used) - 1) if used[i] == 1 and used[i + 1] == 1)
    assert first_down <= 6  # the slowdown triggers a probe at once, not at the next scheduled one
    assert used[first_down:].count(2) <= 2 * governor.probes  # only probes run at two threads now
    assert governor.current() == 1
    machine.costs = IDLE
    left_busy = machine.now
    used = run(governor, machine, 2500)
    back = used.index(2)  # the next scheduled probe: its interval grew with what the probes at 2 cost
    assert back * IDLE[1] <= 16 * governor.max_interval_s and governor.current() == 2
    assert machine.now > left_busy


def test_a_quiet_spell_makes_every_count_due_again() -> None:
    """After contention the governor sits at one thread with a long wait before its next probe
    at two; if no step ran for a while (QUIET_S), the first steps after it probe at once."""
    machine = Machine(seed=4)
    governor = make()
    machine.costs = BUSY
    run(governor, machine, 600)
    assert governor.current() == 1
    machine.costs = IDLE
    machine.now += 60.0  # the server had nothing to do for a minute
    used = run(governor, machine, 10)
    assert governor.current() == 2 and used.index(2) <= 4


def test_steps_of_another_size_keep_their_own_count_while_a_probe_waits() -> None:
    governor = make()
    machine = Machine(seed=2, noise=0.0)
    steps = 0
    while governor.prepare(1, machine.now) == 2 and steps < 100:  # 0.5 s in, a probe at one thread starts
        governor.observe(1, machine.step(2), machine.now)
        steps += 1
    assert governor.running == 1 and governor.probes == 1 and 17 <= steps <= 20
    assert governor.prepare(7, machine.now) == 2  # a prefill chunk: its own size class, at its own count
    governor.observe(7, machine.step(2, 7), machine.now)
    assert governor.prepare(1, machine.now) == 1  # the decode probe goes on
    assert governor.switches == 0 and governor.current(1) == 2 and governor.current(7) == 2


def test_each_step_size_settles_on_its_own_fastest_count() -> None:
    """One-token steps lose the second thread to the scheduler working beside them, eight-token
    steps still gain from it: each size class ends at its own count."""
    machine = Machine(seed=5)
    costs = {1: {2: 0.040, 1: 0.030}, 8: {2: 0.050, 1: 0.080}}
    governor = make()
    used: dict[int, list[int]] = {1: [], 8: []}
    for step in range(3000):
        key = 8 if (step // 50) % 2 else 1
        used[key].append(governor.prepare(key, machine.now))
        seconds = costs[key][governor.running] * (1 + machine.rng.uniform(-0.05, 0.05))
        machine.now += seconds
        governor.observe(key, seconds, machine.now)
    assert governor.current(1) == 1 and governor.current(8) == 2
    assert used[1][-500:].count(1) > 450 and used[8][-500:].count(2) > 450


def test_a_probe_that_collapses_backs_off_in_proportion() -> None:
    """A count that makes steps 30x slower is probed rarely: in the long run one probe step
    (0.9 s) per 16 x 4 s, 1.4% of the time (the interval grows at most 16x with a probe's cost)."""
    governor = make(counts=(2, 1))
    machine = Machine(seed=3, noise=0.0)
    machine.costs = {2: 0.030, 1: 0.0300}
    run(governor, machine, 40)
    machine.costs = {2: 0.030, 1: 0.900}  # one thread collapses (say, pinned to a busy core)
    used = run(governor, machine, 12000)
    probe_time = used.count(1) * 0.900
    total = probe_time + used.count(2) * 0.030
    assert governor.current() == 2 and probe_time / total < 0.02


def test_one_lucky_probe_step_is_not_enough() -> None:
    governor = make()
    now = 0.0
    while governor.prepare(1, now) == 2:
        now += 0.030
        governor.observe(1, 0.030, now)
    governor.observe(1, 0.010, now + 0.010)  # fast
    assert governor.prepare(1, now + 0.010) == 1
    governor.observe(1, 0.035, now + 0.045)  # not faster than 0.9 x the median of 0.030
    assert governor.current() == 2 and governor.switches == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    noise=st.floats(0.0, 0.15),
    cost=st.dictionaries(st.sampled_from([4, 3, 2, 1]), st.floats(0.005, 0.2), min_size=4, max_size=4),
)
def test_settles_on_a_clearly_fastest_count(seed: int, noise: float, cost: dict[int, float]) -> None:
    """Whatever the costs of four counts, the governor spends most steps on one within 30%
    of the fastest, and never leaves the ladder."""
    machine = Machine(seed, noise)
    machine.costs = cost
    governor = make(counts=(4, 3, 2, 1))
    used = run(governor, machine, 1500)
    assert set(used) <= {4, 3, 2, 1}
    best = min(cost.values())
    late = used[500:]
    good = sum(1 for n in late if cost[n] <= best * 1.3 + 1e-12)
    assert good >= 0.8 * len(late)


GREEDY = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)


@pytest.fixture
def tiny_runner(tiny):
    """The runner tests' tiny executor (conftest.py), its governor set aside: these tests set
    the thread count themselves."""
    runner = tiny[1].runner
    governor, threads = runner.threads, torch.get_num_threads()
    runner.threads = None
    yield runner
    runner.threads = governor
    torch.set_num_threads(threads)


def _logits(runner, schedule) -> list[torch.Tensor]:
    """Two sequences prefilled (30 and 22 tokens) then 12 decode steps, torch threads set by
    `schedule(step)`; the logits of every step."""
    runner.reset()
    seen: list[torch.Tensor] = []
    model = runner.model
    original = model.compute_logits
    model.compute_logits = lambda h: seen.append(original(h).clone()) or seen[-1]
    try:
        for step in range(14):
            torch.set_num_threads(schedule(step))
            plan = epb.StepRequest(step_id=step)
            if step < 2:
                n = 30 - 8 * step
                plan.new_seqs.add(seq_id=step, sampling=GREEDY)
                plan.seqs.add(
                    seq_id=step,
                    num_new_tokens=n,
                    token_ids=[(7 * i + step) % 120 + 3 for i in range(n)],
                    block_ids=list(range(step * 16, step * 16 + 16)),
                    sample=True,
                )
            else:
                for sid, prompt in ((0, 30), (1, 22)):
                    plan.seqs.add(seq_id=sid, num_computed_tokens=prompt + step - 2, num_new_tokens=1, sample=True)
            runner.execute(plan)
    finally:
        model.compute_logits = original
    return seen


def test_the_thread_count_never_changes_the_logits(tiny_runner) -> None:
    """What makes the governor safe: every step's logits bitwise the same at 1 and 2 threads
    and with the count changed at every step."""
    base = _logits(tiny_runner, lambda step: 2)
    for schedule in (lambda step: 1, lambda step: 1 + step % 2):
        other = _logits(tiny_runner, schedule)
        assert len(other) == len(base)
        assert all(torch.equal(a, b) for a, b in zip(base, other))


def test_the_runner_asks_the_governor_before_each_step_and_reports_the_count(tiny_runner) -> None:
    """Each step runs at the count `prepare` gave its size, reports it in num_threads, and
    the governor sees every step with tokens."""
    seen: list[tuple[str, int]] = []

    class Recording(ThreadGovernor):
        def prepare(self, key: int, now: float) -> int:
            seen.append(("prepare", key))
            return super().prepare(key, now)

        def observe(self, key: int, seconds: float, now: float) -> None:
            seen.append(("observe", key))
            super().observe(key, seconds, now)

    tiny_runner.threads = Recording((2, 1), torch.set_num_threads)
    try:
        tiny_runner.reset()
        plan = epb.StepRequest(step_id=0)
        plan.new_seqs.add(seq_id=0, sampling=GREEDY)
        plan.seqs.add(seq_id=0, num_new_tokens=9, token_ids=list(range(3, 12)), block_ids=list(range(8)), sample=True)
        first = tiny_runner.execute(plan)
        second = tiny_runner.execute(
            epb.StepRequest(step_id=1, seqs=[epb.ScheduledSequence(seq_id=0, num_computed_tokens=9, num_new_tokens=1)])
        )
        assert seen == [("prepare", 9), ("observe", 9), ("prepare", 1), ("observe", 1)]
        assert first.num_threads == second.num_threads == 2
    finally:
        tiny_runner.threads = None


def test_many_step_sizes_keep_a_bounded_memory() -> None:
    """Prefill chunks of every size: each size class remembers at most MAX_KEYS of them."""
    from executor_svc.threads import MAX_KEYS

    governor = make()
    machine = Machine(seed=6, noise=0.0)
    for key in range(1, 5000):
        governor.prepare(key, machine.now)
        governor.observe(key, machine.step(governor.running, 1), machine.now)
    assert all(len(shape.recent) <= MAX_KEYS for shape in governor._shapes.values())


def test_two_slow_steps_are_noise_three_are_a_slowdown() -> None:
    """A step or two slowed by the scheduler's work beside it does not send the governor down;
    three in a row ask for a probe one rung down at the next step (no scheduled probe here)."""
    governor = ThreadGovernor((2, 1), lambda n: None, first_interval_s=100.0)
    now = 0.0
    for seconds in [0.028] * 6 + [0.060, 0.060, 0.028] + [0.028] * 3:
        assert governor.prepare(1, now) == 2
        now += seconds
        governor.observe(1, seconds, now)
    for _ in range(3):
        assert governor.prepare(1, now) == 2
        now += 0.060
        governor.observe(1, 0.060, now)
    assert governor.prepare(1, now) == 1 and governor.probes == 1  # the probe down starts
