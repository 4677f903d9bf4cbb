"""A step-time cost model: time of one step from what the step computes.

    t = a + b * prefill_tokens + c * decode_tokens + d * decode_context + e * prefill_attention

prefill_tokens   tokens of prefill chunks (and recomputation after a preemption)
decode_tokens    one per decoding sequence
decode_context   sum over decodes of the context each one reads (its computed tokens)
prefill_attention sum over chunks of n * (computed + (n + 1) / 2): the query-key pairs a chunk of
                  n new tokens after `computed` cached ones attends to

Fitted by least squares (plain Python, normal equations on column-scaled features) from a
step trace (`chunkserve tune`) or from the steps a server just ran (the auto token budget,
scheduler_svc/budget.py); a coefficient that comes out negative is dropped and the rest
refitted, so the model never predicts that more work takes less time. The same `features()` turns a trace
line and a replayed plan into a vector, so what is fitted is exactly what is predicted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

WARM_UP_STEPS = 10  # a trace's first steps: left out of the replayed spread (see CostModel.fit)
FEATURES = ("const", "prefill_tokens", "decode_tokens", "decode_context", "prefill_attention")


def attention_pairs(n: int, computed: int) -> int:
    """Query-key pairs of n new tokens after `computed` ones: n * (computed + (n + 1) / 2), the
    same whether they run as one chunk or several (token i of them attends to computed + i + 1)."""
    return n * computed + n * (n + 1) // 2


def features(seqs: Iterable[tuple[int, int, int]]) -> list[float]:
    """The model's feature vector from (new tokens, computed tokens before, prompt tokens) per
    sequence of a step. A decode is one token past the prompt; anything else is prefill-like."""
    prefill = decode = decode_ctx = prefill_attn = 0.0
    for n, computed, prompt in seqs:
        if n == 1 and computed >= prompt:
            decode += 1
            decode_ctx += computed
        else:
            prefill += n
            prefill_attn += attention_pairs(n, computed)
    return [1.0, prefill, decode, decode_ctx, prefill_attn]


@dataclass(slots=True)
class TraceStep:
    """One step of a recorded trace: its feature vector and its measured time in seconds."""

    x: list[float]
    seconds: float


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular column gets coefficient 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            continue
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


def least_squares(xs: Sequence[Sequence[float]], ys: Sequence[float], active: Sequence[int]) -> list[float]:
    """Least-squares coefficients over the active columns (others 0), columns scaled to unit max."""
    k = len(xs[0])
    scale = [max((abs(x[j]) for x in xs), default=0.0) or 1.0 for j in range(k)]
    cols = list(active)
    ata = [[sum(x[i] * x[j] / (scale[i] * scale[j]) for x in xs) for j in cols] for i in cols]
    atb = [sum(x[i] / scale[i] * y for x, y in zip(xs, ys)) for i in cols]
    # A tiny ridge keeps a column that never varies (no decodes in the trace) from blowing up.
    for i in range(len(cols)):
        ata[i][i] += 1e-9 * len(xs)
    sol = _solve(ata, atb)
    coef = [0.0] * k
    for c, v in zip(cols, sol):
        coef[c] = v / scale[c]
    return coef


@dataclass(slots=True)
class CostModel:
    """Seconds per step as a linear function of `features()`."""

    coef: list[float]
    min_seconds: float = 0.0  # floor of a prediction (the smallest step seen)
    # measured / predicted of the trace's steps (warm-up left out): the spread a real server shows
    # around the model (other processes on its cores, caches), for `noisy()`.
    ratios: list[float] = field(default_factory=list)

    @classmethod
    def fit(cls, steps: Sequence[TraceStep], trim: float = 8.0) -> CostModel:
        """Least squares, then once more without the outliers: steps whose absolute residual
        exceeds `trim` times the median one and that are off by more than their prediction
        (a server's first steps warm up for seconds). Noise proportional to the step's size
        is kept: that is the spread `noisy()` replays. trim=0 keeps all."""
        model = cls._fit(steps)
        if trim > 0 and len(steps) > 10:
            res = [abs(model.predict_x(s.x) - s.seconds) for s in steps]
            limit = trim * quantile(res, 0.5)
            kept = [s for s, r in zip(steps, res) if r <= limit or r <= model.predict_x(s.x)]
            if len(steps) // 2 <= len(kept) < len(steps):
                model = cls._fit(kept)
        # Every step's ratio, the outliers' too (they are rare, and real time the requests
        # waited, which `noisy()` should replay), except the server's first steps: its warm-up
        # (first forward passes, allocations) does not recur.
        warm_up = min(WARM_UP_STEPS, len(steps) // 10)
        model.ratios = [s.seconds / p for s in steps[warm_up:] if (p := model.predict_x(s.x)) > 0]
        return model

    @classmethod
    def fit_relative(cls, steps: Sequence[TraceStep], trim: float = 3.0) -> CostModel:
        """Least squares on relative error (each step weighted by 1 / its time), then once more
        without the steps whose relative residual exceeds `trim` times the median one (and 25%).
        For a model fitted online on a busy machine: there a few steps take many times their
        usual time, and plain least squares, which weighs a 10 s step's error 100x a 1 s
        step's, would let them decide the fit."""
        model = cls._fit(steps, relative=True)
        if trim > 0 and len(steps) > 10:
            rel = [abs(model.predict_x(s.x) / s.seconds - 1) for s in steps]
            limit = max(0.25, trim * quantile(rel, 0.5))
            kept = [s for s, r in zip(steps, rel) if r <= limit]
            if len(steps) // 2 <= len(kept) < len(steps):
                model = cls._fit(kept, relative=True)
        return model

    def noisy(self, seed: int = 0) -> Callable[[Iterable[tuple[int, int, int]]], float]:
        """A predictor that multiplies each step's prediction by a ratio drawn (seeded) from
        the fit's measured/predicted ratios: the trace's own spread, so that tail latencies
        (P99 ITL) are predicted and not only medians. Without ratios, `predict` itself."""
        if not self.ratios:
            return self.predict
        rng = random.Random(seed)
        ratios = self.ratios
        return lambda seqs: self.predict(seqs) * ratios[rng.randrange(len(ratios))]

    @classmethod
    def _fit(cls, steps: Sequence[TraceStep], relative: bool = False) -> CostModel:
        if len(steps) < 2:
            raise ValueError(f"need at least 2 traced steps to fit a cost model, got {len(steps)}")
        if relative:  # rows scaled by 1 / time: the residuals are relative errors
            xs, ys = [[v / s.seconds for v in s.x] for s in steps], [1.0] * len(steps)
        else:
            xs, ys = [s.x for s in steps], [s.seconds for s in steps]
        active = list(range(len(FEATURES)))
        while True:
            coef = least_squares(xs, ys, active)
            negative = [j for j in active if j > 0 and coef[j] < 0]
            if negative:
                active.remove(min(negative, key=lambda j: coef[j] * max(x[j] for x in xs)))
            elif coef[0] < 0 and len(active) > 1:  # through the origin rather than negative time
                active.remove(0)
            else:
                break
        return cls(coef, min_seconds=min(s.seconds for s in steps) * 0.5)

    def predict_x(self, x: Sequence[float]) -> float:
        return max(self.min_seconds, sum(c * v for c, v in zip(self.coef, x)))

    def predict(self, seqs: Iterable[tuple[int, int, int]]) -> float:
        return self.predict_x(features(seqs))

    def describe(self) -> str:
        units = {"const": "ms", "prefill_tokens": "ms/token", "decode_tokens": "ms/token"}
        parts = []
        for name, c in zip(FEATURES, self.coef):
            parts.append(f"{name} {c * 1e3:.4g} {units.get(name, 'ms/unit')}")
        return ", ".join(parts)


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
