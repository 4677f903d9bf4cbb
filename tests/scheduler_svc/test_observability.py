"""Metrics and step trace: the engine's observers against a fake executor, then a real
server (tiny random model) on a scripted workload."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.client import build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.metrics import Metrics, buckets_1_2_5
from scheduler_svc.observer import Observer
from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.trace import StepTracer


class Recorder(Observer):
    def __init__(self) -> None:
        self.steps, self.finished = [], []

    def on_step(self, record) -> None:
        self.steps.append(record)

    def on_finish(self, request, reason, now) -> None:
        self.finished.append(request)


def run_engine(fakes, tokenizer_dir, batches, observers, num_blocks=256, max_tokens=8, sampling=None, **cfg):
    """Runs each batch of prompts to the end before the next; returns [(request id, final delta)].
    `sampling` replaces the default SamplingParams(max_tokens=max_tokens, ignore_eos=True)."""
    sampling = sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sched = fakes.make_scheduler(num_blocks=num_blocks, block_size=4, **cfg)
    fake = fakes.FakeExecutor(num_blocks, 4)
    engine = Engine(sched, fake, Tokenizer(tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0, observers)

    async def last(stream):
        while not (d := await stream.queue.get()).finished:
            assert d.error is None
        return stream.request_id, d

    async def main():
        engine.start()
        finals = []
        for prompts in batches:
            streams = [engine.add_request(p, sampling) for p in prompts]
            finals += await asyncio.gather(*(last(s) for s in streams))
        await engine.stop()
        return finals

    return asyncio.run(main()), fake


def test_observers_get_one_record_per_step_with_that_steps_counts(fakes, byte_tokenizer_dir):
    rec, metrics = Recorder(), Metrics("m")
    prompts = [list(range(10 + i, 35 + i)) for i in range(6)]
    _, fake = run_engine(
        fakes, byte_tokenizer_dir, [prompts], (rec, metrics), num_blocks=20, max_tokens=30, max_num_batched_tokens=32
    )
    assert len(rec.steps) == len(fake.plans) and all(r.plan is p for r, p in zip(rec.steps, fake.plans))
    assert len(rec.finished) == 6
    preempting = [i for i, r in enumerate(rec.steps) if r.plan.preempted]
    assert preempting and preempting[-1] + 1 < len(rec.steps)
    for r in rec.steps:  # counts belong to their step: none without a preemption, none left over after
        assert r.stats.recomputed_tokens == 0 or r.plan.preempted
        assert len(r.stats.requests) == len(r.plan.seqs)
    assert all(r.stats.recomputed_tokens == 0 for r in rec.steps[preempting[-1] + 1 :])
    preemptions = sum(len(r.plan.preempted) for r in rec.steps)
    assert preemptions == sum(req.num_preemptions for req in rec.finished)

    def sample(name):
        return metrics.registry.get_sample_value(f"chunkserve_{name}", {"model_name": "m"})

    assert sample("num_preemptions_total") == preemptions
    assert sample("num_recomputed_tokens_total") == sum(r.stats.recomputed_tokens for r in rec.steps) > 0
    assert sample("prefix_cache_queries_total") == sum(r.stats.prefix_queries for r in rec.steps) == 6 * 25
    assert sample("iteration_tokens_count") == len(rec.steps)
    metrics.clear_load()
    assert sample("num_requests_running") == 0 == sample("kv_cache_usage_perc")


def test_trace_reports_prefix_cache_hits_of_the_admitting_step(fakes, byte_tokenizer_dir):
    tracer, rec = StepTracer(), Recorder()
    queue = tracer.subscribe()
    prompt = list(range(40, 80))  # 10 blocks of 4
    finals, fake = run_engine(fakes, byte_tokenizer_dir, [[prompt], [prompt + [90, 91]]], (tracer, rec))
    traces = [queue.get_nowait() for _ in range(queue.qsize())]
    assert len(traces) == len(rec.steps) == len(fake.plans)
    (a, _), (b, final) = finals
    assert final.cached_tokens == 40
    admitted = [t for t in traces if t.num_cached_tokens]
    assert len(admitted) == 1 and admitted[0].num_cached_tokens == 40
    assert admitted[0].seqs[0].request_id == b and admitted[0].seqs[0].num_computed_tokens == 40
    first = [s for t in traces for s in t.seqs if s.request_id == a]
    assert [s.is_prefill for s in first] == [True] + [False] * 7 and first[0].num_prompt_tokens == 40


def test_finish_reasons_use_vllms_labels_and_request_histograms_add_up(fakes, byte_tokenizer_dir):
    """A stop string and a stop token id finish as `stop` (vLLM's label), not `stop_sequence`;
    the per-request token histograms agree with the token counters."""
    metrics = Metrics("m", max_model_len=100)
    prompt = list(range(40, 52))

    def run(**sampling):
        [(_, final)], _ = run_engine(
            fakes, byte_tokenizer_dir, [[prompt]], (metrics,), sampling=SamplingParams(**sampling)
        )
        return final

    assert run(max_tokens=6, ignore_eos=True).finish_reason.name == "LENGTH"
    tokens = []  # what the fake executor samples: a pure function of the history
    for _ in range(6):
        tokens.append(fakes.FakeExecutor(1, 4).next_token(prompt + tokens))
    text = bytes(tokens).decode()  # letters: one byte-level token each
    stopped = run(max_tokens=6, ignore_eos=True, stop=(text[2],))
    assert stopped.finish_reason.name == "STOP_SEQUENCE"
    by_id = run(max_tokens=6, ignore_eos=True, stop_token_ids=(ord(text[1]),))
    assert by_id.finish_reason.name == "STOP" and by_id.matched_stop_token_id == ord(text[1])

    def sample(name, **labels):
        return metrics.registry.get_sample_value(f"chunkserve_{name}", {"model_name": "m", **labels})

    assert sample("request_success_total", finished_reason="length") == 1
    assert sample("request_success_total", finished_reason="stop") == 2
    assert sample("request_success_total", finished_reason="abort") == 0
    assert "stop_sequence" not in generate_latest(metrics.registry).decode()
    assert sample("request_prompt_tokens_count") == 3
    assert sample("request_prompt_tokens_sum") == 3 * len(prompt) == sample("prompt_tokens_total")
    assert sample("request_generation_tokens_sum") == sample("generation_tokens_total") > 6
    assert sample("request_generation_tokens_bucket", le="+Inf") == 3
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100) and buckets_1_2_5(8192)[-1] == 5000
    assert sample("request_prompt_tokens_bucket", le="10.0") == 0 < sample("request_prompt_tokens_bucket", le="20.0")
    # vLLM's time_per_output_token_seconds: the same per-token observations as inter_token_latency
    assert sample("time_per_output_token_seconds_count") == sample("inter_token_latency_seconds_count") > 0
    assert sample("time_per_output_token_seconds_sum") == sample("inter_token_latency_seconds_sum")
    assert sample("request_time_per_output_token_seconds_count") == 3  # each generated more than one token


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "chunkserve-dashboard.json"
# Every series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# queries, in chunkserve's names (gpu_cache_usage_perc is vLLM's old name for kv_cache_usage_perc;
# request_max_num_generation_tokens equals request_generation_tokens with one sequence per request).
VLLM_DASHBOARD_SERIES = [
    "e2e_request_latency_seconds_bucket",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_per_output_token_seconds_bucket",
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "time_to_first_token_seconds_bucket",
    "kv_cache_usage_perc",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
    "request_success_total",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum",
]


def test_dashboard_queries_only_series_the_registry_exports(fakes, byte_tokenizer_dir):
    metrics = Metrics("m", max_model_len=100)
    run_engine(fakes, byte_tokenizer_dir, [[list(range(40, 60))]], (metrics,), max_tokens=4)
    text = generate_latest(metrics.registry).decode()
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert (
        metrics.registry.get_sample_value(
            "chunkserve_request_success_total", {"model_name": "m", "finished_reason": "length"}
        )
        == 1
    )

    dashboard = json.loads(DASHBOARD.read_text())  # valid JSON
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= len(dashboard["panels"]) >= 12
    assert all('model_name="$model_name"' in e for e in exprs)
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    referenced = {name for e in exprs + variables for name in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", e)}
    referenced = {n for n in referenced if n.startswith(("chunkserve", "vllm"))}
    assert referenced and referenced <= exported, sorted(referenced - exported)
    assert {f"chunkserve_{name}" for name in VLLM_DASHBOARD_SERIES} <= referenced
    if shutil.which("promtool"):  # the repository's other promtool check runs against a live server
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def server(tiny_model_path, launch):
    return launch(
        ["--model", str(tiny_model_path), "--dtype", "float32", "--block-size", "16", "--max-num-batched-tokens", "64"],
        # one step a plan (a CPU executor's default is plans of several: config.auto_scheduler_steps),
        # so the scripted workload below has a trace per step; multi-step's: tests/scheduler_svc/test_multi_step.py
        ["--max-num-batched-tokens", "64", "--num-scheduler-steps", "1"],
    )


def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[key] = s.value
    return samples, text


def until(condition, timeout: float = 120.0) -> None:
    """Polls condition; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_metrics_and_trace_match_a_scripted_workload(server, tmp_path):
    traces: list[pb.StepTrace] = []
    admin = pb_grpc.AdminStub(grpc.insecure_channel(server.admin_address))
    watch = admin.WatchSteps(pb.WatchStepsRequest())

    def collect():
        try:
            for trace in watch:
                traces.append(trace)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    threading.Thread(target=collect, daemon=True).start()
    stub = server.stub()
    # The subscription is live once a warm-up request's steps arrive (no sleep to guess it).
    until(lambda: list(stub.Generate(build_request([7, 8], temperature=0.0, max_tokens=1))) and traces)
    server.assert_idle_and_no_leaks()
    start_step = admin.GetConfig(pb.GetConfigRequest(), timeout=10).effective_step  # the workload's first step
    # A stream ends before the observers hear of its last step, so the metrics may not have
    # counted the warm-up's last step yet; its trace arriving says they have (the observers
    # run in order, metrics then tracer), and only then is `before` taken.
    until(lambda: any(t.step_id == start_step - 1 for t in list(traces)))
    before, _ = scrape(server)

    def workload_traces() -> list[pb.StepTrace]:
        return [t for t in list(traces) if t.step_id >= start_step]

    # 150-token prompt, budget 64: chunks 64, 64, 22 (samples), then 4 decodes.
    a = list(stub.Generate(build_request(list(range(1000, 1150)), temperature=0.0, max_tokens=5, ignore_eos=True)))
    b = list(stub.Generate(build_request(list(range(2000, 2010)), temperature=0.0, max_tokens=3, ignore_eos=True)))
    call = stub.Generate(build_request(list(range(3000, 3020)), temperature=0.0, max_tokens=1000, ignore_eos=True))
    first = next(m for m in call if m.token_ids)  # it has a first token (counted in TTFT)
    assert stub.Abort(pb.AbortRequest(request_id=first.request_id)).found
    c = list(call)
    server.assert_idle_and_no_leaks()
    # Every step is both traced and counted before the numbers are compared.
    until(
        lambda: (
            scrape(server)[0].get("chunkserve_iteration_tokens_count", 0)
            - before.get("chunkserve_iteration_tokens_count", 0)
            == len(workload_traces())
            > 0
        )
    )
    after, text = scrape(server)
    watched = workload_traces()  # a new name: collect() still appends to `traces`
    watch.cancel()

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    generated = sum(len(m.token_ids) for m in a + b + [first] + c)
    assert delta("chunkserve_generation_tokens_total") == generated
    assert delta("chunkserve_prompt_tokens_total") == 150 + 10 + 20
    assert delta("chunkserve_request_success_total{finished_reason=length}") == 2
    assert delta("chunkserve_request_success_total{finished_reason=abort}") == 1
    assert delta("chunkserve_request_success_total{finished_reason=stop}") == 0
    assert delta("chunkserve_time_to_first_token_seconds_count") == 3
    assert delta("chunkserve_e2e_request_latency_seconds_count") == 3
    assert delta("chunkserve_inter_token_latency_seconds_count") == generated - 3
    assert delta("chunkserve_iteration_tokens_sum") == sum(t.num_tokens for t in watched)
    assert after["chunkserve_kv_cache_usage_perc"] == 0.0 and after["chunkserve_num_requests_running"] == 0

    first_request = [t for t in watched if any(s.request_id == a[0].request_id for s in t.seqs)]
    assert [t.num_tokens for t in first_request] == [64, 64, 22, 1, 1, 1, 1]
    assert [t.num_prefill_tokens for t in first_request] == [64, 64, 22, 0, 0, 0, 0]
    assert [t.seqs[0].num_computed_tokens for t in first_request] == [0, 64, 128, 150, 151, 152, 153]
    assert all(t.token_budget == 64 and t.executor_ns > 0 for t in watched)


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (apt-get install prometheus)")
def test_metrics_pass_promtool(server):
    list(server.stub().Generate(build_request([5, 6, 7], temperature=0.0, max_tokens=2)))
    _, text = scrape(server)
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
