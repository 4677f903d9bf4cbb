"""What this machine's CPU is (read once from /proc/cpuinfo) and how much of it this process may
use (its affinity mask and cgroup quota). Torch-free: both processes use it.

Several decisions key on the CPU: which row table a reduced-precision mode starts from (a native
bfloat16 instruction or not), the name a kept linear plan is filed under, and the name of the
native kernels' build (code compiled with -march=native is valid only on CPUs with the same
flags). One reader, so they all see the same CPU.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path


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


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """How many CPUs this process can actually use: its affinity mask, and a cgroup CPU quota
    (a container's `--cpus`, a Kubernetes CPU limit) that the mask does not show."""

    affinity: int  # CPUs in this process's affinity mask
    quota: float | None  # CPUs' worth of time the cgroup quota allows per period; None = no quota
    source: str  # where the quota was read, for the log ("" without one)

    @property
    def cpus(self) -> int:
        """Whole CPUs to plan threads for: the mask, or the quota rounded down when it is lower
        (a 1.5-CPU quota runs two threads at 75% each: both wait at every barrier), at least 1."""
        limit = self.affinity if self.quota is None else min(self.affinity, int(self.quota + 1e-9))
        return max(1, limit)

    def describe(self) -> str:
        quota = f"a {self.quota:g}-CPU quota ({self.source})" if self.quota is not None else "no CPU quota"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"

    def torch_threads(self, ranks: int = 1) -> tuple[int, str]:
        """The fixed torch thread count per tensor-parallel rank, and why (a single executor
        starts with every usable CPU and moves by measurement instead: executor_svc/threads.py).

        One CPU is left to the scheduler process (its event loop, gRPC and the tokenizer run
        beside every step) wherever there are two or more: torch's OpenMP threads spin-wait for
        each other at every parallel region, so a thread that shares its core with the
        scheduler or with anyone else's work stalls all of them. Measured on a 2-core machine
        (benchmarks/shared_cpu.py, docs/cpu.md 'Threads on a shared CPU'): with one other busy
        process, 2 threads fell to 0.43x of their idle batch-1 speed and 0.25x at batch 8,
        1 thread kept 0.96x and 0.94x; its idle speed, 0.93x / 0.95x of 2 threads in that run,
        was 0.80-0.84x / 0.62-0.67x in a quieter A/B (benchmarks/RESULTS.md, 'The thread
        governor'), which is why a single executor no longer uses this rule."""
        cpus = self.cpus
        spare = cpus - 1 if cpus >= 2 else cpus
        threads = max(1, spare // max(1, ranks))
        why = f"{self.describe()}: {cpus} usable"
        why += ", one left to the scheduler process" if cpus >= 2 else ""
        why += f", split over {ranks} tensor-parallel ranks" if ranks > 1 else ""
        return threads, why


def cpu_budget(root: Path = Path("/")) -> CpuBudget:
    """This process's CpuBudget (`root`: tests read a fake /proc and /sys/fs/cgroup)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    quota, source = _cgroup_quota(root)
    return CpuBudget(affinity, quota, source)


def _cgroup_quota(root: Path) -> tuple[float | None, str]:
    """The tightest CPU quota on this process's cgroup path (v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`), walking up to the root: a parent's limit holds
    for its children. Inside a container the path in /proc/self/cgroup may name the host's
    hierarchy while the container sees its own cgroup at the mount's root, so the mount root
    is read too."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, ""
    best: tuple[float | None, str] = (None, "")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            mounts = [root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"]
            read = _v2_quota
        elif "cpu" in controllers.split(","):
            mounts = [root / "sys/fs/cgroup" / controllers, root / "sys/fs/cgroup/cpu"]
            read = _v1_quota
        else:
            continue
        for mount in mounts:
            for folder in _ancestors(mount, path):
                quota = read(folder)
                if quota is not None and (best[0] is None or quota < best[0]):
                    best = (quota, str(folder.relative_to(root)))
    return best


def _ancestors(mount: Path, path: str) -> list[Path]:
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds of CPU time so far: busy time of the CPUs in this process's affinity mask
    (steal included: a hypervisor that took the CPU disturbed us too) and this process's own."""

    busy: float
    own: float
    wall: float
    cpus: int

    def others_share(self, earlier: CpuTimes) -> float:
        """The fraction of our CPUs' time other processes used between `earlier` and now:
        ~0 on an idle machine, 0.5 with one busy process on one of two CPUs."""
        wall = (self.wall - earlier.wall) * self.cpus
        others = (self.busy - earlier.busy) - (self.own - earlier.own)
        return max(0.0, others / wall) if wall > 0 else 0.0


def cpu_times(root: Path = Path("/")) -> CpuTimes | None:
    """Now's CpuTimes from /proc/stat and /proc/self/stat; None where they cannot be read."""
    import time

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        mine = set(os.sched_getaffinity(0))
        busy = 0
        for line in (root / "proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in mine:
                values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(values) - values[3] - values[4]
        stat = (root / "proc/self/stat").read_text()
        own = sum(int(v) for v in stat.rsplit(")", 1)[1].split()[11:13])  # utime, stime
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return CpuTimes(busy / tick, own / tick, time.monotonic(), len(mine))
