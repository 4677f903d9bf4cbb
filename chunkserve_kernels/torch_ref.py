"""The oracle: naive, obviously correct paged attention, one sequence at a time.

Every other backend is tested against this one, so it trades all speed for being easy to
check by eye: gather each context token's K/V through the block table one position at a
time, repeat K/V heads for GQA, build the end-aligned causal mask explicitly, and do the
math in float64 so its own rounding never hides a bug in the backend under test.
"""

from __future__ import annotations

import torch

from chunkserve_kernels.backend import AttentionBackend
from chunkserve_kernels.metadata import AttentionMetadata


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def forward(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        block_size = kv_cache_layer.shape[2]
        num_q_heads, num_kv_heads = q.shape[1], kv_cache_layer.shape[3]
        group = num_q_heads // num_kv_heads
        block_table = meta.block_table.tolist()
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens)):
            slots = [block_table[i][p // block_size] * block_size + p % block_size for p in range(ctx_len)]
            k = kv_cache_layer[0].reshape(-1, num_kv_heads, q.shape[2])[slots].double()
            v = kv_cache_layer[1].reshape(-1, num_kv_heads, q.shape[2])[slots].double()
            k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
            v = v.repeat_interleave(group, dim=1)
            qi = q[start : start + q_len].double()
            scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
            query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)  # aligned to the end
            allowed = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
            start += q_len
        return out
