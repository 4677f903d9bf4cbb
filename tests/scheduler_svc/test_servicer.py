"""The public servicer in-process over real gRPC, with the fake executor: every bad input
gets INVALID_ARGUMENT and queues nothing; cancellation in every request state frees all."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from chunkserve.client import build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.admin import describe
from scheduler_svc.engine import Engine
from scheduler_svc.request import RequestStatus
from scheduler_svc.servicer import GenerationServicer, add_generation_servicer
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import Limits, sampling_params, tokenize_prompt

BAD = {
    "empty text": (pb.GenerateRequest(text=""), "prompt"),
    "no prompt": (pb.GenerateRequest(), "prompt"),
    "prompt too long": (build_request("x" * 200), "max_model_len"),
    "prompt + max_tokens too long": (build_request("x" * 50, max_tokens=100), "max_tokens"),
    "max_tokens 0": (build_request("hi", max_tokens=0), "max_tokens"),
    "temperature < 0": (build_request("hi", temperature=-0.5), "temperature"),
    "temperature nan": (build_request("hi", temperature=float("nan")), "temperature"),
    "top_p 0": (build_request("hi", top_p=0.0), "top_p"),
    "top_p > 1": (build_request("hi", top_p=1.5), "top_p"),
    "top_k < -1": (build_request("hi", top_k=-2), "top_k"),
    "min_p > 1": (build_request("hi", min_p=1.5), "min_p"),
    "presence_penalty > 2": (build_request("hi", presence_penalty=2.5), "presence_penalty"),
    "frequency_penalty nan": (build_request("hi", frequency_penalty=float("nan")), "frequency_penalty"),
    "repetition_penalty 0": (build_request("hi", repetition_penalty=0.0), "repetition_penalty"),
    "logit_bias id outside vocab": (build_request("hi", logit_bias={400: 1.0}), "logit_bias"),
    "logit_bias > 100": (build_request("hi", logit_bias={5: 101.0}), "logit_bias"),
    "allowed id outside vocab": (build_request("hi", allowed_token_ids=[5, 400]), "allowed_token_ids"),
    "too many prompt logprobs": (build_request("hi", prompt_logprobs=21), "prompt_logprobs"),
    "blank bad word": (build_request("hi", bad_words=["ok", "  "]), "bad_words"),
    "bad word too long": (build_request("hi", bad_words=["x" * 101]), "bad_words"),
    "too many bad words": (build_request("hi", bad_words=[f"w{i}" for i in range(65)]), "bad_words"),
    "token id outside vocab": (build_request([1, 2, 400]), "token_ids"),
    "stop id outside vocab": (build_request("hi", stop_token_ids=[999]), "stop_token_ids"),
    "empty stop string": (build_request("hi", stop=[""]), "stop"),
    "too many stop strings": (build_request("hi", stop=[f"s{i}" for i in range(17)]), "stop"),
    "too many logprobs": (build_request("hi", logprobs=21), "logprobs"),
    "min_tokens > max_tokens": (build_request("hi", max_tokens=2, min_tokens=3), "min_tokens"),
    "empty chat": (pb.GenerateRequest(chat=pb.ChatMessages()), "chat"),
    "text over the byte bound": (build_request("x" * 496), "prompt.text"),
    "client_request_id too long": (pb.GenerateRequest(text="hi", client_request_id="x" * 257), "client_request_id"),
}


async def serve(engine: Engine, limits: Limits):
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    info = pb.GetInfoResponse(model_name="fake")
    add_generation_servicer(GenerationServicer(lambda: (engine, limits, info)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def make(fakes, tokenizer_dir, **cfg):
    sched = fakes.make_scheduler(num_blocks=cfg.pop("num_blocks", 64), block_size=4, max_model_len=100, **cfg)
    fake = fakes.FakeExecutor(sched.pool.num_blocks, 4, num_host_blocks=64)
    tokenizer = Tokenizer(tokenizer_dir)
    engine = Engine(sched, fake, tokenizer, frozenset({fakes.EOS}), 100, 5.0)
    return engine, Limits.for_tokenizer(100, 257, tokenizer.max_bytes_per_token)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_anything_is_queued(fakes, byte_tokenizer_dir, case):
    request, field = BAD[case]

    async def main():
        engine, limits = make(fakes, byte_tokenizer_dir)
        server, port = await serve(engine, limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in pb_grpc.GenerationStub(channel).Generate(request):
                        pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
            assert not engine.scheduler.requests and not engine.scheduler.waiting
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "swapped"])
def test_cancel_in_every_state_frees_every_block(fakes, byte_tokenizer_dir, state):
    async def main():
        cfg = dict(max_num_batched_tokens=8)
        if state == "swapped":
            cfg.update(num_blocks=24, preemption_mode="swap", num_host_blocks=64)
        engine, limits = make(fakes, byte_tokenizer_dir, **cfg)
        server, port = await serve(engine, limits)
        sched = engine.scheduler
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                others = []
                if state == "swapped":  # an older request that will grow and push ours out
                    engine.start()
                    others.append(stub.Generate(build_request(list(range(30)), max_tokens=60, ignore_eos=True)))
                    while not (await others[0].read()).token_ids:  # it is running before ours arrives
                        pass
                call = stub.Generate(build_request(list(range(40, 80)), max_tokens=50, ignore_eos=True))
                if state not in ("waiting", "swapped"):
                    engine.start()
                for _ in range(5000):
                    await asyncio.sleep(0.001)
                    req = next((r for r in sched.requests.values() if r.num_prompt_tokens == 40), None)
                    if req is None:
                        continue
                    if (
                        state == "waiting"
                        or (state == "prefilling" and 0 < req.num_computed_tokens < 40)
                        or (state == "decoding" and req.num_output_tokens >= 2)
                        or (state == "swapped" and req.status is RequestStatus.SWAPPED)
                    ):
                        break
                else:
                    raise AssertionError(f"never reached {state}")
                call.cancel()
                for other in others:
                    while (await other.read()) is not grpc.aio.EOF:
                        pass
                for _ in range(500):  # the servicer's finally aborts it within a step
                    if not sched.requests:
                        break
                    await asyncio.sleep(0.01)
            assert not sched.requests and sched.pool.num_free_blocks == sched.pool.num_blocks
            if sched.host_pool is not None:
                assert sched.host_pool.num_free_blocks == sched.host_pool.num_blocks
        finally:
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


def test_snapshot_counts_what_requests_hold_and_get_info_reports_it(fakes, byte_tokenizer_dir):
    """Step by step through swap preemption, Scheduler.snapshot() agrees with what the requests
    themselves hold; GetInfo over gRPC and the Admin service's answer report those numbers."""

    async def main():
        engine, limits = make(
            fakes,
            byte_tokenizer_dir,
            num_blocks=24,
            max_num_batched_tokens=8,
            preemption_mode="swap",
            num_host_blocks=64,
        )  # the engine never steps on its own
        sched, fake = engine.scheduler, engine.executor
        for i in range(6):
            sched.add_request(fakes.make_request(i, prompt_len=12, max_tokens=40))
        server, port = await serve(engine, limits)
        asked = 0
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for step in range(1000):
                    s = sched.snapshot()
                    live = list(sched.requests.values())
                    statuses = [
                        sum(r.status is st for r in live)
                        for st in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED)
                    ]
                    assert [s.num_running, s.num_waiting, s.num_swapped] == statuses, f"step {step}"
                    held = len({b for r in live for b in r.block_ids})
                    assert (s.num_free_device_blocks, s.kv_cache_usage) == (24 - held, pytest.approx(held / 24))
                    assert (s.next_step, s.policy, s.max_model_len, s.config) == (step, "fcfs", 100, sched.config)
                    if all(statuses) and asked < 3:  # running, waiting and swapped requests at once
                        asked += 1
                        info = await pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest())
                        assert (
                            info.num_requests_running,
                            info.num_requests_waiting,
                            info.num_free_device_blocks,
                            info.max_num_batched_tokens,
                            info.model_name,
                        ) == (s.num_running, s.num_waiting + s.num_swapped, s.num_free_device_blocks, 8, "fake")
                        config = describe(s)
                        assert (
                            config.num_running,
                            config.num_waiting,
                            config.effective_step,
                            config.policy,
                            config.max_num_batched_tokens,
                        ) == (s.num_running, info.num_requests_waiting, step, "fcfs", 8)
                    if not sched.has_work():
                        break
                    plan = sched.schedule()
                    sched.update(plan, fake.execute(plan))
            assert asked == 3 and not sched.requests and sched.snapshot().num_free_device_blocks == 24
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_first_message_comes_on_admission_and_its_id_aborts_a_queued_or_prefilling_request(fakes, byte_tokenizer_dir):
    """Generate's first message carries the id before any step has run: a request still
    queued behind a step the executor never answers, or prefilling in that step, is aborted
    by it, its stream ends ABORTED and every block comes back."""

    class HeldExecutor(fakes.FakeExecutor):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.gate = asyncio.Event()

        async def step(self, plan, timeout):
            await self.gate.wait()  # the step does not answer until the test says so
            return self.execute(plan)

    async def rest(call) -> list[pb.GenerateResponse]:
        out = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            out.append(msg)
        return out

    async def main():
        sched = fakes.make_scheduler(num_blocks=64, block_size=4, max_model_len=100, max_num_batched_tokens=8)
        held = HeldExecutor(sched.pool.num_blocks, 4)
        engine = Engine(sched, held, Tokenizer(byte_tokenizer_dir), frozenset({fakes.EOS}), 100, 5.0)
        limits = Limits.for_tokenizer(100, 257, engine.tokenizer.max_bytes_per_token)
        server, port = await serve(engine, limits)
        engine.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                prefilling = build_request(list(range(40)), max_tokens=5, ignore_eos=True)
                prefilling.client_request_id = "a"
                call_a = stub.Generate(prefilling, timeout=30)  # fails, not hangs, without it
                first_a = await call_a.read()
                assert (first_a.client_request_id, first_a.prompt_tokens) == ("a", 40)
                assert first_a.request_id and not first_a.token_ids and not first_a.finished
                assert not first_a.HasField("usage")  # usage (cached_tokens with it) comes last
                for _ in range(5000):  # its first chunk is in the step the executor holds
                    if sched.pool.num_free_blocks < sched.pool.num_blocks:
                        break
                    await asyncio.sleep(0.001)
                else:
                    raise AssertionError("the first request was never scheduled")

                queued = build_request([1, 2, 3], max_tokens=5, ignore_eos=True)
                queued.client_request_id = "b"
                call_b = stub.Generate(queued, timeout=30)
                first_b = await call_b.read()
                assert (first_b.client_request_id, first_b.prompt_tokens) == ("b", 3)
                assert sched.requests[first_b.request_id].status is RequestStatus.WAITING
                assert (await stub.Abort(pb.AbortRequest(request_id=first_b.request_id))).found
                out_b = await rest(call_b)
                assert [m.finished for m in out_b] == [True] and not out_b[0].token_ids
                assert out_b[0].finish_reason == pb.FINISH_REASON_ABORTED and out_b[0].client_request_id == ""

                assert sched.requests[first_a.request_id].num_computed_tokens < 40  # still prefilling
                assert (await stub.Abort(pb.AbortRequest(request_id=first_a.request_id))).found
                out_a = await rest(call_a)
                assert out_a[-1].finished and out_a[-1].finish_reason == pb.FINISH_REASON_ABORTED
                assert not sched.requests and sched.pool.num_free_blocks == sched.pool.num_blocks
                assert not (await stub.Abort(pb.AbortRequest(request_id=first_a.request_id))).found
                held.gate.set()  # the held step ends; the engine keeps serving
                done = [m async for m in stub.Generate(build_request([5, 6], max_tokens=3, ignore_eos=True))]
                assert sum(len(m.token_ids) for m in done) == 3 and done[-1].usage.prompt_tokens == 2
            assert not sched.requests and sched.pool.num_free_blocks == sched.pool.num_blocks
        finally:
            held.gate.set()
            await engine.stop()
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize(
    "request_, expected",
    [
        (build_request("hello"), 16),  # as vLLM's completions
        (build_request([1, 2, 3]), 16),
        (build_request("x" * 90), 10),  # never more than fits
        (build_request([{"role": "user", "content": "hi"}]), 100 - len("<user>hi<assistant>")),  # as chat
        (build_request("hello", max_tokens=50), 50),
        (build_request([{"role": "user", "content": "hi"}], max_tokens=3), 3),
    ],
)
def test_unset_max_tokens_is_16_for_text_and_token_ids_and_the_rest_of_the_context_for_chat(
    byte_tokenizer_dir, request_, expected
):
    tokenizer = Tokenizer(byte_tokenizer_dir)
    limits = Limits.for_tokenizer(100, 257, tokenizer.max_bytes_per_token)
    prompt = tokenize_prompt(request_, tokenizer, limits)
    assert sampling_params(request_, len(prompt), limits).max_tokens == expected
