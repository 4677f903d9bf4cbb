"""CPU tensors in 2 MiB pages: the weights and the KV cache, which every decode step streams.

Why: a batch-1 float32 decode step reads the whole model once (538 MB for the default), which
in 4 KiB pages is ~131K pages a step, each a TLB entry and, where the page walk misses the
caches, a memory access of its own. Transparent huge pages cut that 512-fold where the kernel
gives them on request ("madvise" mode, a common default; "always" gives them anyway). The
default model's 121 products at one row took 0.90-0.93x the time from huge pages as from 4 KiB
ones, at 32 rows 0.96-0.97x, in one process, taking turns (benchmarks/weight_layout.py;
benchmarks/RESULTS.md, "Huge pages and one weight buffer"). Only these long-lived tensors are
advised: the steps' activations stay as torch allocates them (torch's own THP_MEM_ALLOC_ENABLE
would advise every allocation of 2 MiB or more, process-wide, prefill's activations included;
tried first, a 2048-token prefill did not measure faster with it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys

import torch

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # linux/mman.h


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def advise_huge_pages(t: torch.Tensor, huge: bool = True) -> bool:
    """Asks the kernel to back `t`'s memory (CPU, contiguous, page-aligned, not yet written)
    with huge pages, or with `huge=False` never to (benchmarks/weight_layout.py's 4 KiB
    baseline); False where it cannot (not Linux, or a kernel without THP)."""
    madvise = _madvise()
    if madvise is None:
        return False
    if madvise(t.data_ptr(), t.numel() * t.element_size(), _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor starting on a 2 MiB boundary, advised into huge
    pages (one of less than 2 MiB is a plain `torch.empty`). Costs up to 2 MiB of address
    space, which is never touched."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel, size = math.prod(shape), dtype.itemsize
    if numel * size < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(numel + HUGE_PAGE // size, dtype=dtype)
    skip = (-raw.data_ptr() % HUGE_PAGE) // size  # torch aligns to 64 bytes: a whole element
    t = raw[skip : skip + numel].view(shape)
    advise_huge_pages(t)
    return t


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, in huge pages on the CPU (`empty`)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype).zero_()
