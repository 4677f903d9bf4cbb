"""The CPU budget a process reads (affinity, cgroup quota) and the executor's thread rule
(chunkserve_contracts/cpu.py), on fake /proc and /sys/fs/cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from chunkserve_contracts.cpu import CpuBudget, cpu_budget


def fake_root(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_v2_quota_is_read_and_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1",
        {"sys/fs/cgroup/kubepods/cpu.max": "150000 100000", "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000"},
    )
    budget = cpu_budget(root)
    assert budget.quota == 1.5
    assert budget.source.endswith("kubepods")
    assert budget.cpus == min(budget.affinity, 1)


def test_v1_quota_is_read(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "4:cpu,cpuacct:/docker/abc",
        {
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        },
    )
    assert cpu_budget(root).quota == 2.5


def test_no_quota_means_the_affinity_mask(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/", {"sys/fs/cgroup/cpu.max": "max 100000"})
    budget = cpu_budget(root)
    assert budget.quota is None
    assert budget.affinity == len(os.sched_getaffinity(0))


def test_thread_rule_on_two_cores_leaves_one_to_the_scheduler() -> None:
    threads, why = CpuBudget(2, None, "").torch_threads()
    assert threads == 1
    assert "one left to the scheduler" in why
    assert CpuBudget(1, None, "").torch_threads() == (1, "1 CPUs in the affinity mask, no CPU quota: 1 usable")


@given(affinity=st.integers(1, 256), quota=st.one_of(st.none(), st.floats(0.1, 300)), ranks=st.integers(1, 8))
def test_thread_rule_never_plans_more_threads_than_usable_cpus(affinity: int, quota: float | None, ranks: int) -> None:
    budget = CpuBudget(affinity, quota, "x" if quota else "")
    threads, _ = budget.torch_threads(ranks)
    assert threads >= 1
    usable = budget.cpus
    assert usable <= affinity and (quota is None or usable <= max(1, quota))
    if usable >= 2:
        # one CPU left for the scheduler, the rest shared by the ranks (each gets at least one)
        assert threads * ranks <= usable - 1 or threads == 1
    else:
        assert threads == 1
