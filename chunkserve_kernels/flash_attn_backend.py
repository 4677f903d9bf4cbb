"""flash-attn 2 over the paged cache: the fastest GPU path where it is installed.

UNTESTED ON HARDWARE IN THIS REPO: no GPU with flash-attn was available when this was
written. tests/kernels/test_gpu.py compares it with the torch_ref oracle and skips unless
CUDA and flash_attn are present; scripts/gpu_check.sh runs that test. Until it has passed
on a real GPU, treat this backend as unverified (`auto` only picks it with blocks of 256).

What this relies on, read from upstream Dao-AILab/flash-attention
(flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp, 2.6-2.8):

- The public signature is `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False, block_table=None)`. With `block_table` (int32,
  [batch, max_blocks]) k and v are the paged caches `[num_blocks, block_size, Hkv, D]`.
- It does NOT take `seqused_k` (only the internal `_flash_attn_varlen_forward` and vLLM's
  fork do), so the per-sequence key counts go in as `cu_seqlens_k`, the prefix sum of our
  `seqused_k`. With a block table the kernel finds keys through the table, so
  `cu_seqlens_k` only supplies lengths.
- `causal=True` aligns the mask to the bottom-right corner (query j of q sees keys
  0 .. seqlen_k - q + j): our end-aligned convention.
- GQA: query head h reads KV head h // (Hq / Hkv), as in our cache.
- The C++ side refuses a paged block size that is not a multiple of 256 ("Paged KV cache
  block size must be divisible by 256") and head sizes above 256; the Python wrapper pads
  head sizes that are not a multiple of 8, which for a paged cache would copy the whole
  cache every layer, so those are refused here instead.

K/V are written with the torch `index_copy_` of the base class: exact, two small kernels
per layer, and no dependency on Triton.
"""

from __future__ import annotations

import torch

from chunkserve_kernels.backend import AttentionBackend
from chunkserve_kernels.metadata import AttentionMetadata

BLOCK_MULTIPLE = 256
MAX_HEAD_SIZE = 256


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supported_dtypes = (torch.bfloat16, torch.float16)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or block_size % BLOCK_MULTIPLE:
            raise ValueError(
                f"attention backend 'flash_attn' needs --block-size to be a multiple of {BLOCK_MULTIPLE} "
                f"(upstream flash-attn 2 pages the KV cache only in such blocks), got {block_size}; "
                "use --block-size 256, or --attention-backend triton for smaller blocks"
            )

    def check_head_size(self, head_size: int) -> None:
        if not (0 < head_size <= MAX_HEAD_SIZE and head_size % 8 == 0):
            raise ValueError(
                f"attention backend 'flash_attn' supports head sizes that are multiples of 8 up to "
                f"{MAX_HEAD_SIZE}, got {head_size}; use --attention-backend triton"
            )

    def forward(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func  # lazy: only GPU machines have it

        cu_seqlens_k = meta.scratch.get(self.name)
        if cu_seqlens_k is None:  # once per step, shared by all layers
            cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
            torch.cumsum(meta.seqused_k, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
            meta.scratch[self.name] = cu_seqlens_k
        return flash_attn_varlen_func(
            q,
            kv_cache_layer[0],
            kv_cache_layer[1],
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_table,
        )
