"""`chunkserve serve --data-parallel-size N`: the replicas' flags (ports, threads, KV event
endpoints), and a real two-replica server behind its router (slow)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import grpc
import pytest

from chunkserve.dp import plan_replicas, replica_env
from chunkserve.router.replicas import parse_replica
from executor_svc.config import ExecutorConfig
from scheduler_svc.admin_access import AdminAccess
from scheduler_svc.config import SchedulerConfig


def flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last one wins, as in argparse


def test_secrets_reach_the_replicas_through_their_environment_only():
    sched = SchedulerConfig(port=7000, api_key="key-1")
    access = AdminAccess(admin_token="admin-2", admin_read_token="read-3")
    plans = plan_replicas(2, sched, ExecutorConfig(executor_port=7100), cpus=list(range(4)))
    for plan in plans:  # `ps` shows a command line: no secret there
        assert not {"key-1", "admin-2", "read-3"} & set(plan.argv), plan.argv
        assert "--admin-host" in plan.argv and flag(plan.argv, "--admin-host") == "127.0.0.1"
    env = replica_env(sched, access, {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "CHUNKSERVE_API_KEY": "key-1",
        "CHUNKSERVE_ADMIN_TOKEN": "admin-2",
        "CHUNKSERVE_ADMIN_READ_TOKEN": "read-3",
    }
    assert replica_env(SchedulerConfig(), AdminAccess(), {"PATH": "/bin"}) == {"PATH": "/bin"}


def test_plans_offset_ports_split_cpus_and_offset_event_endpoints():
    kv = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560"})
    sched = SchedulerConfig(
        port=7000, http_port=8000, metrics_port=9000, kv_events_config=kv, max_num_batched_tokens=0, target_itl_ms=50.0
    )
    execu = ExecutorConfig(executor_port=7100)
    plans = plan_replicas(2, sched, execu, cpus=list(range(8)))
    ports = [(flag(p.argv, "--port"), flag(p.argv, "--admin-port"), flag(p.argv, "--http-port")) for p in plans]
    assert ports == [("7100", "7101", "7102"), ("7200", "7201", "7202")]
    assert [flag(p.argv, "--executor-port") for p in plans] == ["7200", "7300"]
    assert {flag(p.argv, "--host") for p in plans} == {"127.0.0.1"}
    assert [flag(p.argv, "--num-threads") for p in plans] == ["3", "3"]  # (8 CPUs - 2 schedulers) / 2
    assert [p.cpus for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert flag(plans[0].argv, "--max-num-batched-tokens") == "0"  # auto stays auto
    events = [json.loads(flag(p.argv, "--kv-events-config")) for p in plans]
    assert [(e["endpoint"], e["replay_endpoint"]) for e in events] == [
        ("tcp://*:5557", "tcp://*:5560"),
        ("tcp://*:5558", "tcp://*:5561"),
    ]
    assert parse_replica(plans[1].spec).admin == "127.0.0.1:7201"
    # Two CPUs, two replicas: one thread each, nothing pinned (no room for a scheduler each).
    small = plan_replicas(2, SchedulerConfig(), ExecutorConfig(), cpus=[0, 1])
    assert [flag(p.argv, "--num-threads") for p in small] == ["1", "1"] and small[0].cpus is None
    assert "--api-key" not in " ".join(
        plan_replicas(2, SchedulerConfig(api_key="s3cret"), ExecutorConfig(), [0])[0].argv
    )
    with pytest.raises(ValueError, match="TLS"):
        plan_replicas(2, SchedulerConfig(tls_cert_file="c.pem", tls_key_file="k.pem"), ExecutorConfig(), [0, 1])


def _laid_out_ports() -> tuple[int, int, int]:
    """(--port, --admin-port, --executor-port) for two replicas, all of whose derived ports
    (chunkserve/dp.py: + 100 * (i + 1), + 1 .. + 3) were free a moment ago. Below the kernel's
    ephemeral range (32768+ on Linux), where a client connection's local port never lands: one
    free port plus offsets once collided there with another connection's."""
    rng = random.Random()
    for _ in range(1000):
        port, eport = rng.randrange(20000, 32000, 4), rng.randrange(20000, 32000, 4) + 2
        wanted = {port + off + j for off in (0, 100, 200) for j in range(4)} | {eport + off for off in (0, 100, 200)}
        if len(wanted) == 15 and all(_bindable(p) for p in wanted):
            return port, port + 1, eport
    raise AssertionError("no free port layout between 20000 and 32300")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_two_replicas_behind_the_router(tiny_model_path, tmp_path):
    from chunkserve.client import Completion, build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
    from chunkserve_contracts.v1 import replica_pb2 as rpb
    from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

    port, admin, eport = _laid_out_ports()
    cmd = [sys.executable, "-m", "chunkserve.cli", "serve", str(tiny_model_path), "--data-parallel-size", "2"]
    cmd += ["--port", str(port), "--http-port", "0", "--metrics-port", "0", "--admin-port", str(admin)]
    cmd += ["--executor-port", str(eport), "--dtype", "float32", "--num-gpu-blocks-override", "64"]
    log = tmp_path / "dp.log"
    env = dict(os.environ, CHUNKSERVE_API_KEY="s3cret")  # the router and the replicas require it
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    auth = (("authorization", "Bearer s3cret"),)
    try:
        stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                listed = stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas
                if len(listed) == 2 and all(r.healthy for r in listed):
                    break
            except grpc.RpcError:
                pass
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert [r.address for r in listed] == [f"127.0.0.1:{port + 100}", f"127.0.0.1:{port + 200}"]
        gen = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        request = build_request([5, 6, 7], temperature=0.0, max_tokens=4, ignore_eos=True)
        out = Completion()
        for msg in gen.Generate(request, timeout=60, metadata=auth):
            out.add(msg)
        assert len(out.token_ids) == 4
        direct = Completion()
        replica = pb_grpc.GenerationStub(grpc.insecure_channel(listed[1].address))
        for msg in replica.Generate(request, timeout=60, metadata=auth):
            direct.add(msg)
        assert out.token_ids == direct.token_ids
        for stub in (gen, replica):  # no key: refused by the router, and by a replica reached directly
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=60))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
