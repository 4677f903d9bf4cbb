"""`chunkserve bench`, its parts: workloads, arrivals, metrics math, the runner against a fake
server, capacity search, flags and --compare's order (the real command against real servers
is in test_bench_e2e.py)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import math
import random
import statistics
import time

import grpc
import pytest

from chunkserve.bench.arrivals import arrival_times
from chunkserve.bench.capacity import PrefillModel, Probe, search_capacity
from chunkserve.bench.cli import add_bench_parser
from chunkserve.bench.metrics import compute_metrics, parse_slos, per_request_lists, percentile
from chunkserve.bench.runner import RequestRecord, StalledError, run_requests
from chunkserve.bench.servers import split_server_args
from chunkserve.bench.session import RunOptions
from chunkserve.bench.workloads import BenchRequest, WorkloadSpec, build_workload, corpus_ids
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

CORPUS = list(range(1000, 2500))  # stand-in token ids: 1500 distinct "words"


# ---------------------------------------------------------------- workloads


def test_mixed_workload_is_repeatable_and_respects_the_mix():
    spec = WorkloadSpec(
        "mixed", num_prompts=50, output_len=(4, 9), long_fraction=0.3, long_len=(300, 400), short_len=(10, 20)
    )
    a, b = build_workload(spec, CORPUS, seed=7), build_workload(spec, CORPUS, seed=7)
    assert a == b
    assert build_workload(spec, CORPUS, seed=8) != a
    assert [r.cls for r in a].count("long") == 15 and [r.cls for r in a].count("short") == 35
    assert {r.cls for r in a[:15]} == {"short", "long"}, "classes are shuffled, not blocked"
    for r in a:
        low, high = spec.long_len if r.cls == "long" else spec.short_len
        assert low <= len(r.prompt_ids) <= high
        assert 4 <= r.output_len <= 9
    assert len({r.prompt_ids[:8] for r in a}) == 50, "no two prompts share a prefix by accident"


def test_fixed_workload_has_exact_lengths_and_wraps_the_corpus():
    spec = WorkloadSpec("fixed", num_prompts=5, input_len=4000, output_len=(16, 16))
    reqs = build_workload(spec, CORPUS, seed=0)
    assert [(len(r.prompt_ids), r.output_len, r.cls) for r in reqs] == [(4000, 16, "fixed")] * 5
    p = reqs[0].prompt_ids
    assert all(b - a in (1, 1 - len(CORPUS)) for a, b in zip(p, p[1:])), "consecutive corpus ids, wrapping"


def test_shared_prefix_workload_is_n_prefixes_times_m_users():
    spec = WorkloadSpec("shared-prefix", num_prefixes=3, users_per_prefix=4, prefix_len=100, suffix_len=(5, 10))
    reqs = build_workload(spec, CORPUS, seed=1)
    assert len(reqs) == 12
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.cls, []).append(r.prompt_ids)
    assert sorted(groups) == ["prefix-0", "prefix-1", "prefix-2"]
    for prompts in groups.values():
        assert len(prompts) == 4 and len({p[:100] for p in prompts}) == 1
        assert len({p[100:] for p in prompts}) == 4 and all(5 <= len(p) - 100 <= 10 for p in prompts)
    assert len({p[0][:100] for p in groups.values()}) == 3


def test_workload_text_is_real_english(default_model_path):
    from tokenizers import Tokenizer

    ids = corpus_ids(default_model_path)
    req = build_workload(WorkloadSpec("fixed", num_prompts=1, input_len=3000), ids, seed=0)[0]
    assert len(req.prompt_ids) == 3000
    text = Tokenizer.from_file(str(default_model_path / "tokenizer.json")).decode(list(req.prompt_ids))
    assert text.count(" the ") > 20


def test_bad_workload_settings_are_refused():
    with pytest.raises(ValueError, match="--long-fraction"):
        WorkloadSpec(long_fraction=1.5)
    with pytest.raises(ValueError, match="--short-len"):
        WorkloadSpec(short_len=(50, 10))


# ---------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_match_the_rate(burstiness):
    rate, n = 5.0, 20000
    times = arrival_times(n, rate, burstiness, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2  # gamma: 1 / shape
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)
    assert arrival_times(n, rate, burstiness, seed=3) == times
    assert arrival_times(n, rate, burstiness, seed=4) != times


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError):
        arrival_times(4, 0.0)


# ---------------------------------------------------------------- metrics


def record(index, cls, send, chunks, *, error="", input_len=10, cached=0) -> RequestRecord:
    r = RequestRecord(index, cls, input_len, len(chunks), arrival=send, send=send)
    if error:
        r.error_code = error
        return r
    r.chunk_times, r.chunk_tokens = list(chunks), [1] * len(chunks)
    r.end, r.finish_reason, r.prompt_tokens, r.cached_tokens = chunks[-1], "LENGTH", input_len, cached
    return r


RECORDS = [
    record(0, "short", 0.0, [0.100, 0.150, 0.250], cached=5),  # TTFT 100, ITL 50 100, TPOT 75, E2EL 250
    record(1, "long", 1.0, [1.300], input_len=30),  # TTFT 300, one token: no TPOT or ITL
    record(2, "long", 1.5, [], error="INVALID_ARGUMENT"),
]


def test_metrics_on_hand_made_records():
    m = compute_metrics(RECORDS, duration=2.0, percentiles=[50, 99, 99.9], slos=parse_slos(["ttft:200", "tpot:80"]))
    assert (m["completed"], m["failed"], m["failed_by_code"]) == (2, 1, {"INVALID_ARGUMENT": 1})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 4)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 22.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(298) and m["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert m["std_ttft_ms"] == pytest.approx(100)
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["p99_tpot_ms"] == pytest.approx(75)
    assert m["mean_itl_ms"] == pytest.approx(75) and m["p99_itl_ms"] == pytest.approx(99.5)
    assert m["median_e2el_ms"] == pytest.approx(275) and m["p50_e2el_ms"] == pytest.approx(275)
    assert m["good_requests"] == 1 and m["request_goodput"] == 0.5  # record 1 misses the TTFT SLO
    assert m["prefix_cache_hit_rate"] == pytest.approx(5 / 40) and m["total_cached_tokens"] == 5
    assert m["finish_reasons"] == {"LENGTH": 2}
    lists = per_request_lists(RECORDS)
    assert lists["ttfts"] == [pytest.approx(0.1), pytest.approx(0.3), None]
    assert lists["itls"][0] == [pytest.approx(0.05), pytest.approx(0.1)] and lists["itls"][1:] == [[], []]
    assert lists["classes"] == ["short", "long", "long"] and lists["output_lens"] == [3, 1, 0]


def test_goodput_needs_every_slo_and_empty_groups_are_zero():
    assert compute_metrics(RECORDS, 2.0, slos=parse_slos(["e2el:200"]))["good_requests"] == 0
    assert compute_metrics(RECORDS, 2.0, slos=parse_slos(["tpot:10"]))["good_requests"] == 1  # 1 token: TPOT 0
    empty = compute_metrics(RECORDS[2:], 2.0)
    assert empty["completed"] == 0 and empty["p99_itl_ms"] == 0.0
    with pytest.raises(ValueError, match="unknown metric"):
        parse_slos(["itl:5"])


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 50, 95, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


# ---------------------------------------------------------------- runner (fake server)


class FakeGeneration(pb_grpc.GenerationServicer):
    """One token every 50 ms; prompts of 13 tokens are refused; prompts of 99 never answer."""

    def Generate(self, request, context):
        n = len(request.token_ids.ids)
        if n == 13:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if n == 99:
            time.sleep(2)
            return
        # As the real server: a first message at once, no tokens (TTFT must not count it).
        yield pb.GenerateResponse(request_id=f"id{n}", client_request_id=request.client_request_id, prompt_tokens=n)
        for i in range(request.sampling.max_tokens):
            time.sleep(0.05)
            last = i == request.sampling.max_tokens - 1
            yield pb.GenerateResponse(
                request_id=f"id{n}",
                token_ids=[7],
                finished=last,
                finish_reason=pb.FINISH_REASON_LENGTH if last else 0,
                usage=pb.Usage(prompt_tokens=n, completion_tokens=i + 1, cached_tokens=4) if last else None,
            )


@pytest.fixture(scope="module")
def fake_server():
    """A plain (thread-pool) gRPC server: the bench's grpc.aio client is what is tested."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_runner_records_every_token_and_every_error(fake_server):
    reqs = [BenchRequest(0, tuple(range(5)), 3, "short"), BenchRequest(1, tuple(range(13)), 3, "long")]
    result = asyncio.run(run_requests(fake_server, reqs, [0.0, 0.2], progress=False))
    ok, bad = result.records
    assert ok.ok and ok.output_tokens == 3 and ok.finish_reason == "LENGTH" and ok.request_id == "id5"
    assert (ok.prompt_tokens, ok.cached_tokens) == (5, 4)
    # one time per chunk, in order, after the send (the fake paces tokens 50 ms apart, but on a
    # loaded machine the client may read two of them in one wake-up: no gap is asserted)
    assert len(ok.chunk_times) == 3
    assert all(a <= b for a, b in zip([ok.send] + ok.chunk_times, ok.chunk_times))
    assert ok.end == ok.chunk_times[-1]
    assert not bad.ok and bad.error_code == "INVALID_ARGUMENT" and bad.send >= 0.2
    assert result.duration >= ok.end


def test_a_hung_server_stops_the_run_instead_of_hanging_it(fake_server):
    reqs = [BenchRequest(0, tuple(range(99)), 3, "short")]
    with pytest.raises(StalledError):
        asyncio.run(run_requests(fake_server, reqs, [0.0], progress=False, stall_timeout=0.3))


# ---------------------------------------------------------------- capacity


def fake_probe(capacity: float, calls: list[float]):
    def probe(rate: float) -> Probe:
        calls.append(rate)
        ok = rate <= capacity
        return Probe(rate, 50.0 if ok else 900.0, 10.0, True, ok, {"completed": 1})

    return probe


@pytest.mark.parametrize("start", [0.1, 1.0, 30.0])
def test_capacity_search_brackets_then_bisects(start):
    calls: list[float] = []
    best, probes = search_capacity(fake_probe(3.3, calls), start, max_probes=12, tolerance=0.05)
    assert len(probes) == len(calls) <= 12
    assert best is not None and 3.3 / 1.06 <= best <= 3.3


def test_capacity_queue_criterion_is_the_worst_class_median():
    """Short requests starting promptly must not hide long ones queueing (overall median
    fine, long median not): the criterion is the worst class's median."""
    from chunkserve.bench.capacity import worst_class_median_ms

    recs = [RequestRecord(i, "short" if i < 7 else "long", 10, 2, 0.0) for i in range(10)]
    delays = [0.1] * 7 + [5.0, 6.0, None]
    assert statistics.median(d for d in delays if d is not None) == 0.1
    assert worst_class_median_ms(recs, delays) == pytest.approx(5500.0)
    assert worst_class_median_ms(recs[:7], delays[:7]) == pytest.approx(100.0)
    assert worst_class_median_ms(recs[7:], [None] * 3) == math.inf, "no known delay is not feasible"


def test_capacity_search_is_bounded_and_reports_none_when_nothing_fits():
    calls: list[float] = []
    best, _ = search_capacity(fake_probe(0.0001, calls), 1.0, max_probes=4)
    assert best is None and calls == [1.0, 0.5, 0.25, 0.125]


def test_prefill_model_interpolates_between_calibrated_lengths():
    model = PrefillModel([(100, 0.1), (1000, 1.0), (100, 0.2), (3000, 2.0)])
    assert model(100) == pytest.approx(0.1)  # the best of repeated measurements
    assert model(550) == pytest.approx(0.55) and model(2000) == pytest.approx(1.5)
    assert model(4000) == pytest.approx(2.5)  # extrapolates the last segment


# ---------------------------------------------------------------- flags


def test_server_args_go_to_the_process_that_owns_them():
    executor, scheduler = split_server_args(
        "--max-num-batched-tokens 256 --no-enable-chunked-prefill --dtype=float32 --block-size 32 --max-num-seqs 8"
    )
    assert executor == ["--max-num-batched-tokens", "256", "--dtype=float32", "--block-size", "32"]
    assert scheduler == ["--max-num-batched-tokens", "256", "--no-enable-chunked-prefill", "--max-num-seqs", "8"]
    for bad in ("--port 5", "--frobnicate 1", "--max-num-seqs"):
        with pytest.raises(ValueError):
            split_server_args(bad)


def test_compare_takes_flag_strings_as_values():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "bench",
            "--compare",
            "--enable-chunked-prefill",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens 64",
            "--rounds",
            "3",
            "--server-args",
            "--no-enable-chunked-prefill",
            "--seed",
            "4",
        ]
    )
    assert args.compare == ["--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-num-batched-tokens 64"]
    assert (args.rounds, args.server_args, args.seed) == (3, "--no-enable-chunked-prefill", 4)


def test_pooled_report_counts_steps_and_preemptions_from_the_trace_only():
    from chunkserve.bench.report import pooled_report
    from chunkserve.bench.runner import RunResult
    from chunkserve.bench.session import Run

    rec = RequestRecord(0, "all", 10, 2, 0.0, send=0.0, end=1.0, chunk_times=[0.5, 1.0], chunk_tokens=[1, 1])
    step = {"num_preempted": 0, "num_steps": 1}
    traced = [
        Run(RunResult([rec], 1.0, 0.0), {}, [step, {"num_preempted": 2, "num_steps": 1}, step]),
        Run(RunResult([rec], 1.0, 0.0), {}, [{"num_preempted": 1, "num_steps": 3}]),  # a multi-step plan
    ]
    rep = pooled_report(traced, [50, 99], None)
    assert (rep["num_steps"], rep["num_preemptions"]) == (6, 3)
    untraced = pooled_report([Run(RunResult([rec], 1.0, 0.0), {})], [50, 99], None)
    assert "num_preemptions" not in untraced, "no trace: unknown, not zero"


def test_compare_rounds_alternate_the_order_and_stop_every_server(tmp_path):
    """A B B A A B: neither configuration always goes first, and each server is stopped
    before the next one starts."""
    from chunkserve.bench.compare import configs_from, run_compare

    events = []

    class FakeServer:
        def __init__(self, name):
            self.name, self.address = name, f"addr-{name}"

        def stop(self):
            events.append(("stop", self.name))

    def launch_fn(log_dir, args):
        name = log_dir.name.split("-")[0]
        assert not events or events[-1][0] == "stop", "a server started while another ran"
        events.append(("start", name))
        return FakeServer(name), None

    def run_fn(address, requests, arrivals, opts, admin_address, desc):
        events.append(("run", address))
        return address

    configs = configs_from("--dtype float32", ["--enable-prefix-caching", "--no-enable-prefix-caching"])
    runs = run_compare(configs, 3, [], [], RunOptions(), tmp_path, launch_fn=launch_fn, run_fn=run_fn)
    assert [n for e, n in events if e == "start"] == ["A", "B", "B", "A", "A", "B"]
    assert events.count(("stop", "A")) == 3 and events.count(("stop", "B")) == 3
    assert runs == {"A": ["addr-A"] * 3, "B": ["addr-B"] * 3}
    with pytest.raises(ValueError):
        run_compare(configs, 0, [], [], RunOptions(), tmp_path, launch_fn=launch_fn, run_fn=run_fn)
