"""Which kernel computes a CPU linear for a step of M token rows, measured on this machine at
start-up (`--cpu-linear-plan measure`, the default on CPU) instead of read from a table.

Why measure: the fastest kernel per row count differs by CPU far more than a feature flag
predicts. On the three 2-core machines measured so far (benchmarks/RESULTS.md, "A linear
plan measured at start-up"), the default model's linears applied once at one row took:
AVX2 EPYC float32 35 ms as it is vs 24 padded to 2 rows (so `padded_rows` pads); AVX512-BF16
EPYC (Zen 4) float32 20 vs bfloat16 10; AMX Xeon float32 19-26 as it is vs 50-55 padded (the
padding rule of the first machine doubles the third's batch-1 step) and bfloat16 24, no
faster than float32 there although it has the "native" bfloat16 instruction the tables key
on. A table per CPU class needs a new row for every new class and is wrong where one class
hides two behaviours (MKL on AMD vs Intel); a measurement costs 15-25 s once per machine.

What is measured: for each bucket of row counts (`BUCKETS`; a step of M rows takes the
plan of the smallest bucket >= M, the last one above it), every candidate kernel that the
loaded copies allow (`candidates`) runs all of the model's decoder linears on one input of
that many rows (the whole model, so that the weights stream from memory as they do in a
step, not from a cache that one layer would fit in), and the vocabulary head separately;
the minimum over `reps` rounds counts (noise on a shared machine only adds time); each
round runs every candidate of every bucket in turn, so a candidate's runs are spread over
the whole measurement and a burst of load or a slow minute falls on all of them alike. The
kernel that wins keeps the bucket, except that an earlier candidate (float32 before a
reduced copy, the plain product before padding or packing) stays unless a later one is at
least `MARGIN` faster (`choose`). Each kernel computes float32 products or the mode's
reduced ones, so the plan changes speed, not the mode's contract: float32 kernels differ
from one another in the last bits only (they already did between row counts); the reduced
kernels are the mode's measured agreement with float32 (int4 capped to steps of
`INT4_MAX_ROWS`: prefilling through int4 loses too much, see models/quant.py).

The plan is kept in the cache folder (`linear-plans/<key>.json` under --cache-dir), keyed by
what it depends on (`plan_key`: the CPU's model name and features, torch's version and
thread count, the linears' shapes, the weight mode and the candidates allowed): a later
start on the same machine reads it instead of measuring again (a file read instead of 17 s
for float32 to 24 s for int4, the default model on 2 cores), and restarts keep one plan, so
a reduced mode's tokens do not change between restarts with the noise of a measurement.
`--cpu-linear-plan remeasure` measures again and replaces the file (after a change the key
cannot see: a BIOS setting, a busier or quieter machine).

`--cpu-linear-plan table` keeps the measured-per-class tables (`padded_rows`,
`PREPACK_MIN_ROWS`, models/quant.ROW_RULES) and skips the measurement (tests that pin a
path use it; so does tensor parallelism, whose ranks would have to agree on one plan).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executor_svc.models.layers import Linear, padded_rows

log = logging.getLogger(__name__)

BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# preference order: an earlier kernel keeps a bucket unless a later one is MARGIN faster
KERNELS = ("mm", "mm-pad", "packed", "gemv", "reduced", "half-onednn")
MARGIN = 0.05
INT4_MAX_ROWS = 32
# the native few-row product (kernels/csrc/cpu_linear.cpp) is a candidate up to this many rows:
# from ~4 on oneDNN's packed product, which reuses each weight line across rows, wins
GEMV_MAX_ROWS = 4
PLAN_FORMAT = 1  # bump when what a stored plan means changes (kernels, bucket semantics)


@dataclass(frozen=True, slots=True)
class Plan:
    """The kernel for a step of `m` rows: that of the smallest bucket >= m (the last above)."""

    buckets: tuple[int, ...]
    kernels: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.buckets) != len(self.kernels) or not self.buckets:
            raise ValueError("a plan needs one kernel per bucket")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"plan buckets must be increasing and >= 1, got {self.buckets}")

    def __call__(self, m: int) -> str:
        return self.kernels[min(bisect.bisect_left(self.buckets, m), len(self.buckets) - 1)]

    def __str__(self) -> str:
        """Runs of equal kernels, e.g. "1: mm, 2-4: reduced, 5+: packed"."""
        parts, start = [], 1
        for i, (b, k) in enumerate(zip(self.buckets, self.kernels, strict=True)):
            last = i == len(self.buckets) - 1
            if last or self.kernels[i + 1] != k:
                span = f"{start}+" if last else (str(b) if b == start else f"{start}-{b}")
                parts.append(f"{span}: {k}")
                start = b + 1
        return ", ".join(parts)


def choose(costs: dict[str, float], margin: float = MARGIN) -> str:
    """The kernel for one bucket from its measured seconds: walk the candidates in KERNELS
    order; a later one replaces the current choice only if it is faster by more than
    `margin` (a tie keeps the exact-float32, unpadded, unpacked kernel)."""
    best = None
    for k in sorted(costs, key=KERNELS.index):
        if best is None or costs[k] < costs[best] * (1 - margin):
            best = k
    if best is None:
        raise ValueError("no candidate kernel was measured")
    return best


def candidates(
    m: int, *, padding: bool, packed: bool, reduced: str | None, reduced_max_rows: int | None, gemv: bool = False
) -> list[str]:
    """The kernels worth timing at `m` rows given the copies loaded: "mm-pad" only where
    `padded_rows` changes m; "gemv" (the native library's, where it loaded) up to
    GEMV_MAX_ROWS; "reduced" within the mode's row cap (--quantized-max-rows, or
    INT4_MAX_ROWS for int4); "half-onednn" only from 12 rows (below it `half_linear` is
    oneDNN's F.linear already, or at one row the GEMV that beats it)."""
    out = ["mm"]
    if padding and padded_rows(m) != m:
        out.append("mm-pad")
    if packed:
        out.append("packed")
    if gemv and m <= GEMV_MAX_ROWS:
        out.append("gemv")
    cap = reduced_max_rows if reduced_max_rows is not None else (INT4_MAX_ROWS if reduced == "int4" else None)
    if reduced is not None and (cap is None or m <= cap):
        out.append("reduced")
        if reduced != "int4" and m >= 12:
            out.append("half-onednn")
    return out


# (part, kernel, rows, run, before) -> seconds of one `run`; `before` runs untimed ahead of it
Clock = Callable[[str, str, int, Callable[[], Any], Callable[[], Any]], float]


def wall_clock(part: str, kernel: str, m: int, run: Callable[[], Any], before: Callable[[], Any]) -> float:
    """Seconds of one `run`, after an untimed `before`."""
    before()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _nothing() -> None:
    return None


@dataclass
class Measured:
    body: Plan
    head: Plan
    costs: dict[tuple[str, int], dict[str, float]]  # (part, bucket) -> kernel -> seconds
    seconds: float  # the measurement's own wall time

    def table(self) -> str:
        """One line per part and bucket: each candidate's milliseconds, the choice starred."""
        lines = []
        for (part, m), costs in self.costs.items():
            chosen = (self.body if part == "linears" else self.head)(m)
            cells = [f"{k}{'*' if k == chosen else ''} {v * 1e3:.1f}" for k, v in costs.items()]
            lines.append(f"{part:7} {m:4}: " + "  ".join(cells))
        return "\n".join(lines)


def decoder_linears(model: torch.nn.Module) -> list[Linear]:
    """Every Linear of the decoder layers (the head is measured on its own)."""
    return [m for name, m in model.named_modules() if isinstance(m, Linear) and "lm_head" not in name]


@torch.inference_mode()
def measure(
    model: Any,
    *,
    reduced: str | None = None,
    reduced_max_rows: int | None = None,
    padding: bool = True,
    gemv: bool = False,
    buckets: Sequence[int] = BUCKETS,
    clock: Clock | None = None,
    reps: int = 5,
) -> Measured:
    """Times every candidate kernel per bucket on `model` (a LlamaForCausalLM on CPU, its
    copies loaded: `Linear.packed` / `head_packed`, `Linear.reduced` / `head_reduced`) and
    returns the plans; `reduced` names the mode of the reduced copies ("int4", "bfloat16",
    "float16", or None); `gemv` whether the native library's product is a candidate (loaded,
    --cpu-kernels not torch). `clock` (tests) replaces the timing."""
    t0 = time.perf_counter()
    clock = clock or wall_clock
    linears = decoder_linears(model)
    packed = bool(linears) and all(lin.packed is not None for lin in linears)
    gen = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    widths = {lin.weight.shape[1] for lin in linears}
    one_row = {n: torch.randn(1, n, generator=gen) for n in widths}

    def flush() -> None:
        """What precedes the head in a step, the decoder's linears (one row, float32): without
        it the head, timed alone and repeatedly, would stay in a large L3 cache (113 MB in
        float32 for the default model) and look faster than in a step, the more so the more
        bytes it reads (measured: float32's head 3.4 ms vs bfloat16's 4.0 without)."""
        for lin in linears:
            lin.apply_kernel(one_row[lin.weight.shape[1]], "mm")

    def run_body(kernel: str, xs: dict[int, torch.Tensor]) -> None:
        for lin in linears:
            lin.apply_kernel(xs[lin.weight.shape[1]], kernel)

    # (part, bucket) -> (what runs untimed before each run, kernel -> run)
    work: dict[tuple[str, int], tuple[Callable[[], Any], dict[str, Callable[[], Any]]]] = {}
    for m in buckets:
        xs = {n: torch.randn(m, n, generator=gen) for n in widths}
        opts = candidates(
            m, padding=padding, packed=packed, reduced=reduced, reduced_max_rows=reduced_max_rows, gemv=gemv
        )
        work[("linears", m)] = _nothing, {k: lambda k=k, xs=xs: run_body(k, xs) for k in opts}
        h = torch.randn(m, hidden, generator=gen)
        head_opts = candidates(
            m,
            padding=padding,
            packed=model.head_packed is not None,
            reduced=None if model.head_reduced is None else "bfloat16",  # int4's head copy is 16-bit
            reduced_max_rows=reduced_max_rows if reduced != "int4" else None,
            gemv=gemv,
        )
        work[("head", m)] = flush, {k: lambda k=k, h=h: model.head_kernel(h, k) for k in head_opts}
    # One warm-up run of each, then `reps` rounds over everything: a candidate's runs are
    # spread over the whole measurement (seconds), not over the ~1 s of its bucket, and the
    # candidates of a bucket take turns, so neither a burst of load nor a slow minute on a
    # shared machine lands on one candidate alone (noise only adds time: the fastest counts).
    for _, runs in work.values():
        for run in runs.values():
            run()
    costs = {key: dict.fromkeys(runs, float("inf")) for key, (_, runs) in work.items()}
    for _ in range(reps):
        for (part, m), (before, runs) in work.items():
            for k, run in runs.items():
                costs[(part, m)][k] = min(costs[(part, m)][k], clock(part, k, m, run, before))
    body = Plan(tuple(buckets), tuple(choose(costs[("linears", m)]) for m in buckets))
    head = Plan(tuple(buckets), tuple(choose(costs[("head", m)]) for m in buckets))
    return Measured(body, head, costs, time.perf_counter() - t0)


def apply(model: Any, body: Plan, head: Plan) -> int:
    """Sets the plans on the model's decoder linears and head, and drops the packed float32
    copies no bucket chose (their memory: float32's weights once more); returns bytes freed."""
    freed = 0
    for lin in decoder_linears(model):
        lin.plan = body
        if "packed" not in body.kernels and lin.packed is not None:
            freed += lin.weight.nbytes
            lin.packed = None
    model.head_plan = head
    if "packed" not in head.kernels and model.head_packed is not None:
        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        freed += weight.nbytes
        model.head_packed = None
        if model.lm_head is not None:
            model.lm_head.packed = None
    return freed


def _cpu_name() -> str:
    """The CPU's model name and feature flags (two CPUs of one torch capability can want
    different plans: AVX512 on Zen 4 vs on an AMX Xeon, RESULTS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(
                line.split(":", 1)
                for line in f
                if ":" in line and line.split(":", 1)[0].strip() in ("model name", "flags")
            )
    except OSError:
        return platform.processor() or platform.machine()
    return " ".join(v.strip() for v in fields.values())


def plan_key(
    model: Any,
    *,
    reduced: str | None,
    reduced_max_rows: int | None,
    padding: bool,
    gemv: bool = False,
    buckets: Sequence[int] = BUCKETS,
) -> dict[str, Any]:
    """What a measured plan depends on, as stored beside it; its hash names the file."""
    linears = decoder_linears(model)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return {
        "format": PLAN_FORMAT,
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "linears": sorted([*shape, n] for shape, n in Counter(tuple(lin.weight.shape) for lin in linears).items()),
        "head": list(head.shape),
        "reduced": reduced,
        "reduced_max_rows": reduced_max_rows,
        "padding": padding,
        "packed": bool(linears) and all(lin.packed is not None for lin in linears),
        "head_packed": model.head_packed is not None,
        "head_reduced": model.head_reduced is not None,
        "gemv": gemv,
        "gemv_max_rows": GEMV_MAX_ROWS,
        "buckets": list(buckets),
        "kernels": list(KERNELS),
        "margin": MARGIN,
        "int4_max_rows": INT4_MAX_ROWS,
    }


def plan_file(folder: Path | str, key: dict[str, Any]) -> Path:
    """Where the plan for `key` is kept: named by the key's hash, so another CPU, thread
    count, model or mode gets a file of its own beside it."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder).expanduser() / f"{digest}.json"


def load_plan(path: Path, key: dict[str, Any]) -> tuple[Plan, Plan] | None:
    """The (body, head) plans stored at `path` for `key`, or None where there is no usable
    file (absent, unreadable, written for another key, or naming a kernel or buckets this
    version does not have: a hand edit that would otherwise fail every step)."""
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != json.loads(json.dumps(key)) or stored["buckets"] != key["buckets"]:
            return None
        if not set(stored["body"]) | set(stored["head"]) <= set(KERNELS):
            return None
        return Plan(tuple(stored["buckets"]), tuple(stored["body"])), Plan(
            tuple(stored["buckets"]), tuple(stored["head"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_plan(path: Path, key: dict[str, Any], measured: Measured) -> None:
    """Writes the plans with their key and each candidate's milliseconds (for a reader who
    wants to know why), atomically: a concurrent start reads the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "key": key,
        "buckets": list(measured.body.buckets),
        "body": list(measured.body.kernels),
        "head": list(measured.head.kernels),
        "seconds": round(measured.seconds, 2),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ms": {f"{part} {m}": {k: round(v * 1e3, 3) for k, v in c.items()} for (part, m), c in measured.costs.items()},
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def kept_or_measured(
    model: Any,
    folder: Path,
    *,
    remeasure: bool,
    reduced: str | None,
    reduced_max_rows: int | None,
    padding: bool,
    gemv: bool = False,
) -> tuple[tuple[Plan, Plan], str]:
    """The (body, head) plans for `model`: the one kept in `folder` for this key, else (or
    with `remeasure`) a new measurement, kept there for the next start; and where it came
    from, for the log. A folder that cannot be written costs only the keeping."""
    kw = dict(reduced=reduced, reduced_max_rows=reduced_max_rows, padding=padding, gemv=gemv)
    key = plan_key(model, **kw)
    path = plan_file(folder, key)
    plans = None if remeasure else load_plan(path, key)
    if plans is not None:
        return plans, f"read from {path} (--cpu-linear-plan remeasure measures again)"
    measured = measure(model, **kw)
    log.debug("CPU linear plan, ms per candidate:\n%s", measured.table())
    try:
        store_plan(path, key, measured)
        source = f"measured in {measured.seconds:.1f} s, kept in {path}"
    except OSError as e:
        source = f"measured in {measured.seconds:.1f} s (not kept: {e})"
    return (measured.body, measured.head), source
