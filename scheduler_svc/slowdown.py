"""Says so when the executor's decode steps run several times slower than this server has seen
them run, for a sustained period: the mark of CPU contention (other processes on the same
cores) or a CPU quota (a container's `--cpus`, a Kubernetes limit) rather than of the load
this server itself carries.

Why it is needed: on a shared 2-core machine a server whose torch threads outnumbered the cores
it actually got served 1 token/s where it served 25 idle, and nothing in its metrics said why.
A decode step's cost is set by its shape (sequences and their context), so the same shape
taking several times its best time means the CPU was taken away. `SlowdownWatch` keys pure
decode steps by shape (sequence count, and context in powers of two of 256 tokens), keeps each
shape's best executor time (the machine's speed when it had the CPU) and the median of its
last WINDOW steps; their ratio is the slowdown, exported as a gauge a dashboard can alert on.
Once it stays at or above SLOW_RATIO for SUSTAIN_S, one WARNING line names the likely cause
and what to change; it is said again only after the ratio fell back below CLEAR_RATIO.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from scheduler_svc.plan import StepPlan, StepResult

log = logging.getLogger(__name__)

WINDOW = 16  # recent steps of one shape whose median is compared with its best
SLOW_RATIO = 3.0
CLEAR_RATIO = 1.5
SUSTAIN_S = 30.0


def decode_shape(plan: StepPlan) -> tuple[int, int] | None:
    """(sequences, context bucket) of a pure decode step, None for any other step."""
    if not plan.seqs or any(s.num_new_tokens != 1 for s in plan.seqs):
        return None
    context = sum(s.num_computed_tokens for s in plan.seqs) // len(plan.seqs)
    return len(plan.seqs), (context // 256).bit_length()


class SlowdownWatch:
    """The slowdown of decode steps against their best, and the one log line (module doc)."""

    def __init__(self) -> None:
        self._best: dict[tuple[int, int], int] = {}
        self._recent: dict[tuple[int, int], deque[int]] = {}
        self.ratio = 1.0  # of the last shape with a full window; 1.0 until there is one
        self._slow_since: float | None = None  # when the ratio last rose to SLOW_RATIO
        self._warned = False

    def observe(self, plan: StepPlan, result: StepResult, now: float) -> float:
        """Takes one finished step (`now`: seconds on any steady clock); returns the ratio."""
        shape = decode_shape(plan)
        ns = result.forward_ns
        if shape is None or ns <= 0:
            return self.ratio
        self._best[shape] = min(self._best.get(shape, ns), ns)
        recent = self._recent.setdefault(shape, deque(maxlen=WINDOW))
        recent.append(ns)
        if len(recent) < WINDOW:
            return self.ratio
        self.ratio = statistics.median(recent) / self._best[shape]
        if self.ratio >= SLOW_RATIO:
            self._slow_since = now if self._slow_since is None else self._slow_since
            if not self._warned and now - self._slow_since >= SUSTAIN_S:
                self._warned = True
                log.warning(
                    "decode steps of %d sequences take %.1fx as long as this server's best for that shape, "
                    "for %.0f s: the CPU is likely taken by other processes on the same cores, or capped by a "
                    "CPU quota (container limit). Give the server dedicated cores or a larger quota; the executor "
                    "already runs the thread count that is fastest now unless --num-threads fixed one "
                    "(gauge chunkserve_executor_cpu_threads; docs/cpu.md, 'Threads on a shared CPU')",
                    *(shape[0], self.ratio, now - self._slow_since),
                )
        else:
            self._slow_since = None
            self._warned = self._warned and self.ratio >= CLEAR_RATIO
        return self.ratio
