"""Server reflection on both of the scheduler's gRPC ports, in both protocol versions.

grpcurl tries `grpc.reflection.v1` first and falls back to `v1alpha`; Postman speaks only
v1alpha. Each port must list its services and resolve them to descriptors in either version,
so that `grpcurl -plaintext localhost:<admin-port> chunkserve.v1.Admin/WatchSteps` finds the
method. v1alpha is checked with grpcio-reflection's own client, both versions with a
hand-rolled ServerReflectionInfo stream (v1's messages are v1alpha's under a new package:
the same bytes on the wire). One SchedulerApp with a fake executor handshake, no processes.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from chunkserve.launch import free_port
from scheduler_svc import app as app_module
from scheduler_svc.config import SchedulerConfig

METHOD = {
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}
REFLECTION = {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
HEALTH = "grpc.health.v1.Health"
# port -> (the services it lists, a service and a method of it that must resolve, streaming?)
EXPECTED = {
    # and GenerationMux, a router's calls on one stream
    "public": (
        {"chunkserve.v1.Generation", "chunkserve.v1.GenerationMux", HEALTH} | REFLECTION,
        "chunkserve.v1.Generation",
        "Generate",
    ),
    # the admin port also serves the router's Replica service (KV events, load: issue 36)
    "admin": ({"chunkserve.v1.Admin", "chunkserve.v1.Replica"} | REFLECTION, "chunkserve.v1.Admin", "WatchSteps"),
}


def pool_of(files: list[bytes]) -> descriptor_pool.DescriptorPool:
    """A fresh pool (nothing of this process's own descriptors) built from reflection's answer."""
    protos = {p.name: p for p in map(descriptor_pb2.FileDescriptorProto.FromString, files)}
    pool, added = descriptor_pool.DescriptorPool(), set()
    while len(added) < len(protos):  # dependencies first
        ready = [p for name, p in protos.items() if name not in added and set(p.dependency) <= added]
        assert ready, f"the answer lacks a dependency: {[(p.name, list(p.dependency)) for p in protos.values()]}"
        for p in ready:
            pool.Add(p)
            added.add(p.name)
    return pool


async def reflect(address: str, version: str, symbol: str) -> tuple[set[str], descriptor_pool.DescriptorPool]:
    """One ServerReflectionInfo stream: list_services, then file_containing_symbol."""
    async with grpc.aio.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            METHOD[version],
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        requests = [
            rpb.ServerReflectionRequest(list_services=""),
            rpb.ServerReflectionRequest(file_containing_symbol=symbol),
        ]
        listed, found = [r async for r in stream(iter(requests), timeout=10)]
    assert listed.WhichOneof("message_response") == "list_services_response", listed
    assert found.WhichOneof("message_response") == "file_descriptor_response", found
    names = {s.name for s in listed.list_services_response.service}
    return names, pool_of(list(found.file_descriptor_response.file_descriptor_proto))


def v1alpha_official_client(address: str, service: str, method: str) -> tuple[set[str], bool]:
    """grpcio-reflection's client: the services listed, whether `method` streams its responses.
    Synchronous (run it in a thread, off the server's loop); the pool asks lazily, channel open."""
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        found = descriptor_pool.DescriptorPool(db).FindServiceByName(service).methods_by_name[method]
        return set(db.get_services()), found.server_streaming


def test_reflection_v1_and_v1alpha_on_the_public_and_admin_ports(fakes, byte_tokenizer_dir, monkeypatch):
    hs = fakes.fake_handshake(byte_tokenizer_dir)  # answered; no request is sent, so never a step
    monkeypatch.setattr(app_module, "ExecutorClient", lambda *args, **kwargs: fakes.FakeExecutorClient(hs))
    config = SchedulerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        http_port=0,
        admin_port=free_port(),
        startup_timeout_s=10,
        api_key="s3cret",  # reflection stays open without the token, in both versions
    )

    async def main():
        app = app_module.SchedulerApp(config)
        try:
            await app.start()
            addresses = {"public": f"127.0.0.1:{app.port}", "admin": f"127.0.0.1:{config.admin_port}"}
            for port, (services, service, method) in EXPECTED.items():
                for version in METHOD:
                    names, pool = await reflect(addresses[port], version, service)
                    assert names == services, (port, version)
                    found = pool.FindServiceByName(service).methods_by_name[method]
                    assert found.full_name == f"{service}.{method}" and found.server_streaming, (port, version)
                names, streaming = await asyncio.to_thread(v1alpha_official_client, addresses[port], service, method)
                assert names == services and streaming, port
            # `grpcurl describe grpc.reflection.v1.ServerReflection`: v1's own descriptors, under v1
            _, pool = await reflect(addresses["admin"], "v1", "grpc.reflection.v1.ServerReflection")
            info = pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods_by_name["ServerReflectionInfo"]
            assert info.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
            assert info.output_type.full_name == "grpc.reflection.v1.ServerReflectionResponse"
            assert info.client_streaming and info.server_streaming
        finally:
            await app.stop(grace=0)

    asyncio.run(main())
