"""The router's legs to its replicas, in-process: the router's Generation proxy in front of
replicas served by the real scheduler servicers on a fake executor (or by hand-written fakes of
a replica's Multiplex). Both transports give the replica's own tokens; a client that leaves
aborts its request on the replica; the stream breaking, or the replica marked down, ends every
open call (one that streamed nothing moves to another replica); a replica without Multiplex
gets per-call Generate, said once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest

from chunkserve.client import Completion, build_request
from chunkserve.launch import write_byte_tokenizer
from chunkserve.router.core import Router
from chunkserve.router.grpc_front import GenerationProxy
from chunkserve.router.metrics import RouterMetrics
from chunkserve.router.replicas import Replica, ReplicaAddress, ReplicaSet
from chunkserve_contracts.auth import BearerTokenInterceptor, bearer_metadata
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc
from scheduler_svc.mux import MuxServicer, add_mux_servicer
from scheduler_svc.servicer import GenerationServicer, add_generation_servicer
from tests.scheduler_svc.conftest import EOS, FakeExecutor, make_scheduler
from tests.scheduler_svc.test_mux import idle, make

FAKES = SimpleNamespace(FakeExecutor=FakeExecutor, make_scheduler=make_scheduler, EOS=EOS)
INFO = pb.GetInfoResponse(model_name="fake")


def greedy(prompt, n=6) -> pb.GenerateRequest:
    return build_request(prompt, temperature=0.0, max_tokens=n, ignore_eos=True)


async def start(*adders: Callable[[grpc.aio.Server], None], interceptors=()) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)])
    for add in adders:
        add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def replica_server(engine, limits, mux: bool = True, api_key: str = "") -> tuple[grpc.aio.Server, int]:
    """A replica's public port: Generation and (unless `mux` is False: an older chunkserve)
    GenerationMux, behind --api-key `api_key` when given."""
    servicer = GenerationServicer(lambda: (engine, limits, INFO))
    adders = [lambda s: add_generation_servicer(servicer, s)]
    if mux:
        adders.append(lambda s: add_mux_servicer(MuxServicer(servicer), s))
    return await start(*adders, interceptors=[BearerTokenInterceptor(api_key)] if api_key else [])


class Front:
    """The router's gRPC front over replicas at `ports` (healthy unless listed in `down`),
    without its health, event and load tasks: the test sets each replica's state. `api_key`:
    the router's --api-key, sent on its Multiplex streams."""

    def __init__(self, ports: list[int], transport: str, down: tuple[int, ...] = (), api_key: str = "") -> None:
        self.set = ReplicaSet([], transport=transport, api_key=api_key)
        self.replicas = []
        for port in ports:
            r = Replica(ReplicaAddress("127.0.0.1", port, 0), transport=transport, auth=bearer_metadata(api_key))
            r.healthy = port not in down
            self.set.replicas[r.name] = r
            self.replicas.append(r)
        self.router = Router(self.set, RouterMetrics(lambda: self.replicas), None, policy="least_loaded")

    async def __aenter__(self) -> pb_grpc.GenerationStub:
        proxy = GenerationProxy(self.router)
        self.server, port = await start(lambda s: s.add_generic_rpc_handlers((proxy.handler(),)))
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return pb_grpc.GenerationStub(self.channel)

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.set.close()
        self.router.close()


async def complete(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> tuple[Completion, set[str]]:
    out, ids = Completion(), set()
    async for msg in stub.Generate(request, timeout=60):
        out.add(msg)
        ids.add(msg.request_id)
    return out, ids


@pytest.fixture
def tokenizer_dir(tmp_path):
    return write_byte_tokenizer(tmp_path)


@pytest.mark.parametrize("transport", ["mux", "call"])
def test_tokens_through_the_router_equal_the_replicas(tokenizer_dir, transport):
    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        server, port = await replica_server(engine, limits)
        requests = [greedy(list(range(5, 30)), n=9), greedy("hello there", n=7), greedy([3, 4], n=1)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                direct = [await complete(pb_grpc.GenerationStub(channel), r) for r in requests]
            front = Front([port], transport)
            async with front as stub:
                through = await asyncio.gather(*(complete(stub, r) for r in requests))
                assert (front.replicas[0].mux is not None) == (transport == "mux")
            for (want, _), (got, ids) in zip(direct, through):
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
                assert got.usage.completion_tokens == want.usage.completion_tokens
                assert len(ids) == 1 and ids.pop().startswith("rt-")  # the router's id in every message
            await idle(engine)
        finally:
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("transport", ["mux", "call"])
def test_a_client_that_leaves_aborts_its_request_on_the_replica(tokenizer_dir, transport, how):
    """The client cancels its call, or its deadline passes: the router's handler ends and the
    replica aborts the request (a cancel on the stream, or the Generate call cancelled)."""

    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        server, port = await replica_server(engine, limits)
        try:
            async with Front([port], transport) as stub:
                call = stub.Generate(greedy([9] * 10, n=80), timeout=60 if how == "cancel" else 3)
                await call.read()  # the admission message: the request is on the replica
                engine.executor.gate.clear()  # held: the request cannot finish by itself
                assert engine.scheduler.requests
                if how == "cancel":
                    call.cancel()
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        while True:
                            await call.read()
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await idle(engine)  # aborted there: no request, every block free
        finally:
            engine.executor.gate.set()
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


class FakeMux(rpb_grpc.GenerationMuxServicer):
    """A replica's Multiplex, scripted: call ids in `answer` get an admission message and one
    token; the `break_on`-th start runs `before_break` and ends the stream UNAVAILABLE; others
    get nothing (they wait)."""

    def __init__(self, answer=(), break_on: int = 0, before_break: Callable[[], None] = lambda: None) -> None:
        self.answer, self.break_on, self.before_break = answer, break_on, before_break
        self.started = asyncio.Event()

    async def Multiplex(self, requests, context):
        await context.send_initial_metadata(())  # as the protocol asks: the router waits for it
        n = 0
        async for request in requests:
            if request.WhichOneof("kind") != "generate":
                continue
            n += 1
            self.started.set()
            if n == self.break_on:
                self.before_break()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica broke")
            if n in self.answer:
                admission = pb.GenerateResponse(request_id=f"fake-{n}").SerializeToString()
                token = pb.GenerateResponse(request_id=f"fake-{n}", token_ids=[7], text="x").SerializeToString()
                yield rpb.MuxResponses(
                    responses=[rpb.MuxResponse(call=request.call, message=m) for m in (admission, token)]
                )


def test_the_stream_breaking_ends_every_open_call(tokenizer_dir):
    """Replica A's stream breaks with two calls open: the one that streamed a token ends
    UNAVAILABLE, the one that streamed nothing finishes on replica B with B's tokens."""

    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        b_server, b_port = await replica_server(engine, limits)
        fake = FakeMux(answer=(1,), break_on=2)
        a_server, a_port = await start(lambda s: rpb_grpc.add_GenerationMuxServicer_to_server(fake, s))
        front = Front([a_port, b_port], "mux", down=(b_port,))
        b = front.replicas[1]
        fake.before_break = lambda: setattr(b, "healthy", True)  # B joins as A breaks
        request = greedy([11] * 8, n=5)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{b_port}") as channel:
                direct, _ = await complete(pb_grpc.GenerationStub(channel), request)
            async with front as stub:
                streaming = stub.Generate(greedy([5] * 8, n=5), timeout=60)
                assert not (await streaming.read()).token_ids  # A's admission message
                assert (await streaming.read()).token_ids == [7]  # and a token: it cannot move
                moved, ids = await complete(stub, request)  # on A when A breaks: moves to B
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await streaming.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "broke" in err.value.details()
            assert moved.token_ids == direct.token_ids and moved.finish_reason == direct.finish_reason
            assert len(ids) == 1
            labels = {"replica": front.replicas[0].name, "code": "UNAVAILABLE"}
            assert front.router.metrics.registry.get_sample_value("chunkserve_router_retries_total", labels) == 1
            await idle(engine)
        finally:
            await engine.stop()
            await a_server.stop(None)
            await b_server.stop(None)

    asyncio.run(main())


def test_a_replica_marked_down_ends_its_calls_and_they_move(tokenizer_dir):
    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        b_server, b_port = await replica_server(engine, limits)
        fake = FakeMux()  # A takes the request and never answers
        a_server, a_port = await start(lambda s: rpb_grpc.add_GenerationMuxServicer_to_server(fake, s))
        front = Front([a_port, b_port], "mux", down=(b_port,))
        a, b = front.replicas
        try:
            async with front as stub:
                moving = asyncio.ensure_future(complete(stub, greedy([12] * 8, n=4)))
                await fake.started.wait()
                b.healthy = True
                a.mark_down("the test took it down")
                assert a.mux is None  # the next request opens a new stream
                done, ids = await moving
            assert done.usage.completion_tokens == 4 and len(ids) == 1
            await idle(engine)
        finally:
            await engine.stop()
            await a_server.stop(None)
            await b_server.stop(None)

    asyncio.run(main())


def test_a_replica_without_multiplex_gets_per_call_generate(tokenizer_dir, caplog):
    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        server, port = await replica_server(engine, limits, mux=False)  # an older chunkserve
        request = greedy(list(range(40, 52)), n=6)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                direct, _ = await complete(pb_grpc.GenerationStub(channel), request)
            front = Front([port], "mux")
            async with front as stub:
                first = await asyncio.gather(*(complete(stub, request) for _ in range(3)))  # on the refused stream
                later, _ = await complete(stub, request)  # straight to Generate
                assert front.replicas[0].mux.unsupported
            for got, _ in [*first, (later, None)]:
                assert got.token_ids == direct.token_ids
            refusals = [r for r in caplog.records if "refused Multiplex" in r.getMessage()]
            assert len(refusals) == 1 and "UNIMPLEMENTED" in refusals[0].getMessage()
            await idle(engine)
        finally:
            await engine.stop()
            await server.stop(None)

    with caplog.at_level(logging.WARNING, logger="chunkserve.router.legs"):
        asyncio.run(main())


@pytest.mark.parametrize("router_key", ["k3y", ""])
def test_replicas_with_an_api_key(tokenizer_dir, caplog, router_key):
    """Replicas behind --api-key: a router with the key streams on Multiplex with it; a router
    without one is refused the stream (UNAUTHENTICATED, said once) and sends each request as
    its own Generate call with the client's key, which the replica checks: a client without
    the key is refused there."""

    async def main():
        engine, limits = make(FAKES, tokenizer_dir)
        engine.start()
        server, port = await replica_server(engine, limits, api_key="k3y")
        request = greedy(list(range(60, 70)), n=5)
        client_key = bearer_metadata("k3y")
        try:
            front = Front([port], "mux", api_key=router_key)
            async with front as stub:
                got = Completion()
                async for msg in stub.Generate(request, metadata=client_key, timeout=60):
                    got.add(msg)
                assert got.usage.completion_tokens == 5
                assert front.replicas[0].mux.unsupported == (not router_key)
                if not router_key:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(request, timeout=60):
                            pass
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            refusals = [r for r in caplog.records if "refused Multiplex" in r.getMessage()]
            assert len(refusals) == (0 if router_key else 1)
            await idle(engine)
        finally:
            await engine.stop()
            await server.stop(None)

    with caplog.at_level(logging.WARNING, logger="chunkserve.router.legs"):
        asyncio.run(main())
