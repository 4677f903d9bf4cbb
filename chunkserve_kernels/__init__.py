"""chunkserve_kernels: paged varlen attention for the executor.

The folder has the import name: a top-level `kernels` package (this folder's name until
3150927) would collide with Hugging Face's own distribution of that name, which transformers
imports; from the repository root the folder would shadow it (tests/test_packaging.py).
"""

from __future__ import annotations

from chunkserve_kernels.backend import (
    DEFAULT_BACKEND,
    AttentionBackend,
    available_backends,
    choose_backend,
    get_backend,
    register_backend,
)
from chunkserve_kernels.forward_context import ForwardContext, get_forward_context, set_forward_context
from chunkserve_kernels.metadata import AttentionMetadata, build_metadata

__all__ = [
    "DEFAULT_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "available_backends",
    "build_metadata",
    "choose_backend",
    "get_backend",
    "get_forward_context",
    "register_backend",
    "set_forward_context",
]
