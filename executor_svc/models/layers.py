"""Building blocks shared by the decoder models: linear, RMSNorm, rotary embedding, attention.

Parameters are allocated with `torch.empty` and never randomly initialised: every weight
comes from a checkpoint, and initialising 135M parameters only to overwrite them would
cost more than loading them.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve_kernels import AttentionBackend, get_forward_context
from executor_svc.collectives import NO_TP, TPInfo, all_reduce_, shard_rows
from executor_svc.models.kernel_plan import DEFAULT_PLAN, Plan, padded_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pad: bool = True) -> torch.Tensor:
    """y = x W^T + b. In float32 on CPU computed as (W @ x^T)^T, with the rows padded as
    `padded_rows` says when `pad` (the plan's "mm-pad" kernel; "mm" without): with MKL on a
    2-core AMD EPYC (W @ x^T) is 20-40% faster than x @ W^T for decode-sized batches and
    never slower, and padding saves up to 2x more on AVX2 (batch 1: 35 -> 24 ms for the
    default model's linears). The result is a transposed view (of the padded product); ops
    downstream accept strides. Anywhere else (CUDA, 16-bit, 3-D x) it is F.linear."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2):
        return F.linear(x, weight, bias)
    m = x.shape[0]
    p = padded_rows(m) if pad else m
    if p != m:
        x = F.pad(x, (0, 0, 0, p - m))
    elif m < 16:
        # A column-major x (silu(gate) * up of a transposed view is one) sends MKL down a path
        # 3.7x slower at 2-4 rows (90 vs 24 ms for the default model's linears); from 16
        # rows on both layouts cost the same.
        x = x.contiguous()
    xt = x.t()
    y = torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)
    return (y[:, :m] if p != m else y).t()


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked ("prepacked") copy of a float32 CPU weight [N, K], as torch inductor's
    freezing makes one, or None where torch was built without oneDNN.

    Why: measured on a 2-core AVX512-BF16 EPYC, the default model's 121 linears applied once
    (ms, MKL's padded `linear` vs oneDNN on the packed copy): 3 rows 27.6 / 20.3, 4: 26.8 /
    18.7, 8: 42.4 / 24.0, 12: 59.4 / 25.8, 32: 86.8 / 51.5, 128: 254 / 174, 512: 876 / 738;
    but 1-2 rows 16-20 / 24-25, so the tables keep the plain weight for those (memory: a
    second float32 copy of every linear weight and the head). One copy, packed for a batch
    of 8, serves every row count (packing per row count measured no faster)."""
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)


def prepack_measured() -> bool:
    """Whether this CPU is of a class where the packed copies were measured faster: AVX512
    (torch's CPU capability). Not yet measured on AVX2, so the tables use `--cpu-gemm-prepack`
    only on AVX512 CPUs (a measured plan times the copies on any CPU)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) on a `prepack_weight` copy: float32 arithmetic (oneDNN's own blocking,
    so the last bits differ from MKL's, as they do between row counts)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stream_one_row: bool = False
) -> torch.Tensor:
    """y = x W^T (+ b) through the native few-row float32 product (chunkserve_kernels/csrc/cpu_linear.cpp:
    each weight row streamed once, ~1.3-1.4x MKL's speed at one row on a 2-core Zen 5; the
    plan's "gemv" kernel, or "gemv-stream" with `stream_one_row`: one row of x without the
    software prefetch, the same bits). Needs `chunkserve_kernels.cpu_native.load()` to have
    succeeded."""
    return torch.ops.chunkserve.gemv(x, weight, bias, stream_one_row)


class Linear(nn.Module):
    """y = x W^T (+ b) through the kernel its plan names for the step's row count
    (models/kernel_plan.py). Fused layers list their shards: name -> (row offset, rows)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        shards: dict[str, tuple[int, int]] | None = None,
        tp: TPInfo = NO_TP,
        tp_dim: int | None = None,
    ) -> None:
        """Under tensor parallelism the features are this rank's: `tp_dim` 0 = column-parallel
        (out_features are its rows of the checkpoint's, per shard), 1 = row-parallel
        (in_features are its columns; the partial results are summed over the group, then
        the bias, held whole, is added once), None = replicated."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.shards = shards or {}
        # models/quant: Int4Weights (--quantization int4) or HalfWeights (--dtype bfloat16/float16
        # on CPU), the reduced-precision copy behind the plan's "reduced" and "half-onednn" kernels
        self.reduced: Any = None
        # LlamaForCausalLM.prepack: oneDNN's blocked float32 copy, the plan's "packed" kernel
        self.packed: torch.Tensor | None = None
        self.plan: Plan = DEFAULT_PLAN  # set by LlamaForCausalLM.use_plan
        self.tp = tp
        self.tp_dim = tp_dim if tp.enabled else None

    def forward(self, x: torch.Tensor, same_dtype: bool = True) -> torch.Tensor:
        """`same_dtype=False` lets the reduced-precision path return its 16-bit result uncast
        (no bias only), for a caller that adds it to a float32 tensor: `h + y` promotes y
        exactly, so the sum is bitwise that of `h + y.float()`, one op fewer per call."""
        kernel = self.plan(x.shape[0]) if x.dim() == 2 else "mm"
        if self.tp_dim == 1:  # row-parallel: this rank's partial product, summed, then the bias once
            y = all_reduce_(self.apply_kernel(x, kernel, with_bias=False))
            return y if self.bias is None else y.add_(self.bias)
        return self.apply_kernel(x, kernel, same_dtype)

    def apply_kernel(
        self, x: torch.Tensor, kernel: str, same_dtype: bool = True, with_bias: bool = True
    ) -> torch.Tensor:
        """x W^T (+ b) through one named kernel (kernel_plan.KERNELS): "mm" / "mm-pad"
        `linear` without / with row padding, "packed" the oneDNN copy, "gemv" / "gemv-stream"
        the native few-row product with / without the one-row prefetch, "reduced" the int4 or
        16-bit copy as its class computes it, "half-onednn" the 16-bit copy through oneDNN's
        F.linear. The benchmarks and the plan's measurement call it too, so they time what a
        step runs."""
        bias = self.bias if with_bias else None
        if kernel in ("reduced", "half-onednn"):
            keep = same_dtype or bias is not None
            if kernel == "reduced":
                y = self.reduced.matmul(x, keep)
            else:
                w = self.reduced.weight
                y = F.linear(x.to(w.dtype), w)
                y = y.to(x.dtype) if keep else y
            return y if bias is None else y.add_(bias)
        if kernel == "packed":
            return packed_linear(x, self.packed, bias)
        if kernel in ("gemv", "gemv-stream"):
            return native_linear(x, self.weight, bias, kernel == "gemv-stream")
        if kernel in ("mm", "mm-pad"):
            return linear(x, self.weight, bias, pad=kernel == "mm-pad")
        raise ValueError(f"unknown linear kernel {kernel!r}")


class Embedding(nn.Module):
    """Under tensor parallelism vocab-parallel: rank r holds rows [r * n, (r + 1) * n) of the
    vocabulary (n = ceil(num / size); rows past the vocabulary stay zero), looks up the ids
    it holds, zeroes the others, and the group sums the rows (one all_reduce per step)."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device | str, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.tp_dim = 0 if tp.enabled else None
        if tp.enabled:  # zeros: the padding rows past the vocabulary must stay exact zeros
            self.weight = nn.Parameter(torch.zeros(shard_rows(num, tp), dim, dtype=dtype, device=device), False)
        else:
            self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype, device=device), False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_(h.masked_fill_(outside[:, None], 0))


class RMSNorm(nn.Module):
    """HF Llama RMSNorm: normalise in float32, cast back, then scale (same rounding as HF)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), False)
        self.eps = eps
        # float32 CPU: the native residual add + norm (chunkserve_kernels/csrc/cpu_attention.cpp), one op
        # instead of the add and rms_norm's composite (~14 us a call at one row); set by the
        # executor with --cpu-kernels (LlamaForCausalLM.use_native_kernels)
        self.native = False
        # On a GPU: chunkserve_kernels.triton_norm, whose one kernel does a 16-bit row's add and
        # norm (LlamaForCausalLM.use_triton_norms); None: torch's ops
        self.triton: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the decoder's residual add and the next norm in
        one call; `residual` None (the first layer) norms x alone. `residual + x` is bitwise
        the old `h + y` (float addition commutes; a bfloat16 x promotes exactly)."""
        native = self.native and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
        if native and (residual is None or residual.dtype == torch.float32):
            return torch.ops.chunkserve.add_rms_norm(x, residual, self.weight, self.eps)
        if self.triton is not None and self.triton.supports(x, residual, self.weight):
            return self.triton.add_rms_norm(x, residual, self.weight, self.eps)
        s = x if residual is None else residual + x
        return self.forward(s), s


SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE dict, transformers 5 style (`rope_parameters`) or older (`rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions. On a CPU they are read from tables of every position up
    to the largest seen yet; elsewhere computed per step.

    Why tables on a CPU: a decode step there builds its cos/sin right after its weight reads
    have flushed the caches, where the ~10 small ops of computing them cost ~90-140 us of a
    batch-1 step of the default model on a 2-core Zen 4 EPYC; the fused decode layers read the
    rows at each token's position in C++ (cpu_rotary.cpp) and the step pays no op for them at
    all (benchmarks/RESULTS.md, "What a batch-1 step spends outside its weight reads"). The tables
    grow in blocks of TABLE_BLOCK positions, each block computed by the same ops on a tensor
    whose size is a whole number of vectors, so every entry is what computing its position
    alone gives (ATen's vector cos/sin; a per-step tensor whose size is not a whole number of
    vectors would have its last entries from the scalar ones, and a position's bits would
    depend on the step's other tokens). They hold only the positions some step reached: at
    128K tokens of context and head_dim 128, 134 MB. On a GPU a table would need the largest
    position on the host each step (a sync), and CUDA graphs replay fixed buffers."""

    TABLE_BLOCK = 512

    def __init__(self, head_dim: int, params: dict[str, Any], device: torch.device | str) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
        if rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, params)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._cos = self._sin = torch.empty(0, head_dim, device=device)  # the CPU tables, float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> `cos`, `sin` of shape [T, 1, head_dim] in `dtype`, the half-width
        tables doubled to full width as `apply_rotary` wants them: [cos, cos], [-sin, sin]
        (built once per step and shared by every layer, so a layer pays 4 ops, not 8)."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            cos, sin = self._compute(positions)
            return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
        cos, sin = self.tables(int(positions.max()) + 1)
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables, full-width float32 [>= length, head_dim] cos and sin (row p: position
        p, as `forward` gives it), grown first where shorter; what the fused decode layers read."""
        if length > self._cos.shape[0]:
            self._grow(length)
        return self._cos, self._sin

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width float32 [T, head_dim] cos and sin of `positions` (int64 [T])."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def _grow(self, needed: int) -> None:
        """Tables for at least `needed` positions: twice the old length or more, in whole blocks
        (new tensors: tables handed out before stay as they were)."""
        length = max(needed, 2 * self._cos.shape[0])
        length = -(-length // self.TABLE_BLOCK) * self.TABLE_BLOCK
        blocks = [
            self._compute(torch.arange(start, start + self.TABLE_BLOCK, device=self.inv_freq.device))
            for start in range(self._cos.shape[0], length, self.TABLE_BLOCK)
        ]
        self._cos = torch.cat([self._cos, *(c for c, _ in blocks)])
        self._sin = torch.cat([self._sin, *(s for _, s in blocks)])


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by `factor`,
    and interpolate smoothly in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, D] with RotaryEmbedding's full-width `cos` = [cos, cos] and
    `sin` = [-sin, sin]; bitwise equal to HF's `x*cos + rotate_half(x)*sin`: rotate_half(x) *
    sin = [-x2, x1] * [sin, sin] = [x2, x1] * [-sin, sin] (negation is exact), and [x2, x1] is
    x rolled by D/2. One roll, two multiplies and an add, the last two in place."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    rotated.mul_(sin)
    return (x * cos).add_(rotated)


class PagedAttention(nn.Module):
    """Writes this step's K/V into layer `layer_idx` of the cache and attends over it,
    reading metadata and cache from the forward context."""

    def __init__(self, layer_idx: int, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        cache = ctx.kv_cache[self.layer_idx]
        self.backend.write_kv(cache, k, v, ctx.meta.slot_mapping)
        return self.backend.forward(q, cache, ctx.meta, self.scale)
