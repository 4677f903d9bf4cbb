"""The small benchmark scripts still run (the long ones are run by hand: benchmarks/RESULTS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunkserve_kernels import cpu_native

pytestmark = pytest.mark.slow  # starts real server processes: the full tier only

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_scheduler_overhead_runs_both_settings_and_reports_the_difference():
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "scheduler_overhead.py"),
            "--num-prompts",
            "24",
            "--input-len",
            "100",
            "--output-len",
            "8",
            "--concurrency",
            "6",
            "--max-num-batched-tokens",
            "200",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum("caching on " in line for line in lines) == 2 and sum("caching off" in line for line in lines) == 2
    # A 200-token budget splits 100-token prompts, so block-aligned chunks change the plans.
    assert "the plans DIFFER" in out.stdout
    assert "extra as a share of" in out.stdout


def test_watch_steps_overhead_runs_and_every_subscriber_gets_the_trace():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "watch_steps_overhead.py"), "--tokens", "24"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if "subscribers:" in line]
    assert [int(r[0]) for r in rows] == [0, 1, 4, 4, 1, 0]
    for r in rows:  # subscribers get traces (how many depends on when each subscription lands: not checked)
        received = int(r[4])
        assert (received == 0) if r[0] == "0" else received > 0, r


def test_cpu_gemm_shapes_prints_a_row_per_count_with_its_padding():
    # one decoder layer's linears and the head: every column's code path, not the table's figures
    args = ["--rows", "1", "3", "8", "--reps", "1", "--layers", "1"]
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cpu_gemm_shapes.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["1", "2"], ["3", "4"], ["8", "8"]]
    assert all(len(r) == 11 and all(float(v) > 0 for v in r[2:9]) for r in rows)
    # packed (oneDNN) and gemv (the native library): a time, or nan where this torch / machine lacks it
    native = cpu_native.load() is None
    for r in rows:
        assert (float(r[10]) > 0) if native else r[10] == "nan", r
        assert (float(r[9]) > 0) if torch.backends.mkldnn.is_available() else r[9] == "nan", r


def test_step_idle_reads_idle_time_from_a_trace():
    sys.path.insert(0, str(BENCHMARKS))
    import step_idle

    lines = [
        '{"timestamp": 10.0, "executorNs": "4000000", "numRunning": 1}',  # step 0: stepId omitted, as JSON does
        '{"stepId": "1", "timestamp": 10.010, "executorNs": "5000000", "numRunning": 1}',
        '{"stepId": "2", "timestamp": 10.020, "executorNs": "6000000", "numWaiting": 1}',
        '{"stepId": "7", "timestamp": 11.0, "executorNs": "1000000"}',  # after a restart: not a pair
    ]
    idle, wall, executor = step_idle.idle_ms(lines)
    assert [round(x, 6) for x in idle] == [6.0, 5.0] and executor == [4.0, 5.0]
    assert round(wall, 6) == 1000.0
    # With the executor's start times (async scheduling plans step 2 before step 1 ends: the
    # planning times say nothing), and a gap with nothing running or waiting left out.
    lines = [
        '{"stepId": "1", "timestamp": 10.0, "executorNs": "4000000", "executorStartUnixNs": "100000000", "numRunning": 2}',
        '{"stepId": "2", "timestamp": 10.001, "executorNs": "5000000", "executorStartUnixNs": "104500000", "numRunning": 2}',
        '{"stepId": "3", "timestamp": 10.002, "executorNs": "6000000", "executorStartUnixNs": "109600000"}',
        '{"stepId": "4", "timestamp": 10.5, "executorNs": "6000000", "executorStartUnixNs": "600000000", "numWaiting": 1}',
    ]
    idle, _, executor = step_idle.idle_ms(lines)
    assert [round(x, 6) for x in idle] == [0.5, 0.1] and executor == [4.0, 5.0]


def test_step_idle_runs_async_scheduling_on_the_byte_tokenizer_model():
    """What scripts/gpu_check.sh --idle runs, small: real servers on `--model tiny-bytes` (no
    default model needed), plain vs --async-scheduling, idle time from the executor's clock."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "step_idle.py"),
            "--model",
            "tiny-bytes",
            "--settings",
            "off",
            "async-sched",
            "--streams",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "16",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line[:30].strip(): line[30:].split() for line in out.stdout.splitlines() if line[:30].strip()}
    assert "async-sched/off" in out.stdout and "model tiny-bytes" in out.stdout
    assert all(float(v) > 0 for v in rows["output tok/s"]) and len(rows["idle per step, mean ms"]) == 3


def test_decode_attention_threads_times_both_thresholds_and_finds_them_equal():
    pytest.importorskip("chunkserve_kernels.cpu_native")
    if cpu_native.load() is not None:
        pytest.skip("the native CPU kernels do not build here")
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "decode_attention_threads.py"), "--ctx", "16", "600", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["16", "48"], ["600", "1800"]]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 and r[-2] == "True" for r in rows)
    assert float(rows[0][-1]) == 0.0 and float(rows[1][-1]) < 1e-5  # 600 tokens: two pieces, float32 rounding


def test_weight_layout_times_every_layout_at_each_row_count():
    """benchmarks/weight_layout.py (issue 31, item 7): one layer's linears and the head, one round."""
    args = ["--rows", "1", "8", "--rounds", "1", "--layers", "1"]
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "weight_layout.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["8"])]
    assert [r[0] for r in rows] == ["1", "8"], out.stdout
    native = cpu_native.load() is None
    assert [r[1] for r in rows] == (["gemv", "F.linear"] if native else ["F.linear", "F.linear"])
    for r in rows:  # three layouts, each ms (multiple of the floor), then the two ratios
        assert len(r) == 10 and all(float(r[i]) > 0 for i in (2, 4, 6, 8, 9)), r


def test_batch1_floor_prints_each_figure_against_the_floor_it_measured():
    """The batch-1 floor benchmark (issue 31, item 7) on the default model: one short round, two
    scheduler settings measured beside the same floor."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "batch1_floor.py"),
            *("--rounds", "1", "--steps", "2", "--max-tokens", "4"),
            *("--scheduler-args", "", "--scheduler-args", "--num-scheduler-steps 4"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    floor, figures = None, []  # the in-process step, then a server token per setting, in order
    for line in out.stdout.splitlines():
        parts = line.split()
        if line.startswith(("in-process step", "server token")):
            figures.append((line[:15].strip(), float(parts[2]), float(parts[4].rstrip("x")), line))
        elif line.startswith("weight-read floor"):
            floor = float(parts[2])
    assert floor and [f[0] for f in figures] == ["in-process step", "server token", "server token"], out.stdout
    assert figures[1][3].endswith("[defaults]") and figures[2][3].endswith("[--num-scheduler-steps 4]")
    for _, ms, ratio, _ in figures:
        # each ratio is its figure over the floor (all three printed rounded: 3% covers that)
        assert ms > 0 and abs(ms / floor - ratio) <= 0.03 * ratio + 0.005


def test_step_ab_takes_turns_between_two_trees_and_prints_each_ratio():
    """benchmarks/step_ab.py with this tree as both old and new: two short rounds, each with
    both figures, its ratio, and the median over the rounds. With plans of 2 steps each
    (--num-steps; one-step turns time batch1_floor.step_ms, which its own test runs)."""
    root = str(BENCHMARKS.parent)
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "step_ab.py"), "--old", root, "--new", root, "--rounds", "2", "--steps", "2"]
        + ["--num-steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [line.split() for line in out.stdout.splitlines() if line.startswith("round ")]
    assert [r[1] for r in rounds] == ["1:", "2:"], out.stdout
    ratios = []
    for r in rounds:
        old, new, ratio = float(r[3]), float(r[8]), float(r[13])
        assert old > 0 and new > 0 and abs(new / old - ratio) <= 0.002 + 0.002 * ratio, r
        ratios.append(ratio)
    [last] = [line for line in out.stdout.splitlines() if line.startswith("median new/old")]
    assert abs(float(last.split()[2]) - sum(ratios) / 2) <= 0.002, last


def test_multi_step_benchmark_reports_each_setting_against_the_first():
    """benchmarks/multi_step.py on two servers, one short round: a row per setting, each figure
    with its ratio to the first setting's (1.00x for the first itself), and the tokens a message
    of the batch-1 stream carried: one a message with one step a plan, more in plans of 4
    answered at once (`4b`)."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "multi_step.py"),
            *("--steps", "1", "4b", "--rounds", "1", "--streams", "2", "--stream-tokens", "4"),
            *("--arrivals", "2", "--max-tokens", "12"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["4b"])]
    assert [r[0] for r in rows] == ["1", "4b"], out.stdout
    assert rows[0][2::2] == ["(1.00x)"] * 4, out.stdout
    assert all(float(r[i]) > 0 for r in rows for i in (1, 3, 5, 7)), out.stdout
    assert float(rows[0][9]) == 1.0 and float(rows[1][9]) > 1.5, out.stdout


@pytest.mark.slow  # loads the default model, ~20 s
def test_plan_kernel_ab_times_both_kernels_in_whole_steps():
    """benchmarks/plan_kernel_ab.py (issue 31, item 7): one short batch size, both kernels timed."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "plan_kernel_ab.py"), "--batch", "2", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("batch")]
    parts = line.replace(",", "").split()
    mm, packed, ratio = float(parts[5]), float(parts[8]), float(parts[11].rstrip("x"))
    assert mm > 0 and packed > 0 and abs(mm / packed - ratio) <= 0.01 + 0.01 * ratio


def test_penalties_cost_part_runs():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "penalties.py"), "--parts", "cost", "--streams", "4", "--prompt-len", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 penalized rows x 49152" in out.stdout and "TokenHistory of a 64-token prompt" in out.stdout
