"""Attention backend interface and a tiny registry by name.

A backend is a stateless strategy object: it writes this step's K/V into the paged cache
and computes causal attention for a flat varlen batch. Backends declare what they support
(dtypes, head sizes, block sizes) so that start-up fails with a clear message instead of a
kernel error deep inside the first forward. The registry (chunkserve_contracts.registry) maps names
to "module:Class" strings and imports lazily, so a CPU machine never imports flash-attn or
Triton.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from chunkserve_contracts.registry import Registry
from chunkserve_kernels.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged causal attention over one layer's cache `[2, num_blocks, block_size, Hkv, D]`."""

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]]
    # Whether a decode step through this backend can be captured as a CUDA graph
    # (executor_svc/cuda_graphs.py): its kernels read every length from the metadata's device
    # tensors, never from its host fields, which a graph freezes at capture.
    graph_safe: ClassVar[bool] = False
    # Decode attention and K/V writes on the native CPU ops (`use_native`; the torch backend's).
    native: bool = False

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError if this backend cannot use `block_size` (default: any positive)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")

    def check_head_size(self, head_size: int) -> None:
        """Raise ValueError if this backend cannot use `head_size` (default: any positive)."""
        if head_size <= 0:
            raise ValueError(f"head size must be positive, got {head_size}")

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError if this backend cannot compute in `dtype`."""
        if dtype not in self.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(
                f"attention backend {self.name!r} does not support dtype "
                f"{str(dtype).removeprefix('torch.')}; use one of: {names}"
            )

    def write_kv(
        self, kv_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store K/V `[T, Hkv, D]` of the step's new tokens at their flat slots.

        `view` (not `reshape`) on purpose: a non-contiguous cache would make reshape copy,
        and the write would silently land in a temporary.
        """
        num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
        kv_cache_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        kv_cache_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def use_native(self, enabled: bool = True) -> None:
        """Switches decode attention and K/V writes to the native CPU ops (chunkserve_kernels/csrc) or back;
        a backend without such ops refuses to switch them on."""
        if enabled:
            raise ValueError(f"attention backend {self.name!r} has no native CPU ops")

    def decode_inputs(
        self, meta: AttentionMetadata, kv_cache_layer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The hook of the fused decode path (executor_svc/models/fused.py): (int32 block
        tables, int32 context lengths) of a pure-decode step in sequence order that this
        backend would attend with the native op, which the fused layers then call in its
        place; None for any other step, and always None here (no native decode)."""
        return None

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of q `[T, Hq, D]` over the cached context; returns `[T, Hq, D]`.

        The step's own K/V must already be written (write_kv) before this is called.
        """


BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend",
    {
        "torch": "chunkserve_kernels.torch_backend:TorchBackend",
        "torch_ref": "chunkserve_kernels.torch_ref:TorchRefBackend",
        "triton": "chunkserve_kernels.triton_attn:TritonBackend",
        "flash_attn": "chunkserve_kernels.flash_attn_backend:FlashAttnBackend",
    },
)
DEFAULT_BACKEND = "torch"


def register_backend(name: str, target: str) -> None:
    """Register `"module:Class"` under `name` (imported only when first requested)."""
    BACKENDS.register(name, target)


def available_backends() -> list[str]:
    return BACKENDS.names()


def get_backend(name: str = DEFAULT_BACKEND) -> AttentionBackend:
    """Instantiate the backend registered as `name`."""
    return BACKENDS.get(name)()


def _importable(module: str) -> bool:
    """True if `module` could be imported, without importing it (no CUDA init, no JIT)."""
    return importlib.util.find_spec(module) is not None


def choose_backend(device: torch.device | str, dtype: torch.dtype, block_size: int) -> str:
    """The backend `--attention-backend auto` means on this machine.

    flash_attn where it can run (CUDA, installed, fp16/bf16, and a block size upstream
    flash-attn 2 accepts for a paged cache: a multiple of 256); else the Triton kernel on
    CUDA (any block size); else the torch backend, which runs everywhere.
    """
    if torch.device(device).type != "cuda":
        return "torch"
    fa_ok = dtype in (torch.float16, torch.bfloat16) and block_size % 256 == 0
    if fa_ok and _importable("flash_attn"):
        return "flash_attn"
    if _importable("triton"):
        return "triton"
    return "torch"
