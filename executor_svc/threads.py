"""The executor's torch thread count, chosen step by step from what the steps actually take.

Why not one number fixed at start-up: on a 2-core machine (benchmarks/shared_cpu.py,
docs/cpu.md 'Threads on a shared CPU') two torch threads decode 1.3-1.8x faster than one while
the machine is idle, and 3x slower than one as soon as another process takes a core: OpenMP's
threads wait for each other at every parallel region (~200 per token), so a thread that lost
its core stalls the step. A container quota the process cannot see does the same. No fixed
count is right in both conditions, and the condition changes while a server runs.

`ThreadGovernor` keeps a ladder of counts (all usable CPUs first, then fewer) and moves along
it by measurement, never by guess, separately for each size class of steps (token counts of
one bit length: 1, 2-3, 4-7, ...), since the fastest count depends on the step's size too:
- it records each step's executor time under its key (the step's token count: steps of one
  key cost about the same at one thread count);
- now and then it *probes* another rung: the next `PROBE_STEPS` steps run there, and it moves
  only when every probe step of the same key beat the current count's recent median by
  `margin`. Each rung has its own schedule, in seconds: due 0.5 s after a move (nearer rungs
  first), then twice as long after each lost probe up to `max_interval_s`, times what the
  lost probe step cost in steps (at most 16x), so a count that collapses costs about one step
  per 4 s; after a quiet spell (no step for 2 s) the times are forgotten and every rung is due
  again once three fresh steps give a reference;
- when three steps of one key in a row run `slow_ratio` times their recent best (another
  process took a core), it probes one rung down at once instead of waiting for the next probe.

Safe for the tokens: every kernel the executor runs computes a row's result in one fixed order
whatever the thread count (tests/executor_svc/test_threads.py checks the logits bitwise with
the count changed at every step), so moving along the ladder changes speed only.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chunkserve_contracts.cpu import CpuBudget

log = logging.getLogger(__name__)

PROBE_STEPS = 2  # steps a probe runs at the other count; all of them must win
WINDOW = 8  # recent steps per key at the current count
STALE_S = 10.0  # seconds after which a key's time says nothing about now (the machine may have changed)
MAX_KEYS = 64  # keys remembered per size class (a prefill chunk's size varies step to step)
QUIET_S = 2.0  # a gap between steps this long makes every rung due for a probe


def ladder(cpus: int) -> tuple[int, ...]:
    """The counts a governor may use on `cpus` usable CPUs, most first: all of them, one left
    to the scheduler process or another program, half, and one."""
    return tuple(sorted({max(1, n) for n in (cpus, cpus - 1, cpus // 2, 1)}, reverse=True))


def choose_counts(num_threads: int, ranks: int, budget: CpuBudget) -> tuple[tuple[int, ...], str]:
    """The thread counts the executor may use, most first (one count: fixed), and why (the log).

    `--num-threads N` fixes N. Otherwise a single executor moves along `ladder` from all its
    usable CPUs; tensor-parallel ranks keep the fixed rule (CpuBudget.torch_threads: one CPU
    left to the scheduler, the rest split), since each rank's step time includes waiting for
    the others and cannot tell one rank's thread count from another's."""
    if num_threads:
        return (num_threads,), "set by --num-threads"
    if ranks == 1 and budget.cpus >= 2:
        counts = ladder(budget.cpus)
        return counts, f"{budget.describe()}: {budget.cpus} usable; then {counts[1:]} if steps run faster with fewer"
    threads, why = budget.torch_threads(ranks)
    return (threads,), why


@dataclass
class _Probe:
    target: int  # ladder index the probe runs at
    key: int  # the step key it compares
    reference: float  # the current count's recent median for that key, seconds
    samples: list[float] = field(default_factory=list)
    triggered: bool = False  # by a slowdown, not by the schedule


@dataclass
class _Shape:
    """One size class of steps (token counts of one bit length): its own rung and schedule.
    The fastest count depends on the step's size as well as on the machine: a one-token
    decode step gains least from a second thread and is the first to lose it to the
    scheduler process working beside it, a prefill chunk (compute-bound) gains more."""

    index: int
    recent: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)  # key -> (when, seconds)
    gap: dict[int, float] = field(default_factory=dict)  # rung -> seconds between its scheduled probes
    due: dict[int, float] = field(default_factory=dict)  # rung -> when its next scheduled probe may run
    probe: _Probe | None = None
    look_down: float | None = None  # the slow steps' median when a slowdown asked for a probe down


class ThreadGovernor:
    """Moves the torch thread count along `counts` by measured step times (module doc).

    Before each step, `prepare(key, now)` gives the count it runs with (and applies it with
    `apply(n)`, torch.set_num_threads on the thread that runs the steps); after it,
    `observe(key, seconds, now)` takes its executor time. `key` is the step's token count,
    `now` any steady clock in seconds. Each size class of steps keeps its own rung. Schedules
    are in seconds, not steps: a server that steps rarely still probes about as often, and the
    first step after a quiet spell (the machine may have changed meanwhile) makes every rung due.
    """

    def __init__(
        self,
        counts: Sequence[int],
        apply: Callable[[int], None],
        *,
        first_interval_s: float = 0.5,
        max_interval_s: float = 4.0,
        margin: float = 0.10,
        slow_ratio: float = 1.5,
    ) -> None:
        if not counts:
            raise ValueError("a thread governor needs at least one count")
        self.counts = tuple(sorted(set(counts), reverse=True))
        self.first_interval_s = first_interval_s
        self.max_interval_s = max_interval_s
        self.margin = margin
        self.slow_ratio = slow_ratio
        self.switches = 0
        self.probes = 0
        self._apply = apply
        self._shapes: dict[int, _Shape] = {}
        self._now: float | None = None  # when the last step was observed
        self._last_index = 0  # the rung of the shape stepped last: where a new shape starts
        self.running = self.counts[0]
        apply(self.running)

    def current(self, key: int = 1) -> int:
        """The count the governor settled on for steps of `key` tokens (a probe may run another)."""
        shape = self._shapes.get(key.bit_length())
        return self.counts[shape.index if shape is not None else self._last_index]

    def prepare(self, key: int, now: float) -> int:
        """The count the next step (of `key` tokens) runs with, applied; starts a probe when one is due."""
        if len(self.counts) < 2:
            return self.running
        if self._now is not None and now - self._now > QUIET_S:
            self._after_quiet(now)
        shape = self._shape(key, now)
        if shape.probe is None:
            recent = [t for _, t in shape.recent.get(key, ())]
            if shape.look_down is not None:
                self._start(shape, shape.index + 1, key, shape.look_down, triggered=True)
            elif len(recent) >= 3 and (due := [r for r, when in shape.due.items() if when <= now]):
                target = min(due, key=lambda r: (shape.due[r], abs(r - shape.index), r))
                self._start(shape, target, key, statistics.median(recent))
        probe = shape.probe
        self._set(self.counts[probe.target if probe is not None and probe.key == key else shape.index])
        return self.running

    def observe(self, key: int, seconds: float, now: float) -> None:
        """Takes the step just run (at `running` threads, after `prepare` with the same key)."""
        if len(self.counts) < 2 or seconds <= 0:
            return
        self._now = now
        shape = self._shape(key, now)
        self._last_index = shape.index
        probe = shape.probe
        if probe is not None and self.running == self.counts[probe.target]:
            if probe.key == key:
                self._probe_step(shape, probe, key, seconds, now)
            return  # another key ran at the probe's count (prepare's caller skipped a step): not comparable
        if key not in shape.recent and len(shape.recent) >= MAX_KEYS:  # prefill chunks: many sizes
            del shape.recent[next(iter(shape.recent))]  # the key seen first goes
        entries = shape.recent.setdefault(key, deque(maxlen=WINDOW))
        entries.append((now, seconds))
        while entries[0][0] < now - STALE_S:
            entries.popleft()
        recent = [t for _, t in entries]
        if len(recent) >= 4 and shape.index + 1 < len(self.counts) and probe is None:
            # A core was taken: the last three steps all slow (one or two slow steps are noise:
            # the scheduler's own work beside a step, a page fault), so look down at the next step.
            if min(recent[-3:]) > self.slow_ratio * min(recent):
                shape.look_down = statistics.median(recent[-3:])

    def _after_quiet(self, now: float) -> None:
        """No step ran for QUIET_S: the machine may have changed meanwhile (a neighbour came or
        left), so every shape forgets its times and schedules, and probes every other rung as
        soon as it has three fresh steps to compare with."""
        self._now = now
        for shape in self._shapes.values():
            shape.recent.clear()
            shape.look_down = None
            shape.gap = dict.fromkeys(shape.gap, self.first_interval_s)
            shape.due = dict.fromkeys(shape.due, now)

    def _shape(self, key: int, now: float) -> _Shape:
        size = key.bit_length()
        shape = self._shapes.get(size)
        if shape is None:
            shape = self._shapes[size] = _Shape(self._last_index)
            self._reset_schedule(shape, now)
        return shape

    def _reset_schedule(self, shape: _Shape, now: float) -> None:
        """Every other rung due for a probe soon, nearer rungs first: each rung keeps its own
        schedule, so a rung that collapsed is probed rarely while the others are still tried
        (a count two rungs away can be the fastest while its neighbours tie, e.g. 16 threads
        under a 2-CPU quota the process cannot see: 16, 15 and 8 all stall)."""
        others = [r for r in range(len(self.counts)) if r != shape.index]
        shape.gap = dict.fromkeys(others, self.first_interval_s)
        shape.due = {r: now + self.first_interval_s * abs(r - shape.index) for r in others}

    def _start(self, shape: _Shape, target: int, key: int, reference: float, triggered: bool = False) -> None:
        self.probes += 1
        shape.look_down = None
        shape.probe = _Probe(target, key, reference, triggered=triggered)

    def _probe_step(self, shape: _Shape, probe: _Probe, key: int, seconds: float, now: float) -> None:
        probe.samples.append(seconds)
        won = max(probe.samples) < probe.reference * (1 - self.margin)
        if won and len(probe.samples) < PROBE_STEPS:
            return  # a lost step ends the probe at once: a collapsed count costs one step, not two
        old = self.counts[shape.index]
        if won:
            shape.index = probe.target
            self.switches += 1
            log.info(
                "torch threads %d -> %d for steps of %d-%d tokens: %d took %.1f ms at %d threads, %.1f ms at %d%s",
                *(old, self.counts[shape.index], 1 << (key.bit_length() - 1), (1 << key.bit_length()) - 1, key),
                *(probe.reference * 1e3, old, max(probe.samples) * 1e3, self.counts[shape.index]),
                " (they had slowed down: CPU contention or a CPU quota)" if probe.triggered else "",
            )
        else:
            log.debug(
                "torch threads: %d kept; a step of %d tokens took %.1f ms at %d threads against %.1f ms at %d",
                *(old, key, seconds * 1e3, self.counts[probe.target], probe.reference * 1e3, old),
            )
        shape.probe = None
        if won:
            shape.recent.clear()  # times at the old count say nothing about the new one
            self._reset_schedule(shape, now)
            return
        if probe.triggered:  # slow for everyone: start the baseline again from now
            shape.recent.clear()
        # A probe step that cost k steps' time waits k times longer (at most 16x), so probing a
        # count that collapses costs about a step per max_interval_s, not k of them.
        gap = min(shape.gap[probe.target] * 2, self.max_interval_s)
        shape.gap[probe.target] = gap
        shape.due[probe.target] = now + gap * min(max(seconds / probe.reference, 1.0), 16.0)

    def _set(self, n: int) -> None:
        if n != self.running:
            self.running = n
            self._apply(n)
