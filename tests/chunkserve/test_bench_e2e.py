"""`chunkserve bench` end to end: real server pairs, the CLI in a child process, the report,
plots, --compare, the OpenAI backend and the HF baseline (the units are in test_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chunkserve.bench.workloads import WorkloadSpec, build_workload, corpus_ids

REPORT_KEYS = [
    "completed",
    "failed",
    "failed_by_code",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "good_requests",
    "total_cached_tokens",
    "prefix_cache_hit_rate",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p95", "p99")]
LIST_KEYS = ["ttfts", "itls", "e2els", "input_lens", "output_lens", "classes"]
WORKLOAD = [
    "--workload",
    "mixed",
    "--num-prompts",
    "10",
    "--long-len",
    "200:400",
    "--short-len",
    "8:32",
    "--output-len",
    "4:8",
    "--seed",
    "5",
    "--percentiles",
    "50,95,99",
    "--disable-tqdm",
    "--goodput",
    "ttft:60000",
    "tpot:60000",
    "e2el:60000",
]


def run_bench_cli(args: list[str], timeout: float = 120) -> None:
    """`chunkserve bench` in a child process; asserts it never imported torch (unless HF)."""
    code = (
        "import sys\nfrom chunkserve.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    rc = e.code\nassert rc == 0, rc\n"
        "assert '--hf-baseline' in sys.argv or 'torch' not in sys.modules, 'the bench imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "bench", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def check_report(rep: dict, spec_lens: bool = True) -> None:
    for key in REPORT_KEYS:
        assert key in rep, key
    for key in LIST_KEYS:
        assert len(rep[key]) == 10, key
    assert rep["completed"] == 10 and rep["failed"] == 0 and rep["good_requests"] == 10
    assert sorted(rep["per_class"]) == ["long", "short"] and rep["classes"].count("long") == 3
    for cls, group in rep["per_class"].items():
        assert all(k in group for k in REPORT_KEYS)
        assert group["completed"] == rep["classes"].count(cls)
    assert sum(rep["output_lens"]) == rep["total_output_tokens"] and all(4 <= n <= 8 for n in rep["output_lens"])
    # ITLs are gaps between chunks (vLLM's rule): at most one a token after the first, as a server
    # folds tokens that queued up into one chunk (multi-step plans of the tiny model's sub-ms steps
    # outrun a stream's writer), and together the time from the first token to the last.
    assert all(len(itl) <= n - 1 for itl, n in zip(rep["itls"], rep["output_lens"]))
    assert any(rep["itls"]) and all(g >= 0 for itl in rep["itls"] for g in itl)
    assert all(sum(itl) <= e - t + 1e-6 for itl, t, e in zip(rep["itls"], rep["ttfts"], rep["e2els"]))
    assert all(0 < t < e for t, e in zip(rep["ttfts"], rep["e2els"]))
    assert 0 < rep["median_ttft_ms"] <= rep["p99_ttft_ms"] and rep["prefix_cache_hit_rate"] == 0.0


@pytest.mark.slow  # a real server pair
def test_bench_against_a_running_server(tiny_model_path, launch, tmp_path):
    server = launch(
        ["--model", str(tiny_model_path), "--max-num-batched-tokens", "256"], ["--max-num-batched-tokens", "256"]
    )
    stdout = run_bench_cli(
        [
            "--address",
            server.address,
            "--admin-address",
            server.admin_address,
            "--tokenizer",
            str(tiny_model_path),
            "--request-rate",
            "40",
            *WORKLOAD,
            "--result-json",
            str(tmp_path / "r.json"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
    )
    rep = json.loads((tmp_path / "r.json").read_text())
    check_report(rep)
    assert rep["bench"]["request_rate"] == 40.0 and rep["server_info"]["max_num_batched_tokens"] == 256
    assert "TTFT P99 (ms)" in stdout and "short" in stdout
    assert rep["step_trace"] and all(s["num_tokens"] <= 256 for s in rep["step_trace"])
    # A multi-step plan (a CPU executor's default) is one trace entry of num_steps steps, the
    # first computing num_tokens, each later one a decode per sequence.
    later = [s["num_steps"] - 1 for s in rep["step_trace"]]
    assert rep["num_steps"] == len(rep["step_trace"]) + sum(later) and rep["num_preemptions"] == 0  # no pressure
    assert f"step trace: {rep['num_steps']} steps, 0 preemptions" in stdout
    assert (
        sum(s["num_tokens"] + k * s["num_seqs"] for s, k in zip(rep["step_trace"], later))
        >= sum(rep["input_lens"]) + sum(rep["output_lens"]) - 10
    )  # + warm-up steps
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "ttft_cdf.png",
        "itl_over_time.png",
        "tokens_per_step.png",
    }

    # The same workload again finds every prompt in the prefix cache, unless it is emptied first.
    again = ["--address", server.address, "--tokenizer", str(tiny_model_path), *WORKLOAD, "--num-warmups", "0"]
    run_bench_cli(again + ["--no-reset-prefix-cache", "--result-json", str(tmp_path / "cached.json")])
    assert json.loads((tmp_path / "cached.json").read_text())["prefix_cache_hit_rate"] > 0.5
    run_bench_cli(again + ["--admin-address", server.admin_address, "--result-json", str(tmp_path / "reset.json")])
    assert json.loads((tmp_path / "reset.json").read_text())["prefix_cache_hit_rate"] == 0.0
    server.assert_idle_and_no_leaks()


@pytest.mark.slow  # a real server pair
def test_bench_over_the_openai_http_api_measures_the_same_workload(tiny_model_path, launch, tmp_path):
    """--backend openai sends the same requests through /v1/completions: every token counted
    (return_token_ids), the same prompts and output lengths as over gRPC, nothing left running."""
    server = launch(["--model", str(tiny_model_path)], [])
    common = ["--tokenizer", str(tiny_model_path), *WORKLOAD, "--request-rate", "40"]
    common += ["--admin-address", server.admin_address]  # empties the prefix cache before each run
    run_bench_cli(["--address", server.address, *common, "--result-json", str(tmp_path / "grpc.json")])
    http = ["--backend", "openai", "--address", f"127.0.0.1:{server.http_port}", *common]
    run_bench_cli(http + ["--result-json", str(tmp_path / "http.json")])
    grpc_rep = json.loads((tmp_path / "grpc.json").read_text())
    http_rep = json.loads((tmp_path / "http.json").read_text())
    check_report(http_rep)
    assert http_rep["bench"]["backend"] == "openai" and grpc_rep["bench"]["backend"] == "chunkserve"
    for key in ("input_lens", "output_lens", "total_input_tokens", "total_output_tokens"):
        assert http_rep[key] == grpc_rep[key], key
    assert http_rep["server_info"]["max_model_len"] == grpc_rep["server_info"]["max_model_len"]
    # A full URL works too; a URL without --backend openai is refused before anything runs.
    run_bench_cli(["--backend", "openai", "--address", server.http_url, *common, "--num-warmups", "0"])
    with pytest.raises(AssertionError):
        run_bench_cli(["--address", server.http_url, *common])
    server.assert_idle_and_no_leaks()


@pytest.mark.slow  # two real server pairs
def test_bench_compare_runs_the_same_workload_on_each_config(tiny_model_path, tmp_path):
    run_bench_cli(
        [
            "--server-args",
            f"--model {tiny_model_path} --max-num-batched-tokens 512",
            "--compare",
            "--enable-chunked-prefill",
            "--no-enable-chunked-prefill",
            "--rounds",
            "1",
            "--max-concurrency",
            "4",
            *WORKLOAD,
            "--result-json",
            str(tmp_path / "c.json"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
    )
    doc = json.loads((tmp_path / "c.json").read_text())
    a, b = doc["configs"]["A"], doc["configs"]["B"]
    check_report(a), check_report(b)
    assert a["server_info"]["enable_chunked_prefill"] and not b["server_info"]["enable_chunked_prefill"]
    assert a["server_args"][-1] == "--enable-chunked-prefill"
    assert a["input_lens"] == b["input_lens"] and a["arrivals"] == b["arrivals"], "the same workload"
    ratio = doc["ratios"]["B/A"]
    assert ratio["short.p99_ttft_ms"] == pytest.approx(
        b["per_class"]["short"]["p99_ttft_ms"] / a["per_class"]["short"]["p99_ttft_ms"]
    )
    assert ratio["output_throughput"] == pytest.approx(b["output_throughput"] / a["output_throughput"])
    assert len(list((tmp_path / "logs").iterdir())) == 2  # A-round1, B-round1
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 0


def test_hf_baseline_reports_the_same_figures(tiny_model_path):
    from chunkserve.bench.hf_baseline import run_hf_baseline
    from chunkserve.bench.report import pooled_report, ratios

    spec = WorkloadSpec("mixed", num_prompts=5, long_len=(40, 60), short_len=(5, 10), output_len=(3, 6))
    reqs = build_workload(spec, corpus_ids(tiny_model_path), seed=0)
    arrivals = [0.0, 0.0, 0.0, 5.0, 5.0]  # batch 2 waits for its last arrival; batch 3 starts when 2 ends
    run = run_hf_baseline(tiny_model_path, "float32", reqs, arrivals, batch_size=2, progress=False)
    recs = run.result.records
    assert [r.output_tokens for r in recs] == [r.output_len for r in reqs]
    assert recs[2].send == 0.0 and recs[2].first_token > 5.0 and recs[3].first_token > 5.0, "batch [2, 3]"
    assert recs[4].first_token > max(recs[2].end, recs[3].end), "static batches run one after another"
    assert recs[0].first_token == recs[1].first_token, "one prefill for the whole batch"
    rep = pooled_report([run], [50, 99], {"ttft": 60000})
    assert rep["completed"] == 5 and rep["good_requests"] == 5 and rep["duration"] == pytest.approx(recs[4].end)
    assert ratios(rep, rep)["p99_itl_ms"] == 1.0
