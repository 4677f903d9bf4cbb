"""`chunkserve tune` against a real tiny server: --calibrate drives a calibration run and fits
the cost model; a shared-prefix bench run's report and the server's step trace both carry the
prefix structure, and replaying them shows prefix-cache hits (units in test_tune.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from chunkserve.tune.cost import fit_with_error, load_trace
from chunkserve.tune.replay import replay, requests_from_bench, requests_from_trace
from scheduler_svc.config import SchedulerConfig

BUDGET = 128


def run_cli(args: list[str], timeout: float = 300) -> str:
    """`chunkserve ARGS` in a child process; asserts exit 0 and that torch was not imported."""
    code = (
        "import sys\nfrom chunkserve.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    rc = e.code\nassert rc == 0, rc\nassert 'torch' not in sys.modules, 'imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # a real server pair, a calibration run and a bench run
def test_calibrate_and_shared_prefix_structure_from_a_live_server(tiny_model_path, launch, tmp_path):
    server_trace = tmp_path / "server-steps.jsonl"
    server = launch(
        ["--model", str(tiny_model_path), "--max-num-batched-tokens", str(BUDGET)],
        ["--max-num-batched-tokens", str(BUDGET), "--step-trace-file", str(server_trace)],
    )
    calib = tmp_path / "calib.jsonl"
    out = run_cli(
        [
            "tune",
            "--calibrate",
            "--address",
            server.address,
            "--admin-address",
            server.admin_address,
            "--calibration-output-len",
            "8",
            "--save-trace",
            str(calib),
        ]
    )
    assert "fit error on" in out and "held-out steps" in out and f"step trace saved: {calib}" in out
    assert "nothing to replay" in out
    # The design spread the model's features: many decode counts, chunk sizes, mixed steps.
    lines = [json.loads(x) for x in calib.read_text().splitlines()]
    assert len(lines) >= 40
    decodes, chunks, mixed = set(), set(), 0
    for d in lines:
        seqs = d.get("seqs", [])
        dec = [s for s in seqs if not s.get("isPrefill")]
        pre = [s for s in seqs if s.get("isPrefill")]
        decodes.add(len(dec))
        chunks.update(s["numTokens"] for s in pre)
        mixed += bool(dec and pre)
        assert d.get("numTokens", 0) <= BUDGET
    assert len(decodes) >= 4 and len(chunks) >= 5 and mixed >= 1
    assert max(chunks) == BUDGET  # prompts past the budget were chunked
    model, med, p90, n = fit_with_error(load_trace(calib))
    assert n >= 8 and med == med  # a held-out error was computed

    # Without the Admin service: the lines the server appends to its own --step-trace-file.
    start = len(server_trace.read_text().splitlines())
    out = run_cli(
        ["tune", "--calibrate", "--address", server.address, "--admin-address", "127.0.0.1:1"]
        + ["--step-trace-file", str(server_trace), "--calibration-output-len", "4"]
    )
    traced = int(out.split(" steps traced")[0].rsplit(" ", 1)[1])
    assert traced >= 30 and "fit error on" in out
    assert len(server_trace.read_text().splitlines()) - start >= traced

    # A shared-prefix workload: 2 system prompts x 3 users.
    report = tmp_path / "bench.json"
    start = len(server_trace.read_text().splitlines())
    run_cli(
        [
            "bench",
            "--address",
            server.address,
            "--admin-address",
            server.admin_address,
            "--tokenizer",
            str(tiny_model_path),
            "--workload",
            "shared-prefix",
            "--num-prefixes",
            "2",
            "--users-per-prefix",
            "3",
            "--prefix-len",
            "96",
            "--suffix-len",
            "8:16",
            "--output-len",
            "4",
            "--request-rate",
            "20",
            "--disable-tqdm",
            "--result-json",
            str(report),
        ]
    )
    rep = json.loads(report.read_text())
    assert rep["prefix_groups"].count(0) == 3 and rep["prefix_groups"].count(1) == 3
    assert set(rep["prefix_lens"]) == {96} and sum(rep["cached_tokens"]) > 0
    from_bench, _ = requests_from_bench(report)
    assert {(s.prefix_group, s.prefix_len) for s in from_bench} == {(0, 96), (1, 96)}

    # The server's own trace of that run: the prefix structure recovered from the new fields.
    bench_trace = tmp_path / "bench-steps.jsonl"
    bench_trace.write_text("\n".join(server_trace.read_text().splitlines()[start:]) + "\n")
    from_trace = requests_from_trace(bench_trace)
    shared = [s for s in from_trace if s.prefix_group is not None]
    assert len({s.prefix_group for s in shared}) == 2 and len(shared) >= 5
    assert all(80 <= s.prefix_len <= 96 for s in shared)  # whole cached blocks of the 96 shared tokens

    config = SchedulerConfig(max_num_batched_tokens=BUDGET)
    for specs in (from_bench, from_trace):
        # Which users hit depends on the replayed timing (one arriving before the first user
        # of its prefix has computed it misses), but some do, and none without the structure.
        assert replay(specs, config, model.predict, num_blocks=2000).num_cached_tokens >= 80
        alone = [replace(s, prefix_group=None, prefix_len=0) for s in specs]
        assert replay(alone, config, model.predict, num_blocks=2000).num_cached_tokens == 0
