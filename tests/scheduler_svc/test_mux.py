"""GenerationMux.Multiplex in-process with the fake executor: each call streams what Generate
streams for the same request, one engine step's messages of every call come as one batch, bad
bytes or a bad request end only their own call, cancel and the stream's end abort the requests
(no block held after), and under random interleavings of starts, cancels, bad payloads and the
stream's end every call ends exactly once, its messages in order, nothing after its end."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.client import Completion, build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.mux import MuxServicer, add_mux_servicer
from scheduler_svc.servicer import GenerationServicer, add_generation_servicer
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import Limits

INFO = pb.GetInfoResponse(model_name="fake")


def make(fakes, tokenizer_dir):
    """An engine on a fake executor whose steps wait while `engine.executor.gate` is clear: a
    test holds the engine so that its requests cannot finish on their own."""

    class HeldExecutor(fakes.FakeExecutor):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.gate = asyncio.Event()
            self.gate.set()

        async def step(self, plan, timeout):
            await self.gate.wait()
            return await super().step(plan, timeout)

    sched = fakes.make_scheduler(num_blocks=64, block_size=4, max_model_len=100)
    tokenizer = Tokenizer(tokenizer_dir)
    engine = Engine(sched, HeldExecutor(64, 4), tokenizer, frozenset({fakes.EOS}), 100, 5.0)
    return engine, Limits.for_tokenizer(100, 257, tokenizer.max_bytes_per_token)


def greedy(prompt, n=6, client_request_id="", **kw) -> pb.GenerateRequest:
    request = build_request(prompt, temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    request.client_request_id = client_request_id
    return request


REQUESTS = {
    1: greedy(list(range(5, 21)), n=8),
    2: greedy("hello world", n=6, client_request_id="mine"),
    3: greedy("abc", n=5, logprobs=2),
    4: greedy(list(range(30, 34)), n=1),
}


async def serve(engine, limits):
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = GenerationServicer(lambda: (engine, limits, INFO))
    add_generation_servicer(servicer, server)
    add_mux_servicer(MuxServicer(servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def until_ended(call, ids) -> dict[int, list[rpb.MuxResponse]]:
    """Reads batches until every call in `ids` ended; each call's entries in order."""
    out: dict[int, list[rpb.MuxResponse]] = {i: [] for i in ids}
    waiting = set(ids)
    while waiting:
        batch = await call.read()
        assert batch is not grpc.aio.EOF, f"the stream ended with {waiting} open"
        for r in batch.responses:
            assert r.call in waiting, f"an entry for call {r.call} after its end"
            out[r.call].append(r)
            if r.code or r.last:
                waiting.discard(r.call)
    return out


def completion(entries: list[rpb.MuxResponse]) -> Completion:
    out = Completion()
    for r in entries:
        assert not r.code, r.details
        out.add(pb.GenerateResponse.FromString(r.message))
    return out


async def idle(engine) -> None:
    """Waits (bounded in steps, not time) until the engine holds no request."""
    for _ in range(2000):
        if not engine.scheduler.requests:
            break
        await asyncio.sleep(0.001)
    sched = engine.scheduler
    assert not sched.requests and sched.pool.num_free_blocks == sched.pool.num_blocks


def test_each_call_streams_what_generate_streams(fakes, byte_tokenizer_dir):
    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        engine.start()
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                direct = {}
                for i, request in REQUESTS.items():  # one at a time through Generate
                    direct[i] = Completion()
                    async for msg in pb_grpc.GenerationStub(channel).Generate(request):
                        direct[i].add(msg)
                call = rpb_grpc.GenerationMuxStub(channel).Multiplex()
                for i, request in REQUESTS.items():  # all at once on one stream
                    await call.write(rpb.MuxRequest(call=i, generate=request.SerializeToString()))
                entries = await until_ended(call, REQUESTS)
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF  # half-closed with no call open: the stream ends
                assert await call.code() == grpc.StatusCode.OK
            for i, request in REQUESTS.items():
                first = pb.GenerateResponse.FromString(entries[i][0].message)
                assert not first.token_ids and not first.finished and first.request_id  # the admission message
                assert first.client_request_id == request.client_request_id
                assert first.prompt_tokens == direct[i].usage.prompt_tokens
                assert [r.last for r in entries[i]] == [False] * (len(entries[i]) - 1) + [True]
                got = completion(entries[i])
                assert {pb.GenerateResponse.FromString(r.message).request_id for r in entries[i]} == {got.request_id}
                assert (got.token_ids, got.text, got.finish_reason) == (
                    direct[i].token_ids,
                    direct[i].text,
                    direct[i].finish_reason,
                )
                usage = got.usage
                assert (usage.prompt_tokens, usage.completion_tokens) == (
                    direct[i].usage.prompt_tokens,
                    direct[i].usage.completion_tokens,
                )  # cached_tokens differs: the second run hits the first one's prefix cache
                assert got.logprobs == direct[i].logprobs and len(got.logprobs) == (5 if i == 3 else 0)
            await idle(engine)
        finally:
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


def test_one_steps_messages_of_every_call_come_as_one_batch(fakes, byte_tokenizer_dir):
    """Three calls admitted before the engine runs are planned into the same steps: each
    step's tokens of all three arrive in one MuxResponses."""

    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)  # not started: the calls queue up
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = rpb_grpc.GenerationMuxStub(channel).Multiplex()
                for i in range(3):
                    await call.write(rpb.MuxRequest(call=i, generate=greedy([40 + i] * 6, n=4).SerializeToString()))
                admitted = 0
                while admitted < 3:  # the admission messages (maybe in several batches)
                    admitted += len((await call.read()).responses)
                engine.start()
                batches = [await call.read()]
                while not all(r.last for r in batches[-1].responses):
                    batches.append(await call.read())
                # Every step has a token of each call, so every batch has an entry of each (a
                # writer that fell behind folds two steps into one entry per call).
                assert all(sorted(r.call for r in b.responses) == [0, 1, 2] for b in batches)
        finally:
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


def test_bad_calls_end_alone_and_the_others_go_on(fakes, byte_tokenizer_dir):
    """Bytes that are not a GenerateRequest, a request that fails validation, a MuxRequest with
    neither kind and a second `generate` on an open call each end one call with
    INVALID_ARGUMENT; the other calls on the stream finish."""

    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        engine.start()
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = rpb_grpc.GenerationMuxStub(channel).Multiplex()
                good = greedy(list(range(5, 15)), n=30).SerializeToString()
                await call.write(rpb.MuxRequest(call=1, generate=good))
                await call.write(rpb.MuxRequest(call=2, generate=b"\x0a\x02\xff\xfe"))  # text with bad UTF-8
                await call.write(rpb.MuxRequest(call=3, generate=greedy("hi", n=0).SerializeToString()))
                await call.write(rpb.MuxRequest(call=4))
                await call.write(rpb.MuxRequest(call=5, generate=good))
                await call.write(rpb.MuxRequest(call=5, generate=good))  # 5 is open: it ends
                await call.write(rpb.MuxRequest(call=6, generate=greedy([9, 9, 9], n=3).SerializeToString()))
                entries = await until_ended(call, [1, 2, 3, 4, 5, 6])
            for i, field in ((2, "GenerateRequest"), (3, "max_tokens"), (4, "generate"), (5, "already open")):
                end = entries[i][-1]
                assert (end.code, end.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], b""), i
                assert field in end.details, end.details
            assert len(entries[2]) == len(entries[3]) == len(entries[4]) == 1  # nothing admitted for them
            assert completion(entries[1]).usage.completion_tokens == 30
            assert completion(entries[6]).usage.completion_tokens == 3
            await idle(engine)  # 5's request was aborted
        finally:
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["cancel", "stream cancelled", "half-closed"])
def test_cancel_and_the_streams_end_free_everything(fakes, byte_tokenizer_dir, how):
    """A call's cancel aborts its request (it ends CANCELLED); the stream cancelled by the
    client aborts every open call's request; a half-close lets them finish."""

    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        engine.start()
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = rpb_grpc.GenerationMuxStub(channel).Multiplex()
                for i in range(3):
                    request = greedy([20 + i] * 10, n=80 if how != "half-closed" else 5)
                    await call.write(rpb.MuxRequest(call=i, generate=request.SerializeToString()))
                tokens = 0
                while tokens < 3:  # every call is decoding
                    batch = await call.read()
                    tokens += sum(bool(pb.GenerateResponse.FromString(r.message).token_ids) for r in batch.responses)
                if how != "half-closed":
                    engine.executor.gate.clear()  # held: the requests cannot finish on their own
                if how == "cancel":
                    await call.write(rpb.MuxRequest(call=1, cancel=True))
                    await call.write(rpb.MuxRequest(call=1, cancel=True))  # not open any more: ignored
                    ends = []
                    while not ends:
                        ends = [r for r in (await call.read()).responses if r.code]
                    assert [(r.call, r.code) for r in ends] == [(1, grpc.StatusCode.CANCELLED.value[0])]
                    for i in (0, 2):
                        await call.write(rpb.MuxRequest(call=i, cancel=True))
                elif how == "stream cancelled":
                    call.cancel()
                else:
                    await call.done_writing()
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    assert await call.code() == grpc.StatusCode.OK
                await idle(engine)
        finally:
            engine.executor.gate.set()
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


def test_bytes_that_are_not_a_mux_request_end_the_stream(fakes, byte_tokenizer_dir):
    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        engine.start()
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                raw = channel.stream_stream("/chunkserve.v1.GenerationMux/Multiplex")
                call = raw()
                good = rpb.MuxRequest(call=1, generate=greedy([7] * 8, n=60).SerializeToString())
                await call.write(good.SerializeToString())
                while not rpb.MuxResponses.FromString(await call.read()).responses:
                    pass
                engine.executor.gate.clear()
                await call.write(b"\x08\xff")  # a truncated varint
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await call.read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                await idle(engine)  # call 1's request was aborted with the stream
        finally:
            engine.executor.gate.set()
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


class _Context:
    def peer(self) -> str:
        return "test"

    async def send_initial_metadata(self, metadata) -> None:
        pass

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 5), st.sampled_from(["ids", "text", "bad bytes", "bad field"])),
        st.tuples(st.just("cancel"), st.integers(0, 5)),
        st.tuples(st.just("run"), st.integers(0, 4)),
    ),
    max_size=24,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, ending=st.sampled_from(["half-close", "break"]))
def test_random_interleavings(fakes, byte_tokenizer_dir, ops, ending):
    """The servicer driven directly: every call ends exactly once (at most once per start; all
    of them once the client half-closed), each call's messages in order (admission, tokens,
    the final one with the usage they add up to), and the engine holds nothing at the end."""
    payloads = {
        "ids": greedy([3, 4, 5, 6, 7], n=4).SerializeToString(),
        "text": greedy("hey", n=3).SerializeToString(),
        "bad bytes": b"\x0a\x01\xff",
        "bad field": greedy("hey", n=0).SerializeToString(),
    }

    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        engine.start()
        servicer = GenerationServicer(lambda: (engine, limits, INFO))
        inbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (request := await inbox.get()) is not None:
                yield request

        batches: list[rpb.MuxResponses] = []

        async def consume():
            async for batch in MuxServicer(servicer).Multiplex(requests(), _Context()):
                batches.append(batch)

        consumer = asyncio.get_running_loop().create_task(consume())
        starts = {i: 0 for i in range(6)}
        try:
            for op in ops:
                if op[0] == "start":
                    starts[op[1]] += 1
                    inbox.put_nowait(rpb.MuxRequest(call=op[1], generate=payloads[op[2]]))
                elif op[0] == "cancel":
                    inbox.put_nowait(rpb.MuxRequest(call=op[1], cancel=True))
                else:
                    await asyncio.sleep(0.001 * op[1])
            if ending == "half-close":
                inbox.put_nowait(None)
                await asyncio.wait_for(consumer, 60)  # a bound for a hang, not a timing assertion
            else:
                engine.executor.gate.clear()  # held: only the stream's end can end its requests
                await asyncio.sleep(0)
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
            await idle(engine)
        finally:
            consumer.cancel()
            engine.executor.gate.set()
            await engine.stop()
            servicer._tokenize_pool.shutdown()
        check_calls([r for b in batches for r in b.responses], starts, ended=ending == "half-close")

    asyncio.run(main())


def check_calls(entries: list[rpb.MuxResponse], starts: dict[int, int], ended: bool) -> None:
    """Splits each call id's entries at its ends and checks every segment."""
    segments: dict[int, list[list[rpb.MuxResponse]]] = {i: [[]] for i in starts}
    for r in entries:
        segments[r.call][-1].append(r)
        if r.code or r.last:
            segments[r.call].append([])
    for i, segs in segments.items():
        closed, tail = segs[:-1], segs[-1]
        assert len(closed) <= starts[i], f"call {i}: {len(closed)} ends for {starts[i]} starts"
        if ended:  # a start on an open call ends it: one end for the two
            assert not tail and (len(closed) > 0) == (starts[i] > 0), f"call {i} left open"
        for seg in closed + ([tail] if tail else []):
            msgs = [pb.GenerateResponse.FromString(r.message) for r in seg if not r.code]
            assert all(not r.code for r in seg[:-1]), "an error before the call's last entry"
            if msgs:
                assert not msgs[0].token_ids and not msgs[0].finished, "the first message is the admission"
                assert len({m.request_id for m in msgs}) == 1
                assert all(not m.finished for m in msgs[:-1])
                if seg[-1].last:
                    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
