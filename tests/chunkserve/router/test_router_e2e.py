"""The router in front of two real tiny-model replicas: same greedy tokens as a replica served
directly, a follow-up sharing a prefix goes where the prefix is cached, the OpenAI API goes
through, Abort reaches the replica, and killing a replica loses no request that had not
streamed a token yet, through the multiplexed replica leg and the per-call one. (Two replica
pairs and a router process: slow.)"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from chunkserve.client import Completion, build_request
from chunkserve.launch import free_port, start_server
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

pytestmark = pytest.mark.slow
BLOCK = 16


def replica_args(model) -> tuple[list[str], list[str]]:
    executor = ["--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK), "--num-threads", "1"]
    executor += ["--num-gpu-blocks-override", "128", "--max-num-batched-tokens", "256"]
    return executor, ["--max-num-batched-tokens", "256"]


def spec(server) -> str:
    return f"127.0.0.1:{server.port},admin={server.admin_port},http={server.http_port}"


LOGS: dict[int, object] = {}  # router port -> its log file


def start_router(tmp_path, servers, model, *extra: str) -> tuple[subprocess.Popen, int, int, int]:
    port, http, admin = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "chunkserve.cli", "router", "--port", str(port), "--http-port", str(http)]
    cmd += ["--admin-port", str(admin), "--metrics-port", "0", "--tokenizer", str(model), *extra]
    for s in servers:
        cmd += ["--replica", spec(s)]
    LOGS[port] = tmp_path / f"router-{port}.log"
    log = open(LOGS[port], "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    admin_stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
    deadline = time.time() + 180  # a failsafe against a hang, not a time limit
    while True:  # ready: every replica healthy with its event stream up
        assert proc.poll() is None, (tmp_path / f"router-{port}.log").read_text()
        try:
            listed = admin_stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas
            if len(listed) == len(servers) and all(r.healthy for r in listed):
                return proc, port, http, admin
        except grpc.RpcError:
            pass
        assert time.time() < deadline, (tmp_path / f"router-{port}.log").read_text()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def replicas(tiny_model_path, tmp_path_factory):
    executor, scheduler = replica_args(tiny_model_path)
    servers = [start_server(tmp_path_factory.mktemp("replica"), executor, scheduler) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(replicas, tiny_model_path, tmp_path_factory):
    proc, port, http, admin = start_router(tmp_path_factory.mktemp("router"), replicas, tiny_model_path)
    yield port, http, admin
    proc.terminate()
    proc.wait(15)


def run(address: str, request: pb.GenerateRequest) -> tuple[Completion, list[pb.GenerateResponse]]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    out, msgs = Completion(), []
    for msg in stub.Generate(request, timeout=120):
        out.add(msg)
        msgs.append(msg)
    return out, msgs


def greedy(prompt, n=8, **kw) -> pb.GenerateRequest:
    return build_request(prompt, temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def cached_blocks(admin: int) -> dict[str, int]:
    stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
    return {r.address: r.cached_blocks for r in stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas}


def wait_for_index(admin: int, blocks: int) -> None:
    """Until the router's index holds `blocks` blocks over all replicas (the deadline only
    stops a hang: a count past `blocks` fails at once)."""
    deadline = time.time() + 180  # a failsafe against a hang, not a time limit
    while (total := sum(cached_blocks(admin).values())) < blocks:
        assert time.time() < deadline, cached_blocks(admin)
        time.sleep(0.05)
    assert total == blocks, cached_blocks(admin)


def wait_for_quiet(admin: int) -> None:
    """Until the router sees no request anywhere: none of its own in flight and every
    replica's last load report empty. A report taken while the previous request still decoded
    makes its replica look busy, and the TTFT score may then send a follow-up elsewhere, so a
    test that expects the cached replica waits for this state first (the deadline only stops
    a hang)."""
    stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
    deadline = time.time() + 180  # a failsafe against a hang, not a time limit
    while True:
        replicas = stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas
        if all(not r.in_flight and not (r.load.num_running or r.load.num_waiting) for r in replicas):
            return
        assert time.time() < deadline, replicas
        time.sleep(0.05)


def test_tokens_equal_direct_and_follow_ups_go_to_the_cached_prefix(replicas, router):
    port, _, admin = router
    prefix = [(i * 7) % 100 + 3 for i in range(6 * BLOCK)]
    direct, _ = run(replicas[0].address, greedy(prefix + [5, 6, 7]))
    through, msgs = run(f"127.0.0.1:{port}", greedy(prefix + [5, 6, 7]))
    assert through.token_ids == direct.token_ids and through.finish_reason == direct.finish_reason
    assert {m.request_id for m in msgs} == {msgs[0].request_id} and msgs[0].request_id.startswith("rt-")
    # The events are asynchronous: first wait until the router's index holds exactly what the
    # two requests stored (6 full blocks on replica 0; 6 more on the other replica unless the
    # routed one found them cached there), or a late event of theirs could pass for the next one.
    stored = 6 if through.usage.cached_tokens == 6 * BLOCK else 12
    wait_for_index(admin, stored)
    # A new 8-block prefix goes to one replica; once its KV events reached the router, every
    # follow-up (same prefix, another suffix) goes there and finds all 8 blocks cached.
    other = [(i * 11) % 100 + 3 for i in range(8 * BLOCK)]
    run(f"127.0.0.1:{port}", greedy(other + [1]))
    wait_for_index(admin, stored + 8)
    for suffix in range(6):
        wait_for_quiet(admin)
        out, _ = run(f"127.0.0.1:{port}", greedy(other + [9, suffix]))
        assert out.usage.cached_tokens == 8 * BLOCK


def test_openai_api_through_the_router(router):
    import httpx

    port, http, _ = router
    body = {"model": "x", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    models = httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    reply = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"http://127.0.0.1:{http}/health", timeout=10).status_code == 200
    # no log line per proxied request (httpx logs each request it sends at INFO)
    assert "HTTP Request" not in LOGS[port].read_text()


def test_openai_stream_through_the_router_and_a_client_that_leaves(replicas, router):
    """A streamed completion through the router's HTTP front carries the replica's own text
    (greedy), and a client that leaves mid-stream frees the request on the replica: no request
    left, no block held."""
    import json

    import httpx

    _, http, _ = router
    models = httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=30).json()
    body = {"model": models["data"][0]["id"], "prompt": [7, 8, 9, 10, 11], "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}

    def streamed(base: str) -> str:
        text = ""
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text

    direct = streamed(f"http://127.0.0.1:{replicas[0].http_port}")
    assert streamed(f"http://127.0.0.1:{http}") == direct and direct
    aborted = sum(aborts(s.metrics_url) for s in replicas)
    with httpx.stream(
        "POST", f"http://127.0.0.1:{http}/v1/completions", json={**body, "max_tokens": 1000}, timeout=120
    ) as reply:
        assert reply.status_code == 200
        next(line for line in reply.iter_lines() if line.startswith("data: "))  # it is running
    for server in replicas:  # the connection closed: the replica's request ends, its blocks free
        server.assert_idle_and_no_leaks(timeout=120)
    assert sum(aborts(s.metrics_url) for s in replicas) == aborted + 1  # aborted, not run to its end


def aborts(metrics_url: str) -> float:
    """Requests a replica ended as aborted (its chunkserve_request_success_total{finished_reason="abort"})."""
    import httpx

    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("chunkserve_request_success_total{") and 'finished_reason="abort"' in line
    )


def test_abort_reaches_the_replica(router):
    port, _, _ = router
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    stream = stub.Generate(greedy([3] * 40, n=2000), timeout=120)
    first = next(stream)
    assert stub.Abort(pb.AbortRequest(request_id=first.request_id), timeout=10).found
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORTED
    assert not stub.Abort(pb.AbortRequest(request_id="rt-unknown"), timeout=10).found
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.num_device_blocks == 2 * 128  # summed over the replicas


def test_the_per_call_leg_gives_the_same_tokens_and_aborts(replicas, tiny_model_path, tmp_path):
    """`--replica-transport call` (one Generate call per request, the fallback for a replica
    without Multiplex) in a real router process: the tokens a replica gives directly, and
    Abort by the router's id ends the replica's request."""
    proc, port, _, _ = start_router(tmp_path, replicas, tiny_model_path, "--replica-transport", "call")
    try:
        assert "replica transport call" in (tmp_path / f"router-{port}.log").read_text()
        for prompt in ([5, 6, 7], [(i * 13) % 100 + 3 for i in range(3 * BLOCK + 5)]):
            direct, _ = run(replicas[0].address, greedy(prompt))
            through, msgs = run(f"127.0.0.1:{port}", greedy(prompt))
            assert through.token_ids == direct.token_ids and msgs[0].request_id.startswith("rt-")
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stream = stub.Generate(greedy([4] * 40, n=2000), timeout=120)
        first = next(stream)
        assert stub.Abort(pb.AbortRequest(request_id=first.request_id), timeout=10).found
        assert list(stream)[-1].finish_reason == pb.FINISH_REASON_ABORTED
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.parametrize("transport", ["mux", "call"])
def test_killing_a_replica_moves_its_queued_requests(tiny_model_path, tmp_path, transport):
    """A replica with one sequence slot holds one request running and the rest queued; it is
    killed: every request that had not streamed a token finishes on the other replica, with
    the tokens a replica gives it directly. Through either replica leg."""
    from concurrent.futures import ThreadPoolExecutor

    executor, scheduler = replica_args(tiny_model_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    slow = start_server(tmp_path / "a", executor, [*scheduler, "--max-num-seqs", "1"])
    spare = start_server(tmp_path / "b", executor, scheduler)
    try:
        proc, port, _, admin = start_router(
            tmp_path, [slow, spare], tiny_model_path, "--policy", "round_robin", "--replica-transport", transport
        )
        try:
            stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
            stub.DrainReplica(rpb.DrainReplicaRequest(address=f"127.0.0.1:{spare.port}", drain=True), timeout=5)
            prompts = [[10 + i] * 20 for i in range(4)]
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(run, f"127.0.0.1:{port}", greedy(p, n=200)) for p in prompts]
                waiting = pb_grpc.GenerationStub(grpc.insecure_channel(slow.address))
                deadline = time.time() + 180  # a failsafe against a hang, not a time limit
                while waiting.GetInfo(pb.GetInfoRequest(), timeout=5).num_requests_waiting < 3:
                    assert time.time() < deadline
                    time.sleep(0.05)
                stub.DrainReplica(rpb.DrainReplicaRequest(address=f"127.0.0.1:{spare.port}", drain=False), timeout=5)
                slow.scheduler.kill()
                slow.executor.kill()
                results = []
                for f in futures:
                    try:
                        results.append(f.result(timeout=120)[0])
                    except grpc.RpcError as exc:
                        results.append(exc.code())
            finished = [r for r in results if isinstance(r, Completion)]
            lost = [r for r in results if not isinstance(r, Completion)]
            assert len(finished) >= 3 and lost in ([], [grpc.StatusCode.UNAVAILABLE])  # the running one may fail
            for prompt, r in zip(prompts, results):
                if isinstance(r, Completion):
                    direct, _ = run(spare.address, greedy(prompt, n=200))
                    assert r.token_ids == direct.token_ids
        finally:
            proc.terminate()
            proc.wait(15)
    finally:
        for s in (slow, spare):
            s.stop()
