"""The default CPU backend: paged varlen attention on top of torch SDPA.

One step mixes decode tokens and prefill chunks. Decodes dominate the step count, so all
of them are batched: ONE padded gather of their keys and ONE attention call. A decode
query has a single position, so its GQA group of `Hq / Hkv` query heads is laid out as
the "query length" axis of its KV head (q viewed as [D, Hkv, group, head_dim]) -- no K/V
repeat, no mask beyond key padding. Prefill chunks are few and large; each gets its own
SDPA call, with `is_causal` when the chunk starts the sequence and an end-aligned mask
otherwise.

Decode attention on CPU is memory-bound: every decode reads its whole context's K/V, in
random blocks. So the gather indices, masks and buffers are planned once per step and
reused by all layers through `AttentionMetadata.scratch`, the gather is head-major (the
math reads contiguous [Hkv, ctx, head_dim] keys), and in float32 V is never gathered at
all: `embedding_bag` with the attention probabilities as per-sample weights computes
P @ V straight from the paged cache (one read of V instead of gather-write-read; ~20%
less decode attention time at 32 x 256 tokens on a 2-core AVX2 machine). bfloat16 keeps
SDPA because bf16 bmm has no fast path on CPUs without AVX512-BF16/AMX.

A small pure-decode step (at most SINGLE_THREAD_MAX_ROWS gathered key rows, e.g. one
sequence of up to ~1300 tokens for 3 KV heads) runs its attention on one thread: its ops
(gather, bmm, softmax, embedding_bag) are a few microseconds of work each, and with two
OpenMP threads every one of them is a fork/join; when the other core is busy with another
process, each such barrier waits for a scheduler time slice (measured on a shared 2-core
machine: softmax of 9 x 200 scores 8 ms per call instead of 3 us). Switching the thread
count costs ~0.4 us; the GEMMs around the attention keep all threads.

With the native kernels switched on (`TorchBackend.use_native`, chunkserve_kernels/cpu_native.py) a
float32 step's decode attention is one op that reads each sequence's keys and values once
straight from the cache blocks (no gather, no per-layer buffers, its own threading rule), and
K/V writes are one op; prefill chunks keep SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkserve_kernels.backend import AttentionBackend
from chunkserve_kernels.metadata import AttentionMetadata

SINGLE_THREAD_MAX_ROWS = 4096  # gathered K rows (decodes x KV heads x context) run on one thread


def _native_ok(cache: torch.Tensor) -> bool:
    """The native ops take a contiguous float32 CPU cache layer (the executor's own)."""
    return cache.dtype == torch.float32 and cache.device.type == "cpu" and cache.is_contiguous()


@dataclass(slots=True)
class _DecodePlan:
    tokens: torch.Tensor | None  # flat token index of each decode; None if they are tokens 0..D-1
    rows: torch.Tensor | None  # [D*Hkv*max_ctx] row indices into the cache viewed as [slots*Hkv, head_dim]
    mask: torch.Tensor | None  # [D, 1, 1, max_ctx] True = real key; None when all contexts are equal
    max_ctx: int
    pad: torch.Tensor | None = None  # ~mask (True = padding key), inverted once per step
    k_buf: torch.Tensor | None = None  # reused by every layer of the step
    keys_t: torch.Tensor | None = None  # k_buf as [D*Hkv, head_dim, max_ctx] (a transposed view)
    v_buf: torch.Tensor | None = None
    bag_rows: torch.Tensor | None = None  # float32 path: V rows per query head, [D*Hq*max_ctx]
    bag_offsets: torch.Tensor | None = None
    tables: torch.Tensor | None = None  # native path: int32 [D, max_blocks] block tables of the decodes
    ctx_lens: torch.Tensor | None = None  # native path: int32 [D] their context lengths


@dataclass(slots=True)
class _PrefillPlan:
    start: int  # first flat token of the chunk
    end: int
    ctx: int  # context length including the chunk
    rows: torch.Tensor  # [Hkv*ctx] head-major row indices
    mask: torch.Tensor | None  # [q, ctx] end-aligned causal mask; None -> is_causal (no prior context)


@dataclass(slots=True)
class _StepPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillPlan]
    pure_decode: bool
    single_thread: bool = False  # a small pure-decode step: attention on one thread (module doc)


def _head_major_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., n] slots -> [..., Hkv, n] row indices into the cache viewed as [slots*Hkv, D]."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots.unsqueeze(-2) * num_kv_heads + heads[:, None]).reshape(-1)


def _plan_step(meta: AttentionMetadata, num_kv_heads: int, device: torch.device, native: bool = False) -> _StepPlan:
    """What every layer of the step reuses; `native`: the decodes go to the native op, which
    needs only their block tables and context lengths (no gather rows, masks or buffers)."""
    bs = meta.block_size
    block_table = meta.block_table.to(torch.int64)
    decode_seqs, decode_tokens, prefills = [], [], []
    start = 0
    for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if q_len == 1:
            decode_seqs.append(i)
            decode_tokens.append(start)
        else:
            pos = torch.arange(ctx, device=device)
            slots = block_table[i, pos // bs] * bs + pos % bs
            mask = None
            if ctx > q_len:
                query_pos = torch.arange(ctx - q_len, ctx, device=device)
                mask = pos[None, :] <= query_pos[:, None]
            prefills.append(_PrefillPlan(start, start + q_len, ctx, _head_major_rows(slots, num_kv_heads), mask))
        start += q_len

    decode = None
    in_order = decode_tokens == list(range(len(decode_tokens)))
    if decode_seqs and native:
        tokens = None if in_order else torch.tensor(decode_tokens, device=device)
        if len(decode_seqs) == meta.num_seqs:
            tables, ctx_t = meta.block_table, meta.seqused_k
        else:
            idx = torch.tensor(decode_seqs, device=device)
            tables, ctx_t = meta.block_table.index_select(0, idx), meta.seqused_k.index_select(0, idx)
        max_ctx = max(meta.context_lens[i] for i in decode_seqs)
        decode = _DecodePlan(tokens, None, None, max_ctx, tables=tables.to(torch.int32), ctx_lens=ctx_t.to(torch.int32))
        return _StepPlan(decode, prefills, pure_decode=not prefills)
    if decode_seqs:
        ctx_lens = [meta.context_lens[i] for i in decode_seqs]
        max_ctx = max(ctx_lens)
        ctx_t = torch.tensor(ctx_lens, device=device)
        pos = torch.arange(max_ctx, device=device)
        # Padding positions re-read the last real token: always a valid slot, masked out.
        clamped = torch.minimum(pos[None, :], (ctx_t - 1)[:, None])
        tables = block_table.index_select(0, torch.tensor(decode_seqs, device=device))
        slots = tables.gather(1, clamped // bs) * bs + clamped % bs
        mask = None if min(ctx_lens) == max_ctx else (pos[None, :] < ctx_t[:, None])[:, None, None, :]
        tokens = None if in_order else torch.tensor(decode_tokens, device=device)
        pad = None if mask is None else ~mask
        decode = _DecodePlan(tokens, _head_major_rows(slots, num_kv_heads), mask, max_ctx, pad=pad)
    single = decode is not None and not prefills and device.type == "cpu"
    single = single and decode.rows.shape[0] <= SINGLE_THREAD_MAX_ROWS
    return _StepPlan(decode, prefills, pure_decode=not prefills, single_thread=single)


class TorchBackend(AttentionBackend):
    name = "torch"
    supported_dtypes = (torch.float32, torch.bfloat16)

    def use_native(self, enabled: bool = True) -> None:
        """Switches this backend's float32 CPU decode attention and K/V writes to the native ops
        (chunkserve_kernels/csrc/cpu_attention.cpp) or back; enabling needs `cpu_native.load()` to have
        succeeded in this process (raises otherwise)."""
        from chunkserve_kernels import cpu_native

        if enabled and not cpu_native.loaded():
            raise RuntimeError("the native CPU kernels are not loaded (chunkserve_kernels.cpu_native.load())")
        self.native = enabled

    def decode_inputs(
        self, meta: AttentionMetadata, kv_cache_layer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """AttentionBackend.decode_inputs on the native path (planned once per step, shared
        with `forward`)."""
        if not (self.native and _native_ok(kv_cache_layer)):
            return None
        plan = self._step_plan(meta, kv_cache_layer)
        dec = plan.decode
        if not plan.pure_decode or dec is None or dec.tables is None or dec.tokens is not None:
            return None
        return dec.tables, dec.ctx_lens

    def write_kv(
        self, kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The base class's two index_copy_ calls, or one native op (float32, `use_native`)."""
        if self.native and _native_ok(kv_cache_layer) and k.dtype == torch.float32 and v.dtype == torch.float32:
            torch.ops.chunkserve.write_kv(kv_cache_layer, k, v, slot_mapping)
        else:
            super().write_kv(kv_cache_layer, k, v, slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_tokens, num_q_heads, head_dim = q.shape
        num_kv_heads = kv_cache_layer.shape[3]
        plan = self._step_plan(meta, kv_cache_layer)
        if plan.decode is not None and plan.decode.tables is not None:
            return self._native(q, kv_cache_layer, plan, scale)
        k_rows = kv_cache_layer[0].view(-1, head_dim)
        v_rows = kv_cache_layer[1].view(-1, head_dim)
        if plan.single_thread:
            threads = torch.get_num_threads()
            if threads > 1:
                torch.set_num_threads(1)
                try:
                    return self._decode(q, k_rows, v_rows, plan.decode, num_kv_heads, scale)
                finally:
                    torch.set_num_threads(threads)
        if plan.pure_decode:
            return self._decode(q, k_rows, v_rows, plan.decode, num_kv_heads, scale)

        out = q.new_empty(num_tokens, num_q_heads, head_dim)
        if plan.decode is not None:
            dec = self._decode(q, k_rows, v_rows, plan.decode, num_kv_heads, scale)
            if plan.decode.tokens is None:
                out[: dec.shape[0]] = dec
            else:
                out.index_copy_(0, plan.decode.tokens, dec)
        self._prefills(q, kv_cache_layer, plan, scale, out)
        return out

    def _step_plan(self, meta: AttentionMetadata, kv_cache_layer: torch.Tensor) -> _StepPlan:
        """What every layer of the step reuses, planned by the first layer that asks."""
        plan = meta.scratch.get(self.name)
        if plan is None:
            native = self.native and _native_ok(kv_cache_layer)
            plan = meta.scratch[self.name] = _plan_step(meta, kv_cache_layer.shape[3], kv_cache_layer.device, native)
        return plan

    def _native(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, plan: _StepPlan, scale: float) -> torch.Tensor:
        """The step's decodes through the native op (one call for all of them), its prefill
        chunks through SDPA as below."""
        dec = plan.decode
        num_dec = dec.ctx_lens.shape[0]
        qd = q[:num_dec] if dec.tokens is None else q.index_select(0, dec.tokens)
        out_dec = torch.ops.chunkserve.paged_decode_attention(qd, kv_cache_layer, dec.tables, dec.ctx_lens, scale)
        if plan.pure_decode:
            return out_dec
        out = q.new_empty(q.shape)
        if dec.tokens is None:
            out[:num_dec] = out_dec
        else:
            out.index_copy_(0, dec.tokens, out_dec)
        self._prefills(q, kv_cache_layer, plan, scale, out)
        return out

    def _prefills(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, plan: _StepPlan, scale: float, out: torch.Tensor
    ) -> None:
        """Each prefill chunk of the step: its context gathered head-major, one SDPA call, into `out`."""
        num_kv_heads, head_dim = kv_cache_layer.shape[3], q.shape[2]
        k_rows = kv_cache_layer[0].view(-1, head_dim)
        v_rows = kv_cache_layer[1].view(-1, head_dim)
        for chunk in plan.prefills:
            k = k_rows.index_select(0, chunk.rows).view(1, num_kv_heads, chunk.ctx, head_dim)
            v = v_rows.index_select(0, chunk.rows).view(1, num_kv_heads, chunk.ctx, head_dim)
            qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
            if qc.stride(-1) != 1:
                # q from a linear's transposed view ((W @ x^T)^T): SDPA's CPU flash kernel needs
                # each head's values adjacent, and without them torch takes its math path
                # (a 2K-token chunk's attention 5.8x slower: benchmarks/RESULTS.md, issue 31)
                qc = qc.contiguous()
            o = F.scaled_dot_product_attention(
                qc, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
            )
            out[chunk.start : chunk.end] = o[0].transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, plan: _DecodePlan, num_kv_heads: int, scale: float
    ) -> torch.Tensor:
        """All decode tokens in one gather + one attention; returns [D, Hq, head_dim]."""
        num_rows, head_dim = plan.rows.shape[0], k_rows.shape[1]
        num_dec, num_q_heads = num_rows // (num_kv_heads * plan.max_ctx), q.shape[1]
        group = num_q_heads // num_kv_heads
        qd = q[:num_dec] if plan.tokens is None else q.index_select(0, plan.tokens)
        if plan.k_buf is None or plan.k_buf.dtype != k_rows.dtype:
            plan.k_buf = k_rows.new_empty(num_rows, head_dim)
            plan.keys_t = plan.k_buf.view(num_dec * num_kv_heads, plan.max_ctx, head_dim).transpose(1, 2)
        torch.index_select(k_rows, 0, plan.rows, out=plan.k_buf)

        if k_rows.dtype == torch.float32:
            if plan.bag_rows is None:
                rows = plan.rows.view(num_dec, num_kv_heads, 1, plan.max_ctx)
                plan.bag_rows = rows.expand(-1, -1, group, -1).reshape(-1)
                plan.bag_offsets = torch.arange(0, plan.bag_rows.shape[0], plan.max_ctx, device=q.device)
            # (q * scale) is contiguous [D, Hq, hd] = [D*Hkv, group, hd]: one 3-D bmm, bitwise
            # what a 4-D matmul gives (it folds to the same bmm), with fewer ops around it.
            qs = (qd * scale).reshape(num_dec * num_kv_heads, group, head_dim)
            scores = torch.bmm(qs, plan.keys_t)  # [D*Hkv, group, ctx]
            if plan.pad is not None:
                scores.view(num_dec, num_kv_heads, group, plan.max_ctx).masked_fill_(plan.pad, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out = F.embedding_bag(
                plan.bag_rows, v_rows, plan.bag_offsets, mode="sum", per_sample_weights=probs.view(-1)
            )
            return out.view(num_dec, num_q_heads, head_dim)

        qd = qd.reshape(num_dec, num_kv_heads, group, head_dim)
        keys = plan.k_buf.view(num_dec, num_kv_heads, plan.max_ctx, head_dim)
        if plan.v_buf is None or plan.v_buf.dtype != v_rows.dtype:
            plan.v_buf = v_rows.new_empty(num_rows, head_dim)
        torch.index_select(v_rows, 0, plan.rows, out=plan.v_buf)
        values = plan.v_buf.view(num_dec, num_kv_heads, plan.max_ctx, head_dim)
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=plan.mask, scale=scale)
        return o.reshape(num_dec, num_q_heads, head_dim)
