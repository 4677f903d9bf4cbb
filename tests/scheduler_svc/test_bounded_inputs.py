"""Bounded inputs (issue #13): the public server, as SchedulerApp builds it, over real gRPC
with a fake executor. A prompt that cannot fit is refused before it is tokenized, a long
tokenization never blocks the event loop, messages larger than any valid request are
refused before they are parsed, client_request_id is capped and echoed once, bytes that are
not a valid message get INVALID_ARGUMENT with one log line, and the load gauges do not
outlive the engine they describe.

No test depends on timing: they assert on order, counts and state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkserve.client import build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc import app as app_module
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import MAX_NON_PROMPT_BYTES

MAX_MODEL_LEN = 100
FAILSAFE_S = 15.0  # only reached when the behaviour under test is broken (then the test fails)


class SpyTokenizer(Tokenizer):
    """Counts every call that encodes text."""

    encoded: list[int] = []

    def encode(self, text):
        SpyTokenizer.encoded.append(len(text))
        return super().encode(text)

    def apply_chat_template(self, messages):
        SpyTokenizer.encoded.append(-1)
        return super().apply_chat_template(messages)

    def encode_rendered_chat(self, text):
        SpyTokenizer.encoded.append(len(text))
        return super().encode_rendered_chat(text)


@contextlib.asynccontextmanager
async def running_app(fakes, tokenizer_dir, monkeypatch, tokenizer_cls=SpyTokenizer):
    """A started SchedulerApp on a free port, its fake executor client, and a channel to it."""
    client = fakes.FakeExecutorClient(
        fakes.fake_handshake(tokenizer_dir, vocab_size=257, max_position_embeddings=MAX_MODEL_LEN, block_size=4),
        fakes.FakeExecutor(64, 4),
    )
    monkeypatch.setattr(app_module, "ExecutorClient", lambda *args, **kwargs: client)
    monkeypatch.setattr(app_module, "Tokenizer", tokenizer_cls)
    app = app_module.SchedulerApp(
        SchedulerConfig(host="127.0.0.1", port=0, metrics_port=0, http_port=0, admin_port=0, startup_timeout_s=10)
    )
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            yield app, client, channel
    finally:
        await app.stop(grace=0)


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await call.read() is not grpc.aio.EOF:
            pass
    return err.value


# ---- 9: a prompt that cannot fit is refused before it is tokenized --------------------------


def test_text_over_the_byte_bound_is_refused_without_encoding(fakes, byte_tokenizer_dir, monkeypatch):
    # The byte tokenizer's longest token is "<eos>", 5 bytes: a valid prompt (<= 99 tokens)
    # has at most 99 * 5 = 495 bytes.
    async def main():
        SpyTokenizer.encoded = []
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch) as (app, client, channel):
            stub = pb_grpc.GenerationStub(channel)
            for request, field in [
                (build_request("x" * 496), "prompt.text"),
                (build_request("é" * 248), "prompt.text"),  # 248 characters, 496 bytes
                (
                    build_request([{"role": "user", "content": "y" * 300}, {"role": "user", "content": "z" * 300}]),
                    "prompt.chat",
                ),
            ]:
                err = await refusal(stub.Generate(request))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                assert field in err.details() and "495" in err.details(), err.details()
            assert SpyTokenizer.encoded == []  # none of them was encoded
            assert not app.ready.engine.scheduler.requests

            # At the bound it is encoded (the check refuses nothing that might fit) and then
            # refused by its token count; a short prompt runs.
            err = await refusal(stub.Generate(build_request("x" * 495)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in err.details()
            assert SpyTokenizer.encoded == [495]
            out = [m async for m in stub.Generate(build_request("hello", max_tokens=3, ignore_eos=True))]
            assert out[-1].finished and out[-1].usage.prompt_tokens == 5

    asyncio.run(main())


def test_a_long_tokenization_does_not_block_the_event_loop(fakes, byte_tokenizer_dir, monkeypatch):
    """While one prompt is being encoded, health checks, GetInfo and token-id requests are
    answered; the encode is held on a threading.Event the test releases only afterwards."""
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    class BlockingTokenizer(Tokenizer):
        def encode(self, text):
            if text.startswith("slow"):
                entered.set()
                released = release.wait(FAILSAFE_S)
                order.append("encode returned" if released else "encode gave up")
            return super().encode(text)

    async def main():
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch, BlockingTokenizer) as (app, _, channel):
            stub = pb_grpc.GenerationStub(channel)
            slow = stub.Generate(build_request("slow " * 19, max_tokens=2, ignore_eos=True))
            first = asyncio.ensure_future(slow.read())
            assert await asyncio.to_thread(entered.wait, FAILSAFE_S)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="chunkserve.v1.Generation")
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            order.append("health")
            assert (await stub.GetInfo(pb.GetInfoRequest())).max_model_len == MAX_MODEL_LEN
            order.append("info")
            other = [m async for m in stub.Generate(build_request([1, 2, 3], max_tokens=2, ignore_eos=True))]
            assert other[-1].finished
            order.append("other request finished")
            release.set()
            rest = [await first]
            while not rest[-1].finished:
                rest.append(await slow.read())
            assert rest[-1].finished and rest[-1].usage.prompt_tokens == 95
            assert order == ["health", "info", "other request finished", "encode returned"]

    try:
        asyncio.run(main())
    finally:
        release.set()


def test_token_bound_is_sound_and_refuses_only_unbounded_tokenizers():
    """For every pipeline the bound covers, no text has fewer tokens than
    ceil(bytes / max_bytes_per_token); pipelines where one token can cover unbounded text get
    no bound (None) rather than a wrong one."""
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HF

    from scheduler_svc.tokenizer import max_bytes_per_token

    corpus = ["aaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbbbb " * 50, "AAAAAAAAAAAA hello world " * 50, "日本語のテキスト " * 50]
    samples = [
        "a" * 997,
        "A" * 500,
        "𝐀" * 300,
        "\u212a" * 300,
        "日本語のテキスト" * 40,
        "hello   world\n" * 30,
        "e\u0301" * 200,
        "\u1100\u1161\u11a8" * 100,
        "aaaaaaaaaaaaaaaaaaaaaaaa" * 20 + "¿?" * 10,
    ]

    def build(normalizer=None, pre=None, model="bpe"):
        if model == "bpe":
            tok = HF(models.BPE(unk_token="<unk>"))
            trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"])
        else:
            tok = HF(models.Unigram())
            trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>"], unk_token="<unk>")
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre
        tok.train_from_iterator(corpus, trainer)
        return tok

    # "𝐀" (4 bytes) normalizes to "a" under NFKC + lowercase, so that tokenizer needs the
    # normalizer's shrink factor: without it "𝐀" * 300 would break the inequality below.
    sound = {
        "byte-level": build(pre=pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "nfkc + lowercase + byte-level": build(
            normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ),
        "metaspace": build(pre=pre_tokenizers.Metaspace()),
    }
    for name, tok in sound.items():
        tok.model.fuse_unk = False
        per_token, note = max_bytes_per_token(json.loads(tok.to_str()), tok.get_vocab(with_added_tokens=True))
        assert per_token is not None, (name, note)
        for text in samples:
            assert len(tok.encode(text).ids) >= math.ceil(len(text.encode()) / per_token), (name, text[:20])

    unbounded = {
        "whitespace split": build(pre=pre_tokenizers.WhitespaceSplit()),
        "strip": build(normalizers.Strip(), pre_tokenizers.ByteLevel()),
        "fused unknowns": build(pre=pre_tokenizers.ByteLevel()),
        "unigram without byte fallback": build(pre=pre_tokenizers.Metaspace(), model="unigram"),
    }
    unbounded["fused unknowns"].model.fuse_unk = True
    lstrip = build(pre=pre_tokenizers.ByteLevel())
    lstrip.model.fuse_unk = False
    lstrip.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    unbounded["lstrip added token"] = lstrip
    for name, tok in unbounded.items():
        assert max_bytes_per_token(json.loads(tok.to_str()), tok.get_vocab(with_added_tokens=True))[0] is None, name


def test_token_bound_holds_for_the_default_models_tokenizer(tiny_model_path):
    """SmolLM2's tokenizer (byte-level BPE): texts made of its longest tokens, repeated, are
    the densest there are; none has fewer tokens than the bound allows."""
    tok = Tokenizer(tiny_model_path)
    per_token = tok.max_bytes_per_token
    assert per_token is not None and per_token < 100, tok.byte_bound_note
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=len)[-200:]
    for token_id in (vocab[t] for t in longest):
        piece = tok._tok.decode([token_id], skip_special_tokens=False)
        for text in (piece * 50, (piece + " ") * 50, piece[:-1] * 50):
            assert len(tok.encode(text)) >= math.ceil(len(text.encode()) / per_token), repr(piece)


# ---- 9: message size -------------------------------------------------------------------------


def with_salt(size: int) -> pb.GenerateRequest:
    """A valid token-id request padded with cache_salt to exactly `size` serialized bytes."""
    request = build_request([1, 2, 3], max_tokens=2)
    for n in range(size - request.ByteSize(), 0, -1):
        request.cache_salt = "s" * n
        if request.ByteSize() == size:
            return request
    raise AssertionError(size)


def test_a_request_larger_than_any_valid_one_is_refused_before_it_runs(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        SpyTokenizer.encoded = []
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, channel):
            stub = pb_grpc.GenerationStub(channel)
            largest = 99 * 5 + MAX_NON_PROMPT_BYTES  # the text/ids bound plus room for the other fields
            for request in (with_salt(largest + 1), build_request("x" * (1 << 20))):
                err = await refusal(stub.Generate(request))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                assert f"has {request.ByteSize()} bytes" in err.details() and str(largest) in err.details()
            # Over the transport limit gRPC itself refuses the message.
            err = await refusal(stub.Generate(with_salt(17 << 20)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert SpyTokenizer.encoded == [] and not app.ready.engine.executor.fake.plans

            out = [m async for m in stub.Generate(with_salt(largest))]  # the largest allowed: served
            assert out[-1].finished
            assert app.ready.limits.max_request_bytes == largest

    asyncio.run(main())


# ---- 10: client_request_id -------------------------------------------------------------------


def test_client_request_id_is_capped_and_echoed_once(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, channel):
            stub = pb_grpc.GenerationStub(channel)
            for label in ("x" * 257, "é" * 129):  # 257 and 258 bytes
                request = build_request([1, 2, 3], max_tokens=4)
                request.client_request_id = label
                err = await refusal(stub.Generate(request))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_request_id" in err.details()
            request = build_request([1, 2, 3], max_tokens=4)
            request.client_request_id = "x" * (1 << 20)
            err = await refusal(stub.Generate(request))  # over the largest valid request
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not app.ready.engine.executor.fake.plans

            for name in ("tenant", "stop_token_ids"):  # kept per tenant / checked per token: capped too
                request = build_request([1, 2, 3], max_tokens=4)
                if name == "tenant":
                    request.tenant = "t" * 257
                else:
                    request.sampling.stop_token_ids.extend([5] * 65)
                err = await refusal(stub.Generate(request))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.details(), err.details()
            request = build_request([1, 2, 3], max_tokens=16, ignore_eos=True)
            request.sampling.stop_token_ids.extend([250] * 64)
            request.tenant = "t" * 256
            request.client_request_id = "é" * 128  # 256 bytes: the most allowed
            messages = [m async for m in stub.Generate(request)]
            assert len(messages) > 1 and messages[-1].finished
            assert [m.client_request_id for m in messages] == ["é" * 128] + [""] * (len(messages) - 1)

    asyncio.run(main())


# ---- 11: bytes that are not a valid message ---------------------------------------------------


def test_invalid_utf8_is_invalid_argument_with_one_warning(fakes, byte_tokenizer_dir, monkeypatch, caplog):
    async def main():
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, channel):
            raw = dict(request_serializer=lambda b: b)
            generate = channel.unary_stream(
                "/chunkserve.v1.Generation/Generate", **raw, response_deserializer=pb.GenerateResponse.FromString
            )
            abort = channel.unary_unary(
                "/chunkserve.v1.Generation/Abort", **raw, response_deserializer=pb.AbortResponse.FromString
            )
            caplog.clear()
            err = await refusal(generate(b"\x0a\x02\xff\xfe"))  # text = 0xff 0xfe
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details(), err.details()
            records = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert [(r.levelno, r.exc_info) for r in records] == [(logging.WARNING, None)], caplog.text
            assert "\n" not in records[0].getMessage()
            err = await refusal(generate(b"\x0a\x10abc"))  # truncated: not protobuf at all
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as aborted:
                await abort(b"\x0a\x01\xc3")  # request_id = a cut 2-byte character
            assert aborted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
            # The server is fine afterwards.
            out = [m async for m in pb_grpc.GenerationStub(channel).Generate(build_request("ok", max_tokens=2))]
            assert out[-1].finished

    with caplog.at_level(logging.INFO):
        asyncio.run(main())


# ---- 12: gauges after the executor is replaced ------------------------------------------------


def test_load_gauges_are_reset_when_the_engine_is_replaced(fakes, byte_tokenizer_dir, monkeypatch):
    def gauges(app) -> dict[str, float]:
        names = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")
        return {n: app.metrics.registry.get_sample_value(f"chunkserve_{n}", {"model_name": "fake"}) for n in names}

    async def main():
        async with running_app(fakes, byte_tokenizer_dir, monkeypatch) as (app, client, channel):
            client.hold_after = 1  # the second step waits, then fails as a dead executor does
            call = pb_grpc.GenerationStub(channel).Generate(
                build_request([1, 2, 3, 4, 5], max_tokens=50, ignore_eos=True)
            )
            assert not (await call.read()).token_ids  # the first message, on admission
            assert (await call.read()).token_ids
            before = gauges(app)
            assert before["num_requests_running"] == 1 and before["kv_cache_usage_perc"] > 0
            old = app.ready
            client.die.set()
            err = await refusal(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            for _ in range(int(FAILSAFE_S * 100)):  # the supervisor handshakes again and rebuilds
                if app.ready is not old and not app.ready.engine.is_dead:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the engine was never replaced")
            assert client.handshakes >= 2
            assert gauges(app) == dict.fromkeys(before, 0.0)  # before any new request

    asyncio.run(main())
