"""The kernel plan measured on this machine at start-up (`--cpu-linear-plan measure`, the
default on CPU) instead of read from the tables (models/kernel_plan.py has the Plan itself).

Why measure: the fastest kernel per row count differs by CPU far more than a feature flag
predicts. On the three 2-core machines measured so far (benchmarks/RESULTS.md, "A linear
plan measured at start-up"), the default model's linears applied once at one row took:
AVX2 EPYC float32 35 ms as it is vs 24 padded to 2 rows (so `padded_rows` pads); AVX512-BF16
EPYC (Zen 4) float32 20 vs bfloat16 10; AMX Xeon float32 19-26 as it is vs 50-55 padded (the
padding rule of the first machine doubles the third's batch-1 step) and bfloat16 24, no
faster than float32 there although it has the "native" bfloat16 instruction the tables key
on. A table per CPU class needs a new row for every new class and is wrong where one class
hides two behaviours (MKL on AMD vs Intel); a measurement costs 15-25 s once per machine.

What is measured: for each bucket of row counts (`buckets_for`; a step of M rows takes the
plan of the smallest bucket >= M), every candidate kernel that the loaded copies allow
(`kernel_plan.candidates`) runs all of the model's decoder linears on one input of that many
rows (the whole model, so that the weights stream from memory as they do in a step, not from
a cache that one layer would fit in), and the vocabulary head separately. The buckets reach
the executor's token budget, so a prefill chunk takes a kernel measured at its size, never
one extrapolated from decode sizes (a plan that stopped at 128 rows sent bfloat16's 2K-token
chunks to the 16-bit copies, measured 1.8x slower there than float32); from `LARGE_FROM`
rows, where a step is bound by arithmetic rather than weight reads, one layer's linears
stand for the model's, `LARGE_REPS` rounds. The minimum over `reps` rounds counts (noise on
a shared machine only adds time); each round runs every candidate of every bucket in turn,
so a candidate's runs are spread over the whole measurement and a burst of load or a slow
minute falls on all of them alike. The kernel that wins keeps the bucket, except that an
earlier candidate (float32 before a reduced copy, the plain product before padding or
packing) stays unless a later one is at least `MARGIN` faster (`kernel_plan.choose`). Each
kernel computes float32 products or the mode's reduced ones, so the plan changes speed, not
the mode's contract: float32 kernels differ from one another in the last bits only (they
already did between row counts); the reduced kernels are the mode's measured agreement with
float32 (int4 capped to steps of `INT4_MAX_ROWS`: prefilling through int4 loses too much,
see models/quant.py).

A reduced mode's plan (int4, bfloat16, float16) starts from float32's: the plan a float32
server on this machine keeps (measured first where there is none), and only the reduced copies
are timed, against that plan's kernel per bucket. Where none wins by MARGIN the mode runs
float32's very kernels, so it is not slower than float32 through two measurements' noise (two
independent ones gave bfloat16 "mm" and float32 "packed" at 13-16 rows, and "mm" also takes a
decode step off the fused path: bfloat16's 16-sequence decode step 1.15x float32's on a 2-core
AVX2 EPYC, benchmarks/RESULTS.md).

The plan is kept in the cache folder (`linear-plans/<key>.json` under --cache-dir), keyed by
what it depends on (`plan_key`: the CPU's model name and features, torch's version and
thread count, the linears' shapes, the weight mode, the candidates allowed and the buckets):
a later start on the same machine reads it instead of measuring again, and restarts keep one
plan, so a reduced mode's tokens do not change between restarts with the noise of a
measurement. `--cpu-linear-plan remeasure` measures again and replaces the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunkserve_contracts.cpu import CpuTimes, cpu_info, cpu_times
from chunkserve_kernels import cpu_native
from executor_svc.models.kernel_plan import GEMV_MAX_ROWS, INT4_MAX_ROWS, KERNELS, MARGIN, Plan, candidates, choose

log = logging.getLogger(__name__)

BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)  # decode-sized steps, the head's rows
LARGE_FROM = 256  # buckets from here are prefill chunks: one layer's linears, LARGE_REPS rounds
LARGE_BUCKETS: tuple[int, ...] = (256, 512, 1024, 2048)  # measured up to the budget (2048 at most)
LARGE_REPS = 3
REDUCED_KERNELS = ("reduced", "half-onednn")  # what a reduced mode times against float32's plan
# A decode step whose linears are all "packed" or "gemv" / "gemv-stream" runs as one fused native call
# (models/fused.py); one on "mm" / "mm-pad" runs layer by layer. Timed alone the two products
# are within a few percent at 12-64 rows, but in a whole decode step "mm" was 1.07-1.47x slower
# (2-core AVX2 EPYC, benchmarks/RESULTS.md): at decode sizes with the fused path loaded, "mm"
# and "mm-pad" keep a bucket from a fused kernel only when FUSED_MARGIN faster alone.
FUSED_KERNELS = ("packed", "gemv-stream", "gemv")
FUSED_MARGIN = 0.2
OTHERS_MAX = 0.2  # a measurement while other processes used more of our CPUs is not kept
SPREAD_MAX = 1.25  # nor one whose repeats disagree more (`disturbance`)
PLAN_FORMAT = 5  # bump when what a stored plan means changes (kernels, bucket semantics, tie rules)


def buckets_for(budget: int, part: str = "linears") -> tuple[int, ...]:
    """The buckets of `part` ("linears" or "head") for an executor whose steps carry at most
    `budget` tokens: the decoder linears' reach the budget (2048 at most: beyond it a step is
    long bound by arithmetic, and the ratios between kernels hold); the head's stop at 128
    (it computes only the rows that sample, one per sequence)."""
    sizes = (*BUCKETS, *LARGE_BUCKETS) if part == "linears" else BUCKETS
    top = min(budget, sizes[-1])
    return tuple(sorted({b for b in sizes if b < top} | {top}))


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
    disturbed: str | None = None  # why the timings cannot be trusted (`disturbance`), None when fair

    def table(self) -> str:
        """One line per part and bucket: each candidate's milliseconds, the choice starred."""
        lines = []
        for (part, m), costs in self.costs.items():
            chosen = (self.body if part == "linears" else self.head)(m)
            cells = [f"{k}{'*' if k == chosen else ''} {v * 1e3:.1f}" for k, v in costs.items()]
            lines.append(f"{part:7} {m:4}: " + "  ".join(cells))
        return "\n".join(lines)


Work = dict[tuple[str, int], tuple[Callable[[], Any], dict[str, Callable[[], Any]]]]


@torch.inference_mode()
def measure(
    model: Any,
    *,
    reduced: str | None = None,
    reduced_max_rows: int | None = None,
    padding: bool = True,
    gemv: bool = False,
    budget: int = LARGE_BUCKETS[-1],
    clock: Clock | None = None,
    reps: int = 5,
    cpu: Callable[[], CpuTimes | None] | None = None,
    base: tuple[Plan, Plan] | None = None,
) -> Measured:
    """Times every candidate kernel per bucket on `model` (a LlamaForCausalLM on CPU, its
    copies loaded: `Linear.packed`, `Linear.reduced`, the head's too) and returns the plans;
    `reduced` names the mode of the reduced copies ("int4", "bfloat16", "float16", or None);
    `gemv` whether the native library's product is a candidate (loaded, --cpu-kernels not
    torch); `budget` the executor's largest step. `clock` (tests) replaces the timing, `cpu`
    the reading of what other processes ran meanwhile (by default read only with the real clock).
    `base` (float32's body and head plans) narrows each bucket to its kernel and the reduced ones."""
    t0 = time.perf_counter()
    cpu = cpu or (cpu_times if clock is None else lambda: None)
    before = cpu()
    linears = model.decoder_linears()
    opts = dict(padding=padding, reduced_max_rows=reduced_max_rows, gemv=gemv)
    work: Work = {}
    gen = torch.Generator().manual_seed(0)
    for m in buckets_for(budget, "linears"):
        part = linears if m < LARGE_FROM else [lin for lin in model.model.layers[0].modules() if lin in linears]
        xs = {n: torch.randn(m, n, generator=gen) for n in {lin.weight.shape[1] for lin in part}}
        kernels = candidates(m, packed=all(lin.packed is not None for lin in part), reduced=reduced, **opts)
        kernels = kernels if base is None else _against(base[0](m), kernels)
        work[("linears", m)] = _nothing, {k: lambda k=k, p=part, xs=xs: _run(p, k, xs) for k in kernels}
    head = model.lm_head
    flush_x = {n: torch.randn(1, n, generator=gen) for n in {lin.weight.shape[1] for lin in linears}}
    # What precedes the head in a step, the decoder's linears (one row, float32): without it
    # the head, timed alone and repeatedly, would stay in a large L3 cache (113 MB in float32
    # for the default model) and look faster than in a step, the more so the more bytes it
    # reads (measured: float32's head 3.4 ms vs bfloat16's 4.0 without).
    flush = lambda: _run(linears, "mm", flush_x)  # noqa: E731
    head_mode = None if head.reduced is None else "bfloat16"  # int4's head copy is 16-bit
    for m in buckets_for(budget, "head"):
        h = {head.weight.shape[1]: torch.randn(m, head.weight.shape[1], generator=gen)}
        kernels = candidates(m, packed=head.packed is not None, reduced=head_mode, **opts | _head_cap(reduced, opts))
        kernels = kernels if base is None else _against(base[1](m), kernels)
        work[("head", m)] = flush, {k: lambda k=k, h=h: _run([head], k, h) for k in kernels}
    samples = _rounds(work, clock or wall_clock, reps)
    after = cpu()
    others = None if before is None or after is None else after.others_share(before)
    costs = {key: {k: min(v) for k, v in runs.items()} for key, runs in samples.items()}
    fused = {m: _fused_bias(c, gemv and m < LARGE_FROM) for (part, m), c in costs.items() if part == "linears"}
    body = Plan(*zip(*((m, choose(c, rows=m)) for m, c in fused.items()), strict=True))
    head_plan = Plan(*zip(*((m, choose(c, rows=m)) for (part, m), c in costs.items() if part == "head"), strict=True))
    return Measured(body, head_plan, costs, time.perf_counter() - t0, disturbance(samples, others))


def disturbance(samples: dict[tuple[str, int], dict[str, list[float]]], others: float | None) -> str | None:
    """Why a measurement is not a fair one to keep, or None: other processes used more than
    OTHERS_MAX of our CPUs' time while it ran (a plan measured beside a test suite took 410-440 s
    instead of ~17 s, and its choices, which turn on margins of a few percent, were the load's),
    or its repeats disagree: the median over candidates of second-fastest / fastest run above
    SPREAD_MAX (bursts of load; on an idle machine the repeats agree within a few percent)."""
    if others is not None and others > OTHERS_MAX:
        return f"other processes used {others:.0%} of this process's CPUs while it measured"
    spreads = sorted(
        sorted(runs)[1] / sorted(runs)[0] for c in samples.values() for runs in c.values() if len(runs) > 1
    )
    spread = spreads[len(spreads) // 2] if spreads else 1.0
    if spread > SPREAD_MAX:
        return f"its repeats disagree (second-fastest / fastest run: median {spread:.2f})"
    return None


def _fused_bias(costs: dict[str, float], fused: bool) -> dict[str, float]:
    """The costs `choose` compares: with the fused decode path loaded (`fused`) and a fused
    kernel measured, the unfused float32 products' divided by 1 - FUSED_MARGIN."""
    if not fused or not any(k in FUSED_KERNELS for k in costs):
        return costs
    return {k: v / (1 - FUSED_MARGIN) if k in ("mm", "mm-pad") else v for k, v in costs.items()}


def _against(float32_kernel: str, kernels: list[str]) -> list[str]:
    """A bucket's candidates in a reduced mode: float32's planned kernel, then the reduced copies."""
    return [float32_kernel, *(k for k in kernels if k in REDUCED_KERNELS)]


@contextmanager
def float32_only(model: Any) -> Iterator[None]:
    """The model as a float32 executor loads it: its reduced copies hidden meanwhile."""
    parts = [*model.decoder_linears(), model.lm_head]
    kept = [lin.reduced for lin in parts]
    for lin in parts:
        lin.reduced = None
    try:
        yield
    finally:
        for lin, reduced in zip(parts, kept, strict=True):
            lin.reduced = reduced


def _head_cap(reduced: str | None, opts: dict[str, Any]) -> dict[str, Any]:
    """int4's head copy is 16-bit and any step may take it; a 16-bit mode's cap holds for its head too."""
    return {"reduced_max_rows": None} if reduced == "int4" else {}


def _run(linears: list[Any], kernel: str, xs: dict[int, torch.Tensor]) -> None:
    for lin in linears:
        lin.apply_kernel(xs[lin.weight.shape[1]], kernel)


def _rounds(work: Work, clock: Clock, reps: int) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Each candidate's timed runs. One warm-up run of each, then `reps` rounds over everything
    (LARGE_REPS for the large buckets): a candidate's runs are spread over the whole measurement
    (seconds), not over the ~1 s of its bucket, and the candidates of a bucket take turns, so
    neither a burst of load nor a slow minute on a shared machine lands on one candidate alone
    (noise only adds time: the fastest counts)."""
    for _, runs in work.values():
        for run in runs.values():
            run()
    samples: dict[tuple[str, int], dict[str, list[float]]] = {
        key: {k: [] for k in runs} for key, (_, runs) in work.items()
    }
    for rep in range(reps):
        for (part, m), (before, runs) in work.items():
            if m >= LARGE_FROM and rep >= LARGE_REPS:
                continue
            for k, run in runs.items():
                samples[(part, m)][k].append(clock(part, k, m, run, before))
    return samples


def plan_key(
    model: Any,
    *,
    reduced: str | None,
    reduced_max_rows: int | None,
    padding: bool,
    gemv: bool = False,
    budget: int = LARGE_BUCKETS[-1],
    base: tuple[Plan, Plan] | None = None,
) -> dict[str, Any]:
    """What a measured plan depends on, as stored beside it; its hash names the file."""
    linears, head = model.decoder_linears(), model.lm_head
    return {
        "format": PLAN_FORMAT,
        "cpu": cpu_info().describe(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "linears": sorted([*shape, n] for shape, n in Counter(tuple(lin.weight.shape) for lin in linears).items()),
        "head": list(head.weight.shape),
        "reduced": reduced,
        "reduced_max_rows": reduced_max_rows,
        "padding": padding,
        "packed": bool(linears) and all(lin.packed is not None for lin in linears),
        "head_packed": head.packed is not None,
        "head_reduced": head.reduced is not None,
        "gemv": gemv,
        # the native library's build (its sources hashed): a changed few-row product is timed anew
        "native_build": cpu_native.build_name() if gemv else None,
        "gemv_max_rows": GEMV_MAX_ROWS,
        "buckets": list(buckets_for(budget, "linears")),
        "head_buckets": list(buckets_for(budget, "head")),
        "large": [LARGE_FROM, LARGE_REPS],
        "kernels": list(KERNELS),
        "margin": MARGIN,
        "int4_max_rows": INT4_MAX_ROWS,
        "fused_margin": FUSED_MARGIN,
        "float32_plan": None if base is None else [list(base[0].kernels), list(base[1].kernels)],
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
        if stored["key"] != json.loads(json.dumps(key)):
            return None
        body = Plan(tuple(stored["buckets"]), tuple(stored["body"]))
        head = Plan(tuple(stored["head_buckets"]), tuple(stored["head"]))
        if list(body.buckets) != key["buckets"] or list(head.buckets) != key["head_buckets"]:
            return None
        return body, head
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
        "head_buckets": list(measured.head.buckets),
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
    budget: int = LARGE_BUCKETS[-1],
) -> tuple[tuple[Plan, Plan] | None, str]:
    """The (body, head) plans for `model`: the one kept in `folder` for this key, else (or
    with `remeasure`) a new measurement, kept there for the next start; and where it came
    from, for the log. A folder that cannot be written costs only the keeping. None when the
    measurement was disturbed (`disturbance`): nothing is kept, and the caller serves the
    tables, the conservative choice, until a later start measures on a quieter machine."""
    kw: dict[str, Any] = dict(reduced=reduced, reduced_max_rows=reduced_max_rows, padding=padding, gemv=gemv)
    kw["budget"] = budget
    if reduced is not None:  # float32's plan first: the reduced copies are timed against it
        with float32_only(model):
            float32_kw = kw | dict(reduced=None, reduced_max_rows=None)
            base, base_source = kept_or_measured(model, folder, remeasure=remeasure, **float32_kw)
        if base is None:
            return None, f"float32's {base_source}"
        kw["base"] = base
    key = plan_key(model, **kw)
    path = plan_file(folder, key)
    plans = None if remeasure else load_plan(path, key)
    if plans is not None:
        return plans, f"read from {path} (--cpu-linear-plan remeasure measures again)"
    measured = measure(model, **kw)
    log.debug("CPU linear plan, ms per candidate:\n%s", measured.table())
    if measured.disturbed:
        return None, (
            f"not kept: {measured.disturbed} (measured in {measured.seconds:.1f} s); this start serves "
            "the tables, the next one measures again"
        )
    try:
        store_plan(path, key, measured)
        source = f"measured in {measured.seconds:.1f} s, kept in {path}"
    except OSError as e:
        source = f"measured in {measured.seconds:.1f} s (not kept: {e})"
    return (measured.body, measured.head), source
