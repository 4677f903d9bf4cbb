"""Metrics and step trace of a real server (tiny random model) on a scripted workload."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.client import build_request
from chunkserve.v1 import chunkserve_pb2 as pb
from chunkserve.v1 import chunkserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(tiny_model_path, launch):
    return launch(["--model", str(tiny_model_path), "--dtype", "float32", "--block-size", "16",
                   "--max-num-batched-tokens", "64"],
                  ["--max-num-batched-tokens", "64"])


def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[key] = s.value
    return samples, text


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
    time.sleep(0.5)  # the subscription is registered
    stub = server.stub()
    before, _ = scrape(server)

    # 150-token prompt, budget 64: chunks 64, 64, 22 (samples), then 4 decodes.
    a = list(stub.Generate(build_request(list(range(1000, 1150)), temperature=0.0, max_tokens=5, ignore_eos=True)))
    b = list(stub.Generate(build_request(list(range(2000, 2010)), temperature=0.0, max_tokens=3, ignore_eos=True)))
    call = stub.Generate(build_request(list(range(3000, 3020)), temperature=0.0, max_tokens=1000, ignore_eos=True))
    first = next(call)
    assert stub.Abort(pb.AbortRequest(request_id=first.request_id)).found
    c = list(call)
    server.assert_idle_and_no_leaks()
    time.sleep(0.2)
    after, text = scrape(server)
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
    assert delta("chunkserve_iteration_tokens_sum") == sum(t.num_tokens for t in traces)
    assert after["chunkserve_kv_cache_usage_perc"] == 0.0 and after["chunkserve_num_requests_running"] == 0

    first_request = [t for t in traces if any(s.request_id == a[0].request_id for s in t.seqs)]
    assert [t.num_tokens for t in first_request] == [64, 64, 22, 1, 1, 1, 1]
    assert [t.num_prefill_tokens for t in first_request] == [64, 64, 22, 0, 0, 0, 0]
    assert [t.seqs[0].num_computed_tokens for t in first_request] == [0, 64, 128, 150, 151, 152, 153]
    assert all(t.token_budget == 64 and t.executor_ns > 0 for t in traces)


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (apt-get install prometheus)")
def test_metrics_pass_promtool(server):
    list(server.stub().Generate(build_request([5, 6, 7], temperature=0.0, max_tokens=2)))
    _, text = scrape(server)
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
