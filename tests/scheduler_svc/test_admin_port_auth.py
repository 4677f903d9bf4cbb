"""Who may call the admin port (scheduler_svc/admin.py AdminAccess) and the router's own.

Real gRPC servers on real ports (a SchedulerApp on a fake executor; the router in-process in
front of it), real clients: the Admin service's RPCs need --admin-token; the read-only
Replica service the router reads (KV events, load) also takes --admin-read-token, which opens
nothing else; health and reflection stay open; a port beyond loopback without a token is
refused at start-up unless the operator opts out.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as refl

from chunkserve.launch import free_port
from chunkserve.router.app import RouterApp, RouterConfig
from chunkserve.router.replicas import Intervals, ReplicaAddress
from chunkserve_contracts.auth import bearer_metadata, check_admin_bind, is_loopback
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc
from scheduler_svc import app as app_module
from scheduler_svc.admin_access import AdminAccess
from scheduler_svc.config import SchedulerConfig

ADMIN, READ = "admin-secret-1", "read-secret-2"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def config(admin_host: str = "127.0.0.1", admin_port: int | None = None) -> SchedulerConfig:
    return SchedulerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        http_port=0,
        admin_host=admin_host,
        admin_port=free_port() if admin_port is None else admin_port,
        startup_timeout_s=10,
        disable_log_stats=True,
    )


async def code_of(call) -> grpc.StatusCode:
    """The status a unary call (an awaitable) or the first message of a stream ends with."""
    try:
        if hasattr(call, "read"):
            await call.read()
            call.cancel()
        else:
            await call
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


@pytest.fixture
def serving(fakes, byte_tokenizer_dir, monkeypatch):
    """A SchedulerApp factory on a fake executor that computes steps (FakeExecutor)."""
    hs = fakes.fake_handshake(byte_tokenizer_dir)
    fake = fakes.FakeExecutor(num_blocks=64, block_size=16)
    monkeypatch.setattr(app_module, "ExecutorClient", lambda *a, **k: fakes.FakeExecutorClient(hs, fake))
    return app_module.SchedulerApp


def admin_cli(address: str, *action: str) -> int:
    """`chunkserve admin --address ADDRESS ACTION` (its parser reads CHUNKSERVE_ADMIN_TOKEN)."""
    import argparse

    from chunkserve.admin_cli import add_admin_parser, run_admin

    parser = argparse.ArgumentParser()
    add_admin_parser(parser.add_subparsers())
    return run_admin(parser.parse_args(["admin", "--address", address, *action]))


def test_admin_rpcs_need_the_admin_token_and_the_router_reads_with_the_read_token(serving, monkeypatch, capsys):
    access = AdminAccess(admin_token=ADMIN, admin_read_token=READ)

    async def main():
        app = serving(config(admin_host="0.0.0.0"), access)  # beyond loopback: allowed with a token
        await app.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.config.admin_port}") as channel:
                admin, replica = pb_grpc.AdminStub(channel), rpb_grpc.ReplicaStub(channel)
                callers = {
                    "none": (),
                    "wrong": bearer_metadata("guess"),
                    "read": bearer_metadata(READ),
                    "admin": bearer_metadata(ADMIN),
                }
                update = pb.SchedulingConfig(max_num_seqs=7)
                for who in ("none", "wrong", "read"):  # nothing that changes or traces the server
                    md = callers[who]
                    assert await code_of(admin.UpdateConfig(update, metadata=md)) == UNAUTHENTICATED, who
                    reset = admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=md)
                    assert await code_of(reset) == UNAUTHENTICATED, who
                    assert await code_of(admin.GetConfig(pb.GetConfigRequest(), metadata=md)) == UNAUTHENTICATED
                    watch = admin.WatchSteps(pb.WatchStepsRequest(), metadata=md)
                    assert await code_of(watch) == UNAUTHENTICATED, who
                live = app.ready.engine.scheduler.config
                assert live.max_num_seqs == 128  # the refused update changed nothing
                assert (await admin.UpdateConfig(update, metadata=callers["admin"])).max_num_seqs == 7
                assert app.ready.engine.scheduler.config.max_num_seqs == 7
                reset = admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=callers["admin"])
                assert await code_of(reset) == grpc.StatusCode.OK
                # The Replica service: the read token or the admin token, nothing else.
                for who in ("none", "wrong"):
                    md = callers[who]
                    assert await code_of(replica.GetLoad(rpb.GetLoadRequest(), metadata=md)) == UNAUTHENTICATED
                    events = replica.WatchKVEvents(rpb.WatchKVEventsRequest(), metadata=md)
                    assert await code_of(events) == UNAUTHENTICATED, who
                for who in ("read", "admin"):
                    load = await replica.GetLoad(rpb.GetLoadRequest(), metadata=callers[who])
                    assert load.block_size == 16 and load.num_device_blocks == 64
                    events = replica.WatchKVEvents(rpb.WatchKVEventsRequest(), metadata=callers[who])
                    first = await events.read()  # the snapshot, at once
                    assert first.replay
                    events.cancel()
                # `chunkserve admin` sends CHUNKSERVE_ADMIN_TOKEN, and says what to set without it.
                address = f"127.0.0.1:{app.config.admin_port}"
                monkeypatch.delenv("CHUNKSERVE_ADMIN_TOKEN", raising=False)
                assert await asyncio.to_thread(admin_cli, address, "config") == 1  # a blocking client: off the loop
                assert "UNAUTHENTICATED): set CHUNKSERVE_ADMIN_TOKEN" in capsys.readouterr().err
                monkeypatch.setenv("CHUNKSERVE_ADMIN_TOKEN", ADMIN)
                assert await asyncio.to_thread(admin_cli, address, "config") == 0
                assert '"maxNumSeqs": 7' in capsys.readouterr().out
                # Reflection stays open (grpcurl list).
                reflect = channel.stream_stream(
                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                    request_serializer=refl.ServerReflectionRequest.SerializeToString,
                    response_deserializer=refl.ServerReflectionResponse.FromString,
                )
                (listed,) = [r async for r in reflect(iter([refl.ServerReflectionRequest(list_services="")]))]
                assert "chunkserve.v1.Admin" in {s.name for s in listed.list_services_response.service}
        finally:
            await app.stop(grace=0)

    asyncio.run(main())


def test_without_a_token_the_admin_port_stays_on_loopback(serving):
    async def main():
        with pytest.raises(ValueError, match="CHUNKSERVE_ADMIN_TOKEN.*--admin-allow-unauthenticated"):
            serving(config(admin_host="0.0.0.0"))
        with pytest.raises(ValueError, match="--admin-read-token needs --admin-token"):
            serving(config(), AdminAccess(admin_read_token=READ))
        serving(config(admin_host="0.0.0.0", admin_port=0))  # no admin port: nothing to guard
        serving(config(admin_host="0.0.0.0"), AdminAccess(admin_allow_unauthenticated=True))  # the explicit opt-out
        replica = [ReplicaAddress("127.0.0.1", 1, 2)]
        with pytest.raises(ValueError, match="CHUNKSERVE_ROUTER_ADMIN_TOKEN"):
            RouterApp(RouterConfig(replicas=replica, admin_host="0.0.0.0", admin_port=free_port()))
        RouterApp(RouterConfig(replicas=replica, admin_port=free_port()))  # the router on loopback, no token
        app = serving(config())  # loopback, no token: open, as before
        await app.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.config.admin_port}") as channel:
                reply = await pb_grpc.AdminStub(channel).GetConfig(pb.GetConfigRequest())
                assert reply.max_num_seqs == 128
        finally:
            await app.stop(grace=0)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.7", False),
        ("replica-0.chunkserve-replicas", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback
    if not loopback:
        with pytest.raises(ValueError, match="is not loopback"):
            check_admin_bind(host, None, False)
        check_admin_bind(host, "t", False)
        check_admin_bind(host, None, True)


def test_the_commands_refuse_a_public_admin_port_without_a_token(monkeypatch, capsys):
    """`python -m scheduler_svc` and `chunkserve serve` say so in one line, exit status 2,
    before anything starts (no executor, no port opened); `chunkserve router` likewise."""
    from chunkserve import cli
    from chunkserve.router.cli import add_router_parser, config_from
    from scheduler_svc.__main__ import main as scheduler_main

    for name in ("CHUNKSERVE_ADMIN_TOKEN", "CHUNKSERVE_ADMIN_ALLOW_UNAUTHENTICATED", "CHUNKSERVE_ROUTER_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        scheduler_main(["--admin-host", "0.0.0.0"])
    assert exit_.value.code == 2 and "--admin-host 0.0.0.0 is not loopback" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--admin-host", "0.0.0.0", "--port", str(free_port())])
    assert exit_.value.code == 2 and "--admin-host 0.0.0.0 is not loopback" in capsys.readouterr().err

    import argparse

    def router_args():  # the environment is read when the parser is built
        parser = argparse.ArgumentParser()
        add_router_parser(parser.add_subparsers())
        return parser.parse_args(["router", "--replica", "127.0.0.1:1", "--admin-host", "0.0.0.0"])

    with pytest.raises(ValueError, match="CHUNKSERVE_ROUTER_ADMIN_TOKEN"):
        config_from(router_args())
    monkeypatch.setenv("CHUNKSERVE_ROUTER_ADMIN_TOKEN", "t")
    assert config_from(router_args()).admin_token == "t"


def test_the_router_reads_events_and_load_with_the_read_token_and_guards_its_own_admin_port(serving):
    """The router in front of one replica whose admin port wants a token: with the read token
    its event stream connects and its load comes in; a request through it streams what the
    replica streams directly; the router's Router service wants the router's admin token."""
    access = AdminAccess(admin_token=ADMIN, admin_read_token=READ)

    async def main():
        app = serving(config(), access)
        await app.start()
        router_admin = free_port()
        router = RouterApp(
            RouterConfig(
                replicas=[ReplicaAddress("127.0.0.1", app.port, app.config.admin_port)],
                host="127.0.0.1",
                port=0,
                http_port=0,
                admin_port=router_admin,
                metrics_port=0,
                admin_token="router-secret",
                replica_admin_token=READ,
                intervals=Intervals(health_s=0.05, load_s=0.05),
            )
        )
        try:
            await router.start()
            await router.wait_ready(1, timeout=60)  # the event stream is up: the read token was taken
            (replica,) = router.replicas.replicas.values()
            for _ in range(6000):  # the first GetLoad answer (polled every 50 ms)
                if replica.load.block_size:
                    break
                await asyncio.sleep(0.01)
            assert replica.load.block_size == 16 and replica.events_connected
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(40, 80))))
            request.sampling.max_tokens = 6
            request.sampling.temperature = 0.0

            async def tokens(address: str) -> tuple[list[int], list[str]]:
                async with grpc.aio.insecure_channel(address) as channel:
                    msgs = [m async for m in pb_grpc.GenerationStub(channel).Generate(request)]
                return [t for m in msgs for t in m.token_ids], [m.request_id for m in msgs]

            direct, _ = await tokens(f"127.0.0.1:{app.port}")
            routed, ids = await tokens(f"127.0.0.1:{router.port}")
            assert routed == direct and len(direct) == 6
            assert len(set(ids)) == 1 and ids[0].startswith("rt-")  # the router's id in every message
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                raw = channel.unary_stream("/chunkserve.v1.Generation/Generate")  # bytes: not a GenerateRequest
                assert await code_of(raw(b"\xff\xff\xff")) == grpc.StatusCode.INVALID_ARGUMENT
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router_admin}") as channel:
                stub = rpb_grpc.RouterStub(channel)
                assert await code_of(stub.ListReplicas(rpb.ListReplicasRequest())) == UNAUTHENTICATED
                drain = stub.DrainReplica(rpb.DrainReplicaRequest(address=replica.name, drain=True))
                assert await code_of(drain) == UNAUTHENTICATED and not replica.draining
                listed = await stub.ListReplicas(rpb.ListReplicasRequest(), metadata=bearer_metadata("router-secret"))
                assert [r.healthy for r in listed.replicas] == [True]
        finally:
            await router.stop(grace=0)
            await app.stop(grace=0)

    asyncio.run(main())
