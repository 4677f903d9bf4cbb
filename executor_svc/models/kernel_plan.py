"""Which kernel computes a CPU linear for a step of M token rows: the one place that decides.

A `Plan` maps a step's row count to a kernel name (`KERNELS`); every `Linear` of the model,
the vocabulary head included, computes through the plan it was given
(`LlamaForCausalLM.use_plan`), and the fused decode path asks the same plan whether a decode
step's linears are ones it can run. A plan comes from one of two places:

- measured on this machine at start-up (models/linear_plan.py, `--cpu-linear-plan measure`,
  the default on CPU), or
- built from the tables measured per CPU class (`table_plans`, `--cpu-linear-plan table`,
  tensor parallelism, CUDA): row padding (`padded_rows`), oneDNN's packed copies from
  `PREPACK_MIN_ROWS` rows, and a reduced-precision mode's row rule (models/quant.ROW_RULES).

Either way it is a Plan, so a step is dispatched the same way whatever made the plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

# preference order: an earlier kernel keeps a bucket unless a later one is MARGIN faster.
# "mm" / "mm-pad": `layers.linear` on the float32 weights without / with row padding;
# "packed": oneDNN's packed float32 copy; "gemv-stream" / "gemv": the native few-row float32
# product, one row of x read without / with software prefetch (the same arithmetic; which is
# faster depends on the machine's memory: chunkserve_kernels/csrc/cpu_linear.cpp); "reduced":
# the int4 or 16-bit copy as its class computes it; "half-onednn": the 16-bit copy through
# oneDNN's F.linear.
KERNELS = ("mm", "mm-pad", "packed", "gemv-stream", "gemv", "reduced", "half-onednn")
# At one row the native product comes before the padded and packed library ones: "mm-pad"
# computes a second, zero row through MKL's small-M sgemm, which reads ~28-30 GB/s however
# fast the memory is, while the one-row product reads at what the memory gives. On the 2-core
# EPYC the head at one row took 3.3-4.7 ms with "mm-pad" and 3.0-3.4 with "gemv-stream" while
# memory read ~33 GB/s, 4.0 against 2.5 at ~60 GB/s: a plan measured in the slow state saw a
# tie, and the tie kept "mm-pad" for every later state (benchmarks/RESULTS.md, "The head's
# one-row kernel").
ONE_ROW_ORDER = ("mm", "gemv-stream", "gemv", "mm-pad", "packed", "reduced", "half-onednn")
MARGIN = 0.05
INT4_MAX_ROWS = 32
# the native few-row product (chunkserve_kernels/csrc/cpu_linear.cpp) is a candidate up to this many rows
# (one pass over the weights for up to 8 rows of x: a verify step of 1 + 7 drafts); from ~4 on
# oneDNN's packed product, which reuses each weight line across rows, mostly wins
GEMV_MAX_ROWS = 8
# oneDNN's packed float32 product serves steps of at least this many rows in the tables
# (layers.prepack_weight has the measurements)
PREPACK_MIN_ROWS = 3


def padded_rows(m: int) -> int:
    """The row count the "mm-pad" kernel computes a float32 CPU product with for `m` rows.

    MKL's sgemm on AVX2 (8 floats a register) is fast only when the rows, the columns of
    (W @ x^T), fill its 8-wide blocks, and its GEMV is slower than its GEMM at 2 rows.
    Measured on a 2-core AVX2 EPYC, the default model's 121 linears applied once (ms):
    1 row 35, 2: 24, 3: 31, 4: 24, 5: 32, 6: 40, 7: 47, 8: 42, 9: 51, 12: 73, 15: 114,
    16: 53, 28: 95, 31: 137, 32: 76, 63: 202, 64: 132, 250: 491, 256: 423, 509: 988,
    512: 814 (benchmarks/RESULTS.md, "GEMM row padding"). So 1 -> 2, 3 -> 4, and from 7
    rows on the next multiple of 8; 2, 4, 5, 6 as they are. The padding rows are zeros and
    only their own output columns see them; a real row's result is the same computation
    at a different blocking (float32 rounding may differ in the last bit, as it already
    does between batch sizes)."""
    if m >= 7:
        return -(-m // 8) * 8
    return 2 if m == 1 else 4 if m == 3 else m


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
        unknown = set(self.kernels) - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown linear kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")

    @classmethod
    def of(cls, kernel: str) -> Plan:
        """One kernel for every step size."""
        return cls((1,), (kernel,))

    @classmethod
    def from_rule(cls, kernel: Callable[[int], str], upto: int) -> Plan:
        """The plan that gives each m in 1..upto exactly `kernel(m)` (runs of one kernel make
        one bucket) and every larger m `kernel(upto)`."""
        buckets, kernels = [], []
        for m in range(1, upto + 1):
            k = kernel(m)
            if kernels and kernels[-1] == k:
                buckets[-1] = m
            else:
                buckets.append(m)
                kernels.append(k)
        return cls(tuple(buckets), tuple(kernels))

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


DEFAULT_PLAN = Plan.of("mm-pad")  # a model no plan was applied to (tests): float32 as `padded_rows` pads


def choose(costs: dict[str, float], margin: float = MARGIN, *, rows: int = 0) -> str:
    """The kernel for a bucket of `rows` rows (0: any) from its measured seconds: walk the
    candidates in KERNELS order (ONE_ROW_ORDER at one row); a later one replaces the current
    choice only if it is faster by more than `margin` (a tie keeps the exact-float32,
    unpadded, unpacked kernel)."""
    order = ONE_ROW_ORDER if rows == 1 else KERNELS
    best = None
    for k in sorted(costs, key=order.index):
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
    GEMV_MAX_ROWS, and "gemv-stream" at one row (where the two differ); "reduced" within the
    mode's row cap (--quantized-max-rows, or INT4_MAX_ROWS for int4); "half-onednn" only from
    12 rows (below it `half_linear` is oneDNN's F.linear already, or at one row the GEMV that
    beats it)."""
    out = ["mm"]
    if padding and padded_rows(m) != m:
        out.append("mm-pad")
    if packed:
        out.append("packed")
    if gemv and m == 1:
        out.append("gemv-stream")
    if gemv and m <= GEMV_MAX_ROWS:
        out.append("gemv")
    cap = reduced_max_rows if reduced_max_rows is not None else (INT4_MAX_ROWS if reduced == "int4" else None)
    if reduced is not None and (cap is None or m <= cap):
        out.append("reduced")
        if reduced != "int4" and m >= 12:
            out.append("half-onednn")
    return out


def table_plan(reduced: Callable[[int], bool] | None, *, packed: bool, padding: bool, upto: int) -> Plan:
    """The plan the tables give one part (the decoder linears or the head): the reduced copy
    where its row rule admits the step (models/quant.RowRule), else the packed copy from
    PREPACK_MIN_ROWS rows where there is one, else `linear` padded (or not, per
    --cpu-gemm-row-padding). Exact for every step of up to `upto` rows (the budget)."""

    def kernel(m: int) -> str:
        if reduced is not None and reduced(m):
            return "reduced"
        if packed and m >= PREPACK_MIN_ROWS:
            return "packed"
        return "mm-pad" if padding else "mm"

    return Plan.from_rule(kernel, upto)
