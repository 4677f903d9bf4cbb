"""Residual add + RMSNorm as one Triton kernel: the norms of a 16-bit model's step on a GPU.

Why: on an H200 a batch-1 decode step of Llama-3-8B's shapes (bfloat16, CUDA graphs) took
5.45 ms, 1.46x the HBM floor, and ~0.9 ms of it went to ~600 small kernels (benchmarks/GPU.md).
The decoder's two norms a layer are most of those: in a 16-bit model each is the residual add,
the cast to float32, rms_norm's own ops, the cast back and the weight's product, a launch each
that reads and writes the whole row. Here one program a row does all of it, reading x, the
residual and the weight once and writing the sum and the normed row once.

Numerics are `RMSNorm.add_forward`'s torch path (HF's order): s = residual + x rounded to the
model's dtype; s normalised in float32 and rounded to the dtype; that times the weight, rounded
to the dtype (a 16-bit product is exact in float32, so rounding it once is what torch's 16-bit
multiply gives). s is bitwise torch's. The mean of squares is summed in another order than
torch's, so a normed value may differ from torch's by a unit in the 16-bit dtype's last place
(tests/kernels/test_triton.py). Float32 keeps the torch path: it is the exact mode, equal to HF.

This module imports triton at the top; models/layers.py imports it only on a GPU executor
(`LlamaForCausalLM.use_triton_norms`), so a CPU machine never pays for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16)
MAX_WIDTH = 16384  # one program holds a row: 16K float32 values over 16 warps' registers


@triton.jit
def _rounded(v, BF16: tl.constexpr):
    """float32 `v` rounded to the nearest bfloat16 (ties to even) or float16, as float32. The
    bfloat16 rounding is done on the bits: Triton's interpreter truncates a float32 -> bfloat16
    cast, so the tests on CPU would check another rounding than the GPU's."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float16).to(tl.float32)


@triton.jit
def _add_rms_norm(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    width,
    x_row,
    r_row,
    out_row,
    sum_row,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    s = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # rounded as torch's residual + x in the dtype; stored exactly
        s = _rounded(s + tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0).to(tl.float32), BF16)
        tl.store(sum_ptr + row * sum_row + cols, s.to(sum_ptr.dtype.element_ty), mask=mask)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / width + eps)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rounded(_rounded(s * rstd, BF16) * weight, BF16)
    tl.store(out_ptr + row * out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes these: rows of a 16-bit dtype with unit-stride columns, a
    residual (if any) and a weight of the same dtype and width."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1 or not 0 < x.shape[1] <= MAX_WIDTH:
        return False
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape or residual.stride(1) != 1):
        return False
    return weight.dtype == x.dtype and weight.shape == (x.shape[1],) and weight.is_contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x), as RMSNorm.add_forward returns them; with
    `residual` None the second is x itself (the first layer). Only what `supports` takes."""
    rows, width = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = x if residual is None else torch.empty_like(out)
    if rows:
        block = triton.next_power_of_2(width)
        r = x if residual is None else residual
        _add_rms_norm[(rows,)](
            x,
            r,
            weight,
            out,
            total,
            width,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            total.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BF16=x.dtype == torch.bfloat16,
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
        )
    return out, total
