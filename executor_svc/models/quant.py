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
through it would be far slower than float32. A step with at
most `max_rows` rows therefore runs the int4 kernel; a larger one the float32 weights, which
this mode keeps (memory: float32 plus ~0.56 byte per linear weight and a bfloat16 head). The cost of that choice:
a request's greedy tokens can depend on the rows its steps had (each path is deterministic;
they differ in rounding), and the int4 path's agreement with float32 is measured, not exact
(benchmarks/quantization_quality.py). float32 stays the exact mode.

The vocabulary head keeps its float32 weights and gets a bfloat16 copy for one-row steps
(16 bits, not 4: the head decides the token; at one row its float32 GEMV is a quarter of an
int4 decode step and bfloat16 reads half the bytes, 2.4x faster here; from 4 rows on the
bfloat16 GEMM is the slower one). Measured per linear, summed over the default model's 120
decoder linears (ms, 2 threads): rows 1: fp32 34 / int4 11; 2: 31 / 15; 4: 32 / 22; 8: 58 /
36; 12: 79 / 55; 16: 59 / 70, hence the default --quantized-max-rows 8.

For the default model (linear weights from a Q4_1 GGUF: groups of 32 with an fp16 scale and
minimum) min/max quantization recovers every weight's 4-bit code exactly; only the rounding of
scale and zero to bfloat16, which the fast kernel wants, and the bfloat16 activations perturb
the result (`quantize_int4` reports how many groups are exact before that rounding).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
HEAD_BF16_MAX_ROWS = 1  # bf16 GEMV beats float32 at one row (2.4x), ties at 2, loses from 4 on
SCHEMES = ("none", "int4")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Steps of at most this many rows use the reduced copy unless --quantized-max-rows says otherwise
# (measured per mode on a 2-core AVX2 EPYC, benchmarks/RESULTS.md).
DEFAULT_MAX_ROWS = {"int4": 8, "bfloat16": 1, "float16": 1}


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
    """A linear layer's int4 copy and the row limit up to which it is used."""

    __slots__ = ("packed", "scales_and_zeros", "exact_groups", "max_rows")

    def __init__(self, weight: torch.Tensor, max_rows: int) -> None:
        self.packed, self.scales_and_zeros, self.exact_groups = quantize_int4(weight)
        self.max_rows = max_rows

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows

    def matmul(self, x: torch.Tensor, same_dtype: bool = True) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype (or, with `same_dtype=False`, the kernel's
        bfloat16), through bf16 activations."""
        xb = x.to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y.to(x.dtype) if same_dtype else y


def quantize_model(model: torch.nn.Module, scheme: str, max_rows: int) -> dict[str, int]:
    """Adds int4 copies to every Linear of the decoder layers (not the LM head); returns
    counts for the start-up log: layers, groups, groups exact before bf16 rounding."""
    from executor_svc.models.layers import Linear

    if scheme == "none":
        return {}
    if scheme not in SCHEMES:
        raise ValueError(f"--quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    stats = {"layers": 0, "groups": 0, "exact_groups": 0}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in name:
            continue
        if module.weight.device.type != "cpu":
            raise ValueError("--quantization int4 is a CPU mode (torch's CPU int4 kernel)")
        q = Int4Weights(module.weight, max_rows)
        stats["layers"] += 1
        stats["groups"] += module.weight.numel() // GROUP_SIZE
        stats["exact_groups"] += q.exact_groups
        module.reduced = q
    model.head_reduced = (_head_weight(model).detach().to(torch.bfloat16), HEAD_BF16_MAX_ROWS)
    return stats


def _head_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.model.embed_tokens.weight if getattr(model, "lm_head", None) is None else model.lm_head.weight


class HalfWeights:
    """A linear layer's 16-bit copy (`--dtype bfloat16` / `float16` on CPU) and its row limit.

    Why float32 stays beside it: on a CPU without AVX512-BF16/AMX torch's 16-bit GEMM
    converts as it goes, so reading half the bytes wins only while the step is bound by
    reading the weights. Measured on a 2-core AVX2 EPYC, the default model's 120 decoder
    linears (ms): 1 row bf16 13 / fp16 11 vs float32 24 (2 rows padded, `padded_rows`);
    2 rows bf16 24 / fp16 20 vs 24; 4 rows 45 / 37 vs 24; 8 rows 87 / 73 vs 42. So steps
    of one row (batch-1 decode) take this copy and every larger step the float32 weights:
    the mode is never slower than float32 above its row limit by construction (the same
    arithmetic), and faster at one row. Memory: float32 plus 2 bytes per linear weight."""

    __slots__ = ("weight", "max_rows")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, max_rows: int) -> None:
        self.weight = weight.detach().to(dtype).contiguous()
        self.max_rows = max_rows

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows

    def matmul(self, x: torch.Tensor, same_dtype: bool = True) -> torch.Tensor:
        """x [M, K] -> x W^T [M, N] in x's dtype (or, with `same_dtype=False`, 16-bit)."""
        y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)
        return y.to(x.dtype) if same_dtype else y


def half_weights_model(model: torch.nn.Module, dtype_name: str, max_rows: int) -> dict[str, int]:
    """Gives every Linear (decoder and head) a 16-bit copy for steps of at most `max_rows`
    rows; returns counts for the start-up log: layers and the bytes the copies add."""
    from executor_svc.models.layers import Linear

    dtype = HALF_DTYPES[dtype_name]
    stats = {"layers": 0, "bytes": 0}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or "lm_head" in name:
            continue
        if module.weight.device.type != "cpu":
            raise ValueError(f"16-bit weight copies are a CPU mode (--dtype {dtype_name} on CUDA runs in it)")
        module.reduced = HalfWeights(module.weight, dtype, max_rows)
        stats["layers"] += 1
        stats["bytes"] += module.weight.numel() * dtype.itemsize
    head = _head_weight(model).detach().to(dtype)
    model.head_reduced = (head, max_rows)
    stats["bytes"] += head.numel() * dtype.itemsize
    return stats
