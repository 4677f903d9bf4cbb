"""Triton paged varlen attention: the GPU backend where flash-attn is not installed.

Why a kernel of our own: upstream flash-attn 2 only pages with blocks of 256 tokens, while
the scheduler's default block is 16 (finer blocks waste less KV memory and let prefix
caching match more). This kernel reads the paged cache one key row at a time through the
block table, so ANY block size works, and one launch covers a whole mixed step: decodes and
prefill chunks side by side.

Layout of the work: the grid is (sequence, query tile, KV head). A program owns one KV
head and the whole GQA group of query heads reading it, so each K/V tile is loaded once
per group, not once per query head: the tile's M rows are (token, head-in-group) pairs,
`row = token_in_tile * GROUP + head_in_group`. A decode step is thus a real 16-row matrix
product (the group), not a 1-row one. Programs of tiles past a sequence's query length
exit at once. Causality is aligned to the END of the context (query token j of a
sequence with q new tokens and ctx keys sits at position ctx - q + j), the key loop stops
at the tile's last query position, softmax is online (running max and sum, base 2), and
everything accumulates in float32 whatever the input dtype.

This module imports triton at the top on purpose: the registry imports it only when
"triton" is asked for or chosen, so a CPU machine never pays for it.

Decode-only steps of few sequences split the keys (flash-decoding; unsplit, a batch-1 decode
kept 8 programs busy on an H200: 35 us a layer for 1K keys, benchmarks/GPU.md): axis 1 counts
shares instead of query tiles, each cut at BLOCK_N multiples from the length on the device (so
a CUDA graph replays it for any context); a second kernel merges them. The number of shares
depends on the batch size (`decode_splits`), as cuBLAS's choice of kernel already does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chunkserve_kernels.backend import AttentionBackend
from chunkserve_kernels.metadata import AttentionMetadata

LOG2_E = 1.4426950408889634
MAX_HEAD_SIZE = 256  # registers/shared memory for a 128-row tile of 256-wide heads


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST is for Triton's CPU interpreter only: numpy
    has no bfloat16, so the interpreter's dot multiplies the raw uint16 bits of bf16
    operands (garbage). There, bf16 operands go through float32 -- exact products of the
    same bf16 values, so the test still checks this kernel's rounding of P to bf16."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _paged_attention_kernel(  # one line per group of arguments
    Q, K, V, O, PART_O, PART_M, PART_L,  # noqa: E741 (the kernel's tensor names)
    BLOCK_TABLE, CU_SEQLENS_Q, SEQUSED_K, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(2)
    if SPLIT:  # decode-only: axis 1 is this program's share of the keys
        tile = 0
        split = tl.program_id(1)
    else:
        tile = tl.program_id(1)
        split = 0
    TILE_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile
    q_start = tl.load(CU_SEQLENS_Q + seq)
    q_len = tl.load(CU_SEQLENS_Q + seq + 1) - q_start
    first = tile * TILE_Q
    if first >= q_len:
        return
    ctx = tl.load(SEQUSED_K + seq)

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP  # index within this sequence's query
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TILE_Q * GROUP) & (token < q_len)
    q_pos = ctx - q_len + token  # absolute position; it may see keys 0 ..= q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Finite start for the running max: a row with no key yet (a padding row) then keeps
    # exp2(-inf - m) = 0 and alpha = 1 instead of producing NaN from -inf - -inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys after the tile's last query position are masked for every row: never load them.
    kv_end = tl.minimum(ctx, ctx - q_len + first + TILE_Q)
    kv_begin = 0
    if SPLIT:
        num_splits = tl.num_programs(1)
        share = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_begin = split * share
        kv_end = tl.minimum(kv_end, kv_begin + share)
    table = BLOCK_TABLE + seq.to(tl.int64) * stride_bt
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        kv_off = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        # pos <= q_pos also drops pos >= kv_end: kv_end > q_pos for every real row.
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    if SPLIT:  # unnormalised: _merge_splits_kernel weighs the shares by their maxima
        part = ((q_start + token).to(tl.int64) * tl.num_programs(1) + split) * NUM_Q_HEADS + head
        tl.store(PART_O + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PART_M + part, m_i, mask=row_ok)
        tl.store(PART_L + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    PART_O,
    PART_M,
    PART_L,
    O,  # noqa: E741
    stride_ot,
    stride_oh,
    NUM_SPLITS,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (token, query head): sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M the
    largest m_s. A share with no keys has l = 0 and m = -1e30: weight 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    part = (token * NUM_SPLITS + s) * NUM_Q_HEADS + head
    m = tl.load(PART_M + part, mask=s_ok, other=-1.0e30)
    w = tl.exp2(m - tl.max(m, 0))
    l_sum = tl.sum(tl.load(PART_L + part, mask=s_ok, other=0.0) * w, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(PART_O + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(O + token * stride_ot + head * stride_oh + d, out.to(O.dtype.element_ty), mask=d_ok)


@triton.jit
def _write_kv_kernel(
    K_NEW,
    V_NEW,
    K_CACHE,
    V_CACHE,
    SLOT_MAPPING,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kb,
    stride_ks,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(SLOT_MAPPING + token)
    if slot < 0:  # a padding token: nothing to store
        return
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + head * stride_kh + d
    k = tl.load(K_NEW + token.to(tl.int64) * stride_knt + head * stride_knh + d, mask=mask)
    v = tl.load(V_NEW + token.to(tl.int64) * stride_vnt + head * stride_vnh + d, mask=mask)
    tl.store(K_CACHE + dst, k, mask=mask)
    tl.store(V_CACHE + dst, v, mask=mask)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter K/V `[T, Hkv, D]` (strided views are fine) to their slots: one launch, both caches."""
    k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"K/V dtype {k.dtype} does not match the cache's {k_cache.dtype}")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in its last (head_dim) axis")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def tile_config(max_seqlen_q: int, group: int, head_dim: int, elem_bytes: int = 2) -> dict[str, int]:
    """Rows per tile, keys per iteration and warps. Decode-only steps use the smallest
    tile that holds one GQA group (16 rows: tl.dot's minimum); prefill uses 64 or 128
    rows. Wide heads and 4-byte elements halve the key tile to stay in shared memory."""
    group_rows = max(16, triton.next_power_of_2(group))
    if max_seqlen_q == 1:
        block_m = group_rows
    else:
        block_m = max(group_rows, 64 if max_seqlen_q * group <= 64 else 128)
    block_n = 32 if head_dim * elem_bytes > 256 else 64
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8 if block_m >= 128 else 4}


MAX_SPLITS = 16
_SM_COUNT: dict[int, int] = {}  # multiprocessors per CUDA device index


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key shares per (sequence, KV head) for a decode-only step: enough programs for about
    two per multiprocessor, at most MAX_SPLITS; 1 (no split) where the batch fills the GPU
    alone, and on CPU (the interpreter; tests ask for splits through `config`)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(MAX_SPLITS, -(-2 * _SM_COUNT[index] // (num_seqs * num_kv_heads))))


def paged_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal attention of q `[T, Hq, D]` over the paged cache; returns a new `[T, Hq, D]`.

    `config` overrides `tile_config` (the CPU tests use small tiles to keep the
    interpreter fast and to make several key tiles per sequence), and its "SPLITS" the
    number of key shares of a decode-only step (`decode_splits`).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in its last (head_dim) axis")
    group = num_q_heads // num_kv_heads
    cfg = dict(config or tile_config(meta.max_seqlen_q, group, head_dim, q.element_size()))
    if cfg["BLOCK_M"] < group:
        raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} cannot hold a GQA group of {group}")
    q = _last_dim_contiguous(q)
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    splits = 1
    if meta.max_seqlen_q == 1:
        splits = cfg.get("SPLITS") or decode_splits(meta.num_seqs, num_kv_heads, q.device)
    if splits > 1:
        part_o = torch.empty(num_tokens, splits, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, splits, num_q_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        grid = (meta.num_seqs, splits, num_kv_heads)
    else:
        part_o = part_m = part_l = out  # not read: SPLIT is off
        grid = (meta.num_seqs, triton.cdiv(meta.max_seqlen_q, cfg["BLOCK_M"] // group), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_m,
        part_l,
        meta.block_table,
        meta.cu_seqlens_q,
        meta.seqused_k,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_table.stride(0),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        SPLIT=splits > 1,
        # float32 must not silently drop to TF32 (10-bit mantissa) on tensor cores.
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,  # interpreter only, see _dot
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2),
    )
    if splits > 1:
        _merge_splits(part_o, part_m, part_l, out)
    return out


def _merge_splits(part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor) -> None:
    """Writes `out` [T, Hq, D] from the key shares' partial sums `part_o` [T, S, Hq, D]."""
    num_tokens, splits, num_q_heads, head_dim = part_o.shape
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        part_o,
        part_m,
        part_l,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_S=triton.next_power_of_2(splits),
    )


class TritonBackend(AttentionBackend):
    """Any block size, head sizes up to 256, float32/bfloat16/float16; CUDA tensors (CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    graph_safe = True  # grid from num_seqs and max_seqlen_q (1 for decodes); lengths from SEQUSED_K

    def check_head_size(self, head_size: int) -> None:
        if not 1 <= head_size <= MAX_HEAD_SIZE:
            raise ValueError(f"attention backend 'triton' supports head sizes 1..{MAX_HEAD_SIZE}, got {head_size}")

    def write_kv(
        self, kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_kv(kv_cache_layer, k, v, slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return paged_attention(q, kv_cache_layer, meta, scale)
