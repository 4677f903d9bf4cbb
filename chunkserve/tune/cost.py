"""Cost-model helpers of `chunkserve tune`: reading a step trace, held-out error of a fit.

The model itself (`CostModel`, `features`) lives in scheduler_svc/step_cost.py: the server's
auto token budget fits the same model online, so the tuner and the server predict alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from scheduler_svc.step_cost import FEATURES, WARM_UP_STEPS, CostModel, TraceStep, features, quantile

__all__ = [
    "FEATURES",
    "WARM_UP_STEPS",
    "CostModel",
    "TraceStep",
    "features",
    "fit_with_error",
    "load_trace",
    "quantile",
    "relative_errors",
    "split_holdout",
]


def _get(d: dict, camel: str, snake: str, default=0):
    """A field of a trace line: protobuf's JSON is camelCase and omits zeros; int64 is a string."""
    v = d.get(camel, d.get(snake, default))
    return default if v is None else v


def load_trace(path: str | Path, target: str = "step") -> list[TraceStep]:
    """Steps of a `--step-trace-file` (JSON lines). target: 'step' (planning to result applied,
    what requests see) or 'executor' (the executor's own time)."""
    key = ("stepNs", "step_ns") if target == "step" else ("executorNs", "executor_ns")
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            ns = int(_get(d, *key))
            seqs = [
                (
                    int(_get(s, "numTokens", "num_tokens")),
                    int(_get(s, "numComputedTokens", "num_computed_tokens")),
                    int(_get(s, "numPromptTokens", "num_prompt_tokens")),
                )
                for s in _get(d, "seqs", "seqs", [])
            ]
            if ns > 0 and seqs:
                out.append(TraceStep(features(seqs), ns / 1e9))
    return out


def relative_errors(model: CostModel, steps: Sequence[TraceStep]) -> list[float]:
    return [abs(model.predict_x(s.x) - s.seconds) / s.seconds for s in steps if s.seconds > 0]


def split_holdout(steps: Sequence[TraceStep], every: int = 5) -> tuple[list[TraceStep], list[TraceStep]]:
    """Every `every`-th step held out (deterministic, spread over the whole trace)."""
    train = [s for i, s in enumerate(steps) if i % every != every - 1]
    test = [s for i, s in enumerate(steps) if i % every == every - 1]
    return train, test


def fit_with_error(steps: Sequence[TraceStep]) -> tuple[CostModel, float, float, int]:
    """Fits on 4/5 of the steps, reports median and P90 absolute relative error on the held-out
    fifth, then refits on all steps for the model that is returned."""
    train, test = split_holdout(steps)
    if len(train) >= 2 and test:
        errs = relative_errors(CostModel.fit(train), test)
    else:
        errs = []
    return CostModel.fit(steps), quantile(errs, 0.5), quantile(errs, 0.9), len(test)
