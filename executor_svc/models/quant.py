"""Reduced-precision weight copies for small steps on CPU: weight-only int4 for the decoder's
linear layers (`--quantization int4`, below) and 16-bit copies of every linear weight and the
head (`--dtype bfloat16` / `float16` on CPU, `HalfWeights` at the end).

Scheme: asymmetric 4-bit, groups of 32 weights along the input dimension, one scale and one
zero point per group, w = (q - 8) * scale + zero with q in 0..15 (the layout of torch's own
CPU kernel, `aten._weight_int4pack_mm_for_cpu`, which torchao's CPU int4 layout also calls;
calling it directly spares a dependency whose releases trail torch's). The embedding and the
LM head stay in the model dtype (see below for the head's bfloat16 copy).

Why a per-shape choice: measured on a 2-core AVX2 EPYC (benchmarks/RESULTS.md), the kernel
needs bfloat16 activations to be fast (with float32 ones it is 3-25x slower than the float32
GEMM) and then beats float32 at a few rows (in a whole decode step 1.9x at one row, 1.3x at
8) but loses from ~32 rows on (1.5x slower at 32, 2.3x per linear at 128), so a prefill chunk
through it would be far slower than float32. On a CPU with a native bfloat16 instruction
(AVX512-BF16) it wins up to 64 rows (used up to 32, `ROW_RULES` says why). So a step the mode's `RowRule` admits (a table per CPU
class, `ROW_RULES`, or --quantized-max-rows) runs the int4 kernel; any other step the
float32 weights, which this mode keeps (memory: float32 plus ~0.56 byte per linear weight
and a bfloat16 head). The cost of that choice: a request's greedy tokens can depend on the
rows its steps had (each path is deterministic; they differ in rounding), and the int4
path's agreement with float32 is measured, not exact (benchmarks/quantization_quality.py).
float32 stays the exact mode.

The vocabulary head keeps its float32 weights and gets a bfloat16 copy (16 bits, not 4: the
head decides the token), used where the table says bfloat16 beats float32: one-row steps
without native bfloat16 (at one row the float32 GEMV is a quarter of an int4 decode step and
bfloat16 reads half the bytes, 2.4x faster; from 4 rows on the bfloat16 GEMM is the slower
one), every step but those of 2-4 rows with it. Measured per linear on the AVX2 EPYC, summed over
the default model's 120 decoder linears (ms, 2 threads): rows 1: fp32 34 / int4 11; 2: 31 /
15; 4: 32 / 22; 8: 58 / 36; 12: 79 / 55; 16: 59 / 70, hence 8 rows there.

For the default model (linear weights from a Q4_1 GGUF: groups of 32 with an fp16 scale and
minimum) min/max quantization recovers every weight's 4-bit code exactly; only the rounding of
scale and zero to bfloat16, which the fast kernel wants, and the bfloat16 activations perturb
the result (`quantize_int4` reports how many groups are exact before that rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkserve_contracts.cpu import cpu_info

GROUP_SIZE = 32
SCHEMES = ("none", "int4")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RowRule:
    """Which steps (by their number of token rows) take a reduced-precision copy: those of at
    most `max_rows` rows (None: any size), except the counts in `skip`. Every other step runs
    the float32 weights, which these modes keep."""

    max_rows: int | None
    skip: frozenset[int] = frozenset()

    def __call__(self, rows: int) -> bool:
        return (self.max_rows is None or rows <= self.max_rows) and rows not in self.skip

    def __str__(self) -> str:
        size = "any size" if self.max_rows is None else f"<= {self.max_rows} tokens"
        return size + (" but " + ", ".join(map(str, sorted(self.skip))) if self.skip else "")


_NATIVE_BF16 = RowRule(None, frozenset({2, 3, 4}))
# (decoder linears, vocabulary head) per mode, measured with benchmarks/cpu_gemm_shapes.py
# (the default model's linears, 2 threads; tables in benchmarks/RESULTS.md):
# - no native bf16 (2-core AVX2 EPYC): int4 wins up to ~12 rows, the 16-bit GEMMs and the
#   bfloat16 head only at one row;
# - native bf16 (2-core AVX512-BF16 EPYC, Zen 4): bfloat16's linears beat float32's 1.9x at
#   one row and 1.4-2.3x from 5 rows on; at 2-4 rows they tie (2 rows ~5% slower) and the
#   casts in and out make a whole 4-row decode step ~9% slower than float32's, so those
#   step sizes stay float32 (benchmarks/executor_modes.py, RESULTS.md); int4 beats
#   float32 by >= 20% up to 64 rows (~5% from 128 on, inside the noise) but is kept to
#   decode-sized steps of <= 32 rows: a prompt prefilled through int4 perturbs every
#   position's KV (the default model's 37-token "capital of France" chat prompt then answers
#   "L'Étoile, ..." instead of "The capital of France is Paris.", correct with 32);
#   float16 has no native instruction on either and wins at one row only.
ROW_RULES: dict[bool, dict[str, tuple[RowRule, RowRule]]] = {
    False: {
        "int4": (RowRule(8), RowRule(1)),
        "bfloat16": (RowRule(1), RowRule(1)),
        "float16": (RowRule(1), RowRule(1)),
    },
    True: {
        "int4": (RowRule(32), _NATIVE_BF16),
        "bfloat16": (_NATIVE_BF16, _NATIVE_BF16),
        "float16": (RowRule(1), RowRule(1)),
    },
}


def default_rules(mode: str, max_rows: int | None = None) -> tuple[RowRule, RowRule]:
    """(linears, head) rules for `mode` on this CPU; `max_rows` (--quantized-max-rows) replaces
    the linears' rule and, in the 16-bit modes, the head's (int4 keeps the table's head rule:
    its head copy is 16-bit, not 4-bit)."""
    linears, head = ROW_RULES[cpu_info().native_bf16][mode]
    if max_rows is None:
        return linears, head
    return RowRule(max_rows), head if mode == "int4" else RowRule(max_rows)


def half_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] times a 16-bit weight [N, K]^T, both in the weight's dtype, through the kernel
    that is fastest here for M rows (measured, benchmarks/RESULTS.md "native bfloat16"):
    one row: torch's own GEMV, with oneDNN switched off for the call (oneDNN's one-row
    bfloat16 product is ~2x slower on AVX512-BF16; float16 and AVX2 CPUs take torch's GEMV
    anyway); from 12 rows a bfloat16 product as (W @ x^T)^T, 10-15% faster there than
    x @ W^T (like float32's `linear`, a transposed view); otherwise `F.linear`."""
    m = x.shape[0]
    if m == 1:
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return torch.nn.functional.linear(x, weight)
        finally:
            torch._C._set_mkldnn_enabled(was)
    if m >= 12 and weight.dtype == torch.bfloat16:
        return torch.mm(weight, x.t()).t()
    return torch.nn.functional.linear(x, weight)


def _codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(codes [N, K/G, G] float, bf16 scale [N, K/G, 1], bf16 zero [N, K/G, 1], exact groups)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {k}")
    g = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (high - low) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((g - low) / scale).clamp_(0, 15)
    exact = int(((codes * scale + low) == g).all(-1).sum())
    # The kernel computes (q - 8) * scale + zero with bf16 scale and zero: choose the codes
    # against those rounded values, so the rounding of scale/zero is not paid twice.
    scale_b = scale.to(torch.bfloat16)
    zero_b = (low + 8 * scale).to(torch.bfloat16)
    codes = torch.round((g - zero_b.float()) / scale_b.float() + 8).clamp_(0, 15)
    return codes, scale_b, zero_b, exact


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[N, K] float weight -> (packed int4 [N, K/2] uint8, scales_and_zeros [K/G, N, 2] bf16,
    number of groups whose codes reproduce the float32 weights exactly before bf16 rounding)."""
    n, k = weight.shape
    codes, scale_b, zero_b, exact = _codes(weight, group_size)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k).to(torch.int32), 1)
    scales_and_zeros = torch.stack((scale_b.squeeze(-1), zero_b.squeeze(-1)), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros, exact


def int4_reference(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The float32 [N, K] weights the int4 kernel multiplies by: (q - 8) * scale + zero, for
    tests and for benchmarks/quantization_quality.py's emulation of the int4 path."""
    codes, scale_b, zero_b, _ = _codes(weight, group_size)
    return ((codes - 8) * scale_b.float() + zero_b.float()).reshape(weight.shape)


class Int4Weights:
    """A linear layer's int4 copy (the plan's "reduced" kernel under --quantization int4)."""

    __slots__ = ("packed", "scales_and_zeros", "exact_groups")

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed, self.scales_and_zeros, self.exact_groups = quantize_int4(weight)

    def matmul(self, x: torch.Tensor, same_dtype: bool = True) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype (or, with `same_dtype=False`, the kernel's
        bfloat16), through bf16 activations."""
        xb = x.to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y.to(x.dtype) if same_dtype else y


def quantize_model(model: torch.nn.Module, scheme: str) -> dict[str, int]:
    """Adds int4 copies to every Linear of the decoder layers and a bfloat16 copy of the head
    (16 bits, not 4: the head decides the token); which steps use them is the plan's choice
    (models/kernel_plan.py). Returns counts for the start-up log: layers, groups, groups exact
    before bf16 rounding."""
    if scheme == "none":
        return {}
    if scheme not in SCHEMES:
        raise ValueError(f"--quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    stats = {"layers": 0, "groups": 0, "exact_groups": 0}
    for module in model.decoder_linears():
        if module.weight.device.type != "cpu":
            raise ValueError("--quantization int4 is a CPU mode (torch's CPU int4 kernel)")
        q = Int4Weights(module.weight)
        stats["layers"] += 1
        stats["groups"] += module.weight.numel() // GROUP_SIZE
        stats["exact_groups"] += q.exact_groups
        module.reduced = q
    model.lm_head.reduced = HalfWeights(model.lm_head.weight, torch.bfloat16)
    return stats


class HalfWeights:
    """A linear layer's 16-bit copy (`--dtype bfloat16` / `float16` on CPU) and the rule for
    which steps use it.

    Why float32 stays beside it: on a CPU without AVX512-BF16/AMX torch's 16-bit GEMM
    converts as it goes, so reading half the bytes wins only while the step is bound by
    reading the weights. Measured on a 2-core AVX2 EPYC, the default model's 120 decoder
    linears (ms): 1 row bf16 13 / fp16 11 vs float32 24 (2 rows padded, `padded_rows`);
    2 rows bf16 24 / fp16 20 vs 24; 4 rows 45 / 37 vs 24; 8 rows 87 / 73 vs 42. There
    steps of one row (batch-1 decode) take this copy and every larger step the float32
    weights; with a native bfloat16 instruction bfloat16 wins at one row and from 5 rows on
    (`ROW_RULES`). Either way the mode is never slower than float32 where the table says
    float32 (the same arithmetic). Memory: float32 plus 2 bytes per linear weight."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.detach().to(dtype).contiguous()

    def matmul(self, x: torch.Tensor, same_dtype: bool = True) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype (or, with `same_dtype=False`, 16-bit)."""
        y = half_linear(x.to(self.weight.dtype), self.weight)
        return y.to(x.dtype) if same_dtype else y


def half_weights_model(model: torch.nn.Module, dtype_name: str) -> dict[str, int]:
    """Gives every Linear, the head included, a 16-bit copy (the plan's "reduced" and
    "half-onednn" kernels); returns counts for the start-up log: layers and the bytes the
    copies add."""
    dtype = HALF_DTYPES[dtype_name]
    stats = {"layers": 0, "bytes": 0}
    for module in [*model.decoder_linears(), model.lm_head]:
        if module.weight.device.type != "cpu":
            raise ValueError(f"16-bit weight copies are a CPU mode (--dtype {dtype_name} on CUDA runs in it)")
        module.reduced = HalfWeights(module.weight, dtype)
        stats["layers"] += module is not model.lm_head
        stats["bytes"] += module.weight.numel() * dtype.itemsize
    return stats
