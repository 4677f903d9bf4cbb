"""vllm-router (PyPI, a Rust binary) in front of two chunkserve servers with its `kv_aware`
policy fed by chunkserve's vLLM-format KV events (--kv-events-config): its decoder accepts
them, and follow-ups of a prompt go to the replica that cached it. Skipped when no
`vllm-router` executable is found (`pip install vllm-router`, or CHUNKSERVE_VLLM_ROUTER=path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from chunkserve.launch import free_port, start_server

pytestmark = pytest.mark.slow
# The dev extra installs it into the virtual environment, whose bin/ need not be on PATH.
ROUTER = (
    os.environ.get("CHUNKSERVE_VLLM_ROUTER")
    or shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    or shutil.which("vllm-router")
)


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
def test_vllm_router_kv_aware_routes_follow_ups_to_the_cached_prefix(tiny_model_path, tmp_path):
    import httpx

    servers, sources, replays = [], [], []
    for i in range(2):
        pub, replay = free_port(), free_port()
        # vLLM's rule (ours too): an endpoint with "*" is bound, one with a host is connected to.
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        executor = ["--model", str(tiny_model_path), "--dtype", "float32", "--num-threads", "1"]
        executor += ["--num-gpu-blocks-override", "256"]
        (tmp_path / str(i)).mkdir()
        s = start_server(tmp_path / str(i), executor, ["--kv-events-config", json.dumps(kv)])
        servers.append(s)
        sources += ["--kv-event-source", f"http://127.0.0.1:{s.http_port}=tcp://127.0.0.1:{pub}"]
        replays += ["--kv-event-replay-source", f"http://127.0.0.1:{s.http_port}=tcp://127.0.0.1:{replay}"]
    port = free_port()
    workers = [f"http://127.0.0.1:{s.http_port}" for s in servers]
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware", "--worker-urls", *workers]
    cmd += [*sources, *replays, "--kv-event-block-size", "16", "--kv-event-model", str(tiny_model_path)]
    log = tmp_path / "vllm-router.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        model = httpx.get(workers[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        prefix = " ".join(f"word{i % 37} token{i % 11}" for i in range(120))

        def complete(prompt: str) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(base + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]

        # The prefix goes to the second replica directly, behind vllm-router's back: only
        # chunkserve's KV events can tell it where the prefix is (with no hit anywhere it picks
        # the least-loaded worker, the first one on a tie).
        direct = {"model": model, "prompt": prefix + " first", "max_tokens": 2, "temperature": 0}
        reply = httpx.post(workers[1] + "/v1/completions", json=direct, timeout=120)
        assert reply.status_code == 200, reply.text
        first_tokens = reply.json()["usage"]["prompt_tokens"]
        cached = []
        deadline = time.time() + 180  # a failsafe against a hang, not a time limit
        while time.time() < deadline:  # the events are asynchronous: until one follow-up hits
            cached.append(complete(prefix + f" again {len(cached)}")["prompt_tokens_details"]["cached_tokens"])
            if cached[-1]:
                break
        assert cached[-1] > 0, (cached, log.read_text()[-2000:])
        for i in range(4):  # and every one after it
            assert complete(prefix + f" more {i}")["prompt_tokens_details"]["cached_tokens"] > 0
        assert "decode batch" not in log.read_text(), log.read_text()[-2000:]
        # Without the events the least-loaded worker (the first: sequential requests tie at 0)
        # would have served them all: the second served at least the last four.
        served = [prompt_tokens(s.metrics_url) for s in servers]
        assert served[1] >= 5 * first_tokens, (served, cached)

    finally:
        proc.terminate()
        proc.wait(15)
        for s in servers:
            s.stop()


def prompt_tokens(metrics_url: str) -> float:
    import httpx

    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("chunkserve_prompt_tokens_total")
    )


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_vllm_router_default_policies_forward_plain_requests_unchanged(tiny_model_path, tmp_path, policy):
    """Its other policies re-write each body with SGLang's defaults (`no_stop_trim`,
    `separate_reasoning`, ...): completions, streamed or not, and chat through vllm-router get
    the tokens a replica gives directly (greedy), not a 400 for a field chunkserve did not know."""
    import httpx

    executor = ["--model", str(tiny_model_path), "--dtype", "float32", "--num-threads", "1"]
    servers = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        servers.append(start_server(tmp_path / str(i), executor, []))
    port = free_port()
    workers = [f"http://127.0.0.1:{s.http_port}" for s in servers]
    log = tmp_path / "vllm-router.log"
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        model = httpx.get(workers[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        completion = {"model": model, "prompt": "The sky is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
        for path, body, field in (("completions", completion, "text"), ("chat/completions", chat, "message")):
            direct = httpx.post(f"{workers[0]}/v1/{path}", json=body, timeout=120)
            assert direct.status_code == 200, direct.text
            for _ in range(2):  # round_robin: both replicas
                routed = httpx.post(f"{base}/v1/{path}", json=body, timeout=120)
                assert routed.status_code == 200, routed.text
                assert routed.json()["choices"][0][field] == direct.json()["choices"][0][field]
        streamed = ""
        with httpx.stream("POST", base + "/v1/completions", json={**completion, "stream": True}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert streamed == direct_text(workers[0], completion)
        if policy == "cache_aware":  # it asks the replicas' /render for the tokens it routes by
            access = "".join(f.read_text() for f in tmp_path.glob("*/server-*.log"))
            assert '"POST /v1/completions/render" 200' in access, access[-3000:]
            assert '"POST /v1/chat/completions/render" 200' in access, access[-3000:]
            assert '/render" 4' not in access, access[-3000:]
    finally:
        proc.terminate()
        proc.wait(15)
        for s in servers:
            s.stop()


def direct_text(worker: str, body: dict) -> str:
    import httpx

    reply = httpx.post(worker + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def wait_healthy(proc: subprocess.Popen, base: str, log) -> None:
    """Until vllm-router answers /health (it waits for its workers first), at most 120 s."""
    import httpx

    deadline = time.time() + 180  # a failsafe against a hang, not a time limit
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
