"""The auto token budget: each step's budget chosen so that the step meets a step-time target,
which is what a decoding stream waits between two tokens (`--max-num-batched-tokens auto
--target-itl-ms X`).

Why: a fixed budget is a guess about the traffic. Small budgets keep decodes smooth and cost
throughput when nobody is decoding; large ones finish prefills fast and stall every decoding
stream for the length of a big step. The step time is predictable from what a step computes
(scheduler_svc/step_cost.py), so the budget can be whatever the target allows *now*:

- D requests decoding over C tokens of context: the decodes plus the largest prefill p whose
  predicted step time, a + c*D + d*C + b*p + e*p*(ctx + (p+1)/2), times a headroom factor,
  fits the target. ctx is the computed length of the longest partial prefill (the chunk that
  reads the most attention context). With no decodes (D = 0) the same rule gives the
  largest steps (prefill gets the whole target), not the whole --max-num-batched-tokens:
  a request that arrives during a step waits for it, and on the 2-core CPU of
  benchmarks/RESULTS.md prefill-only steps of 2048 tokens (~5 s) tripled short requests'
  P99 TTFT against a fixed 256 (first version of this controller, same run).

The model is fitted online on the last `WINDOW` steps this server ran (its first
`WARM_UP_STEPS` left out), by least squares on relative error with the worst-fitting steps
trimmed (`CostModel.fit_relative`: on a busy machine a few steps take many times their usual
time and would otherwise decide the fit), the time of a step being what a stream waits between
two tokens: planning, the executor's step and applying its result. The headroom factor is the
90th percentile of the last 128 steps' measured/predicted ratios, within [0.5, 2]: on a loaded
machine the same step takes longer, and the controller backs off instead of missing the target
by the noise; when the model over-predicts what the steps now take, the factor drops below 1
and the budget grows again, so a stale fit cannot hold the budget at its floor. Until the
first fit the budget is `INITIAL_BUDGET`. Hysteresis: the budget grows only by more than a
tenth (or one block) at a time, and shrinks at once (a held budget never exceeds the
target). Bounds: at most the upper bound and twice the largest step of the window the model
was fitted on (at least `INITIAL_BUDGET`: beyond what it has seen the model extrapolates, so
the budget explores upward at most 2x per fit),
at least one block of prefill on top of the decodes; when the target is out of reach even
for a step of decodes alone, the step carries as much prefill as its decodes cost (it takes
about twice a decode-only step): a smaller one would not help the decodes and would starve
prefill.

No torch here: this runs in the scheduler process, between steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.config import AUTO_MAX_BATCHED_TOKENS
from scheduler_svc.step_cost import WARM_UP_STEPS, CostModel, TraceStep, features, quantile

if TYPE_CHECKING:
    from scheduler_svc.plan import StepPlan, StepStats

INITIAL_BUDGET = 256  # before the first fit: small, so the first decodes are not stalled
WINDOW = 512  # steps the model is fitted on
REFIT_EVERY = 32  # steps between fits
MIN_STEPS_TO_FIT = 32
HEADROOM_QUANTILE = 0.9
HEADROOM_BOUNDS = (0.5, 2.0)


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    """One step's budget and why: for the step trace, metrics and `chunkserve admin`."""

    budget: int
    num_decodes: int
    predicted_ms: float  # the model's time for a step of this budget (headroom included); 0 before a fit
    reason: str  # "no decodes", "target", "floor" (target out of reach), "initial" (no fit yet), "held"


class BudgetController:
    """Learns the step-time model from the steps run and picks each step's token budget."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._steps: deque[TraceStep] = deque(maxlen=WINDOW)
        self._seen = 0
        self._since_fit = 0
        self.model: CostModel | None = None
        self.largest_seen = 0  # tokens of the largest step in the window (exploration bound)
        self.headroom = 1.0
        self.last = BudgetDecision(0, 0, 0.0, "initial")
        self._held: int | None = None  # the last budget chosen (hysteresis)

    # ---- learning ---------------------------------------------------------------------

    def observe(self, plan: StepPlan, stats: StepStats, seconds: float) -> None:
        """Records a finished step: what it computed (the cost model's features) and how long
        a stream waited for it. O(sequences in the step); a refit every REFIT_EVERY steps."""
        if seconds <= 0 or not plan.seqs:
            return
        self._seen += 1
        if self._seen <= WARM_UP_STEPS:
            return
        x = features(
            (s.num_new_tokens, s.num_computed_tokens, r.num_prompt_tokens) for s, r in zip(plan.seqs, stats.requests)
        )
        self._steps.append(TraceStep(x, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or (self.model is None and len(self._steps) >= MIN_STEPS_TO_FIT):
            self.refit()

    def refit(self) -> None:
        """Fits the model on the window (the fit's own outlier trim applies), then the headroom."""
        self._since_fit = 0
        if len(self._steps) < MIN_STEPS_TO_FIT:
            return
        steps = list(self._steps)
        self.model = CostModel.fit_relative(steps)
        self.largest_seen = int(max(s.x[1] + s.x[2] for s in steps))  # prefill + decode tokens
        ratios = [s.seconds / p for s in steps[-128:] if (p := self.model.predict_x(s.x)) > 0]
        low, high = HEADROOM_BOUNDS
        self.headroom = min(high, max(low, quantile(ratios, HEADROOM_QUANTILE))) if ratios else 1.0

    # ---- deciding ---------------------------------------------------------------------

    def decide(self, upper: int, n_dec: int, context: int, prefill_ctx: int, target_ms: float) -> BudgetDecision:
        """The next step's budget, at most `upper`, from plain values (D, C, ctx: the module docstring)."""
        floor = min(upper, n_dec + self.block_size)
        if self.model is None:
            budget, reason = max(floor, min(upper, INITIAL_BUDGET)), "initial"
        else:
            p = self._largest_prefill(n_dec, context, prefill_ctx, target_ms / 1e3 / self.headroom)
            reason = "target" if n_dec else "no decodes"
            if n_dec + p < floor:
                # Out of reach even for the decodes alone: cutting prefill further would not help
                # them, only starve it. The step carries as much prefill as its decodes cost.
                a, _, c, d, _ = self.model.coef
                p = self._largest_prefill(n_dec, context, prefill_ctx, 2 * (a + c * n_dec + d * context))
                reason = "floor"
            # Past the largest step it was fitted on the model extrapolates (with no long prompt
            # in the window it may see no cost in prefill at all): grow at most 2x per fit.
            explored = max(INITIAL_BUDGET, 2 * self.largest_seen)
            budget = min(max(floor, min(n_dec + p, explored)), upper)
            held = self._held
            # Hysteresis, one-sided so the target holds: a smaller budget applies at once, a
            # larger one only when it is larger by more than a tenth (or a block).
            if held is not None and floor <= held < budget <= held + max(self.block_size, held // 10):
                budget, reason = held, "held"
        self._held = budget
        predicted = self._predict_ms(n_dec, context, budget - n_dec, prefill_ctx)
        self.last = BudgetDecision(budget, n_dec, predicted, reason)
        return self.last

    def _largest_prefill(self, n_dec: int, context: int, prefill_ctx: int, seconds: float) -> int:
        """Largest prefill tokens p (a multiple of the block size) with predicted time <= seconds."""
        a, b, c, d, e = self.model.coef  # type: ignore[union-attr]
        room = seconds - (a + c * n_dec + d * context)
        if room <= 0:
            return 0
        # e*p^2/2 + (b + e*(prefill_ctx + 1/2))*p <= room
        lin = b + e * (prefill_ctx + 0.5)
        if e > 0:
            p = (-lin + math.sqrt(lin * lin + 2 * e * room)) / e
        elif lin > 0:
            p = room / lin
        else:  # the model sees no cost in prefill tokens: nothing bounds p but the upper bound
            p = float(AUTO_MAX_BATCHED_TOKENS * 4)
        return int(p) // self.block_size * self.block_size

    def _predict_ms(self, n_dec: int, context: int, prefill: int, prefill_ctx: int) -> float:
        if self.model is None:
            return 0.0
        seqs = [(1, context // max(1, n_dec), 0)] * n_dec if n_dec else []
        if prefill > 0:
            seqs.append((prefill, prefill_ctx, prefill_ctx + prefill + 1))
        return self.model.predict(seqs) * self.headroom * 1e3
