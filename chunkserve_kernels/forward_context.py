"""The forward context: attention metadata and the KV cache, visible to every layer.

Threading the metadata and the cache through every `forward` signature (TGI-style) makes
model code about plumbing; instead the executor opens a context around one forward pass
and the attention layers read it. Only one forward runs at a time per process, so a
module-level slot is enough; nesting is refused because it always means a bug (a layer
running a forward of its own would silently see the wrong batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from chunkserve_kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    meta: AttentionMetadata
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; layer l uses kv_cache[l].
    kv_cache: torch.Tensor


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(meta: AttentionMetadata, kv_cache: torch.Tensor) -> Iterator[ForwardContext]:
    """Make `meta` and `kv_cache` the current step's attention inputs for the `with` body."""
    global _current
    if _current is not None:
        raise RuntimeError("nested forward is not allowed: a forward context is already set")
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[3] != meta.block_size:
        raise ValueError(f"kv_cache block size {kv_cache.shape[3]} does not match the metadata's {meta.block_size}")
    _current = ForwardContext(meta=meta, kv_cache=kv_cache)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; raises if called outside one."""
    if _current is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(meta, kv_cache)")
    return _current
