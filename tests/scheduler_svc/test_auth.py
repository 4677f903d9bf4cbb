"""Bearer token and TLS on the public API (tiny random model, real server)."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkserve.client import build_request
from chunkserve.launch import start_server
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts real server processes: the full tier only


def test_bearer_token_and_tls(tiny_model_path, tmp_path, monkeypatch):
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(tmp_path / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("CHUNKSERVE_API_KEY", "s3cret")  # through the environment, as documented
    server = start_server(
        tmp_path,
        ["--model", str(tiny_model_path), "--dtype", "float32"],
        ["--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")],
    )
    try:
        creds = grpc.ssl_channel_credentials((tmp_path / "cert.pem").read_bytes())
        channel = grpc.secure_channel(server.address, creds)
        stub = pb_grpc.GenerationStub(channel)
        request = build_request([5, 6, 7], temperature=0.0, max_tokens=2)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret"),)
        out = list(stub.Generate(request, metadata=good, timeout=30))
        assert out[-1].finished and out[-1].usage.completion_tokens == 2
        health = health_pb2_grpc.HealthStub(channel)  # probes need no token
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1
        with pytest.raises(grpc.RpcError):  # plaintext to a TLS port fails
            pb_grpc.GenerationStub(grpc.insecure_channel(server.address)).GetInfo(
                pb.GetInfoRequest(), metadata=good, timeout=3
            )
    finally:
        server.stop()
