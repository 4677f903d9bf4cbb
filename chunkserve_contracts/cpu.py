"""What this machine's CPU is, read once from /proc/cpuinfo (torch-free: both processes use it).

Several decisions key on it: which row table a reduced-precision mode starts from (a native
bfloat16 instruction or not), the name a kept linear plan is filed under, and the name of the
native kernels' build (code compiled with -march=native is valid only on CPUs with the same
flags). One reader, so they all see the same CPU.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str  # "model name", e.g. "AMD EPYC"; platform.processor() where /proc/cpuinfo is absent
    flags: frozenset[str]  # feature flags ("avx2", "avx512_bf16", ...); empty where unknown

    @property
    def native_bf16(self) -> bool:
        """A bfloat16 dot-product instruction (AVX512-BF16 or AMX-BF16): torch's bfloat16 GEMM
        (oneDNN) then runs at native speed and reads half float32's bytes; without it it
        converts as it goes and wins only at one row."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        """Model name and sorted flags, one string: what a build or a measurement is valid for."""
        return " ".join([self.model, *sorted(self.flags)])


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU (the first processor's entry: a VM shows every core alike)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if sep and key in ("model name", "flags") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return CpuInfo(model, frozenset(fields.get("flags", "").split()))
