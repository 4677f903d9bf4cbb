"""The OpenAI-compatible HTTP API (issue #19): the official `openai` SDK and raw HTTP against
SchedulerApp with a fake executor (fast, in-process, the real uvicorn on a free port), and
against a real two-process server (slow). Both fronts share one engine: greedy output over
HTTP equals gRPC's, errors map to OpenAI status codes and bodies, and a closed stream frees
its request.

No test depends on timing: they assert on order, counts and state; deadlines only bound
failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import grpc
import httpx
import openai
import pytest

from chunkserve.client import Completion, build_request
from chunkserve.launch import free_port
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc import app as app_module
from scheduler_svc.config import SchedulerConfig

MAX_MODEL_LEN = 100
FAILSAFE_S = 15.0  # only reached when the behaviour under test is broken


def fake_client(fakes, tokenizer_dir):
    """The executor: a 100-token context, 64 blocks x 4 tokens; the handshake waits for the
    client's `ready`, steps after its `hold_after` for `release`."""
    return fakes.FakeExecutorClient(
        fakes.fake_handshake(tokenizer_dir, vocab_size=257, max_position_embeddings=MAX_MODEL_LEN, block_size=4),
        fakes.FakeExecutor(64, 4),
    )


@contextlib.asynccontextmanager
async def running(fakes, tokenizer_dir, monkeypatch, wait_ready=True, **cfg):
    """A SchedulerApp (gRPC + HTTP) on free ports with a fake executor client."""
    client = fake_client(fakes, tokenizer_dir)
    monkeypatch.setattr(app_module, "ExecutorClient", lambda *args, **kwargs: client)
    config = SchedulerConfig(
        host="127.0.0.1", port=0, metrics_port=0, admin_port=0, http_host="127.0.0.1", http_port=free_port(), **cfg
    )
    app = app_module.SchedulerApp(config)
    if not wait_ready:
        client.ready.clear()
    starting = asyncio.ensure_future(app.start())
    if wait_ready:
        await starting
    else:
        while app.http_port == 0 and not starting.done():  # listening happens before the handshake
            await asyncio.sleep(0.01)
    try:
        yield app, client, f"http://127.0.0.1:{app.http_port}"
    finally:
        client.ready.set()
        client.release.set()
        await starting
        await app.stop(grace=0)


def sdk(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=FAILSAFE_S)


async def grpc_text(app, request) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        return "".join([m.text async for m in pb_grpc.GenerationStub(channel).Generate(request)])


def assert_idle(app) -> None:
    s = app.ready.engine.scheduler.snapshot()
    assert (s.num_running, s.num_waiting, s.num_swapped) == (0, 0, 0)
    assert s.num_free_device_blocks == app.ready.engine.scheduler.pool.num_blocks


def test_completions_and_chat_with_the_openai_sdk_equal_grpc(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            client = sdk(base)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["fake"]
            expected = await grpc_text(app, build_request("hello", max_tokens=6, temperature=0.0))
            out = await client.completions.create(model="fake", prompt="hello", max_tokens=6, temperature=0)
            assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
            assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 6, 11)
            ids = await client.completions.create(model="fake", prompt=list(b"hello"), max_tokens=6, temperature=0)
            assert ids.choices[0].text == expected
            default = await client.completions.create(model="fake", prompt="hello", temperature=0)
            assert default.usage.completion_tokens == 16  # vLLM's completions default
            chunks = [
                c
                async for c in await client.completions.create(
                    prompt="hello", model="fake", max_tokens=6, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )
            ]  # fmt: skip
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
            assert chunks[-2].choices[0].finish_reason == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

            messages = [{"role": "user", "content": "hi"}]
            expected = await grpc_text(app, build_request(messages, max_tokens=5, temperature=0.0))
            chat = await client.chat.completions.create(
                model="fake", messages=messages, max_completion_tokens=5, temperature=0
            )
            assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
            assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
            stream = await client.chat.completions.create(
                model="fake", messages=messages, max_tokens=5, temperature=0, stream=True
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
            assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
            stopped = await client.chat.completions.create(
                model="fake", messages=messages, max_tokens=5, temperature=0, stop=[expected[2]]
            )
            assert stopped.choices[0].finish_reason == "stop"
            assert stopped.choices[0].message.content == expected[: expected.index(expected[2])]
            lp = await client.chat.completions.create(
                model="fake", messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
            )
            assert [t.token for t in lp.choices[0].logprobs.content] == list(expected[:3])
            assert_idle(app)

    asyncio.run(main())


def test_raw_sse_stream_ends_with_done(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            body = {"prompt": "hello", "max_tokens": 4, "stream": True}
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                async with http.stream("POST", base + "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    lines = [line async for line in response.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert all(line.startswith("data: ") for line in lines)
            events = [json.loads(line[6:]) for line in lines[:-1]]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) for e in events) == 4

    asyncio.run(main())


def test_return_token_ids_names_every_token_once(fakes, byte_tokenizer_dir, monkeypatch):
    """vLLM's `return_token_ids`: what `chunkserve bench --backend openai` counts tokens by."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            body = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                whole = (await http.post(base + "/v1/completions", json={**body, "return_token_ids": True})).json()
                plain = (await http.post(base + "/v1/completions", json=body)).json()
                streamed = {**body, "return_token_ids": True, "stream": True}
                async with http.stream("POST", base + "/v1/completions", json=streamed) as response:
                    lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            ids = whole["choices"][0]["token_ids"]
            assert len(ids) == 5 == whole["usage"]["completion_tokens"]
            assert "token_ids" not in plain["choices"][0] and plain["choices"][0]["text"] == whole["choices"][0]["text"]
            chunks = [json.loads(line[6:])["choices"][0]["token_ids"] for line in lines]
            assert [t for chunk in chunks for t in chunk] == ids  # each token in exactly one event
            assert_idle(app)

    asyncio.run(main())


BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "hi", "return_token_ids": "yes"}, 400, "return_token_ids"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 500}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": [5]}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "bad_words": "x"}, 400, "bad_words"),
    ("completions", {"prompt": "hi", "bad_words": [1]}, 400, "bad_words"),
    ("completions", {"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [999999]}, 400, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "allowed_token_ids": "5"}, 400, "allowed_token_ids"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": "x"},
        400,
        "frequency_penalty",
    ),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 200}, 400, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400, "min_p"),
]


def test_bad_requests_get_openai_errors_naming_the_field(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                for endpoint, body, status, param in BAD:
                    response = await http.post(f"{base}/v1/{endpoint}", json=body)
                    assert response.status_code == status, (body, response.text)
                    error = response.json()["error"]
                    assert error["param"] == param, (body, error)
                    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
                    assert not app.ready.engine.scheduler.requests
                response = await http.post(f"{base}/v1/completions", content=b"{not json")
                assert response.status_code == 400
            with pytest.raises(openai.BadRequestError) as err:
                await sdk(base).completions.create(model="fake", prompt="hi", n=0)
            assert err.value.body["param"] == "n"

    asyncio.run(main())


def test_api_key_is_required_on_v1_but_not_on_health(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, api_key="s3cret") as (_, _, base):
            with pytest.raises(openai.AuthenticationError):
                await sdk(base, "wrong").completions.create(model="fake", prompt="hi", max_tokens=2)
            out = await sdk(base, "s3cret").completions.create(model="fake", prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                assert (await http.get(base + "/v1/models")).status_code == 401
                assert (await http.get(base + "/health")).status_code == 200
                assert (await http.get(base + "/version")).json()["version"]

    asyncio.run(main())


def test_not_ready_is_503_then_serves(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, wait_ready=False) as (app, client, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                assert (await http.get(base + "/health")).status_code == 503
                response = await http.post(base + "/v1/completions", json={"prompt": "hi"})
                assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"
                client.ready.set()
                for _ in range(int(FAILSAFE_S * 100)):
                    if app.ready is not None:
                        break
                    await asyncio.sleep(0.01)
                assert (await http.get(base + "/health")).status_code == 200

    asyncio.run(main())


def test_queue_full_is_429(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, max_waiting_requests=1) as (app, client, base):
            client.hold_after = 0  # the first step waits: its request runs, later ones wait
            http = httpx.AsyncClient(timeout=FAILSAFE_S)
            body = {"prompt": "hi", "max_tokens": 2}
            first = asyncio.ensure_future(http.post(base + "/v1/completions", json=body))
            await asyncio.wait_for(client.held.wait(), FAILSAFE_S)
            second = asyncio.ensure_future(http.post(base + "/v1/completions", json=body))
            for _ in range(int(FAILSAFE_S * 100)):
                if app.ready.engine.scheduler.waiting:
                    break
                await asyncio.sleep(0.01)
            third = await http.post(base + "/v1/completions", json=body)
            assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
            client.release.set()
            assert [(await r).status_code for r in (first, second)] == [200, 200]
            await http.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_closing_the_connection_aborts_the_request(fakes, byte_tokenizer_dir, monkeypatch, stream, n):
    """...every one of its n choices' requests (OpenAI's n)."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, client, base):
            client.hold_after = 3  # tokens flow, then the request stays running
            body = {"prompt": "hi", "max_tokens": 50, "stream": stream, "n": n}
            http = httpx.AsyncClient(timeout=FAILSAFE_S)
            if stream:
                async with http.stream("POST", base + "/v1/completions", json=body) as response:
                    await asyncio.wait_for(client.held.wait(), FAILSAFE_S)  # running, tokens sent
                    assert len(app.ready.engine.scheduler.requests) == n
                    lines = response.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    await lines.aclose()  # leaving the block closes the stream
            else:
                post = asyncio.ensure_future(http.post(base + "/v1/completions", json=body))
                await asyncio.wait_for(client.held.wait(), FAILSAFE_S)
                assert len(app.ready.engine.scheduler.requests) == n
                post.cancel()
            await http.aclose()  # the connection is gone
            engine = app.ready.engine
            for _ in range(int(FAILSAFE_S * 100)):
                if not engine.scheduler.requests:
                    break
                await asyncio.sleep(0.01)
            assert not engine.scheduler.requests
            client.release.set()  # the held step completes and the metrics see its state
            label = {"model_name": "fake"}
            for _ in range(int(FAILSAFE_S * 100)):
                if app.metrics.registry.get_sample_value("chunkserve_num_requests_running", label) == 0:
                    break
                await asyncio.sleep(0.01)
            assert app.metrics.registry.get_sample_value("chunkserve_num_requests_running", label) == 0
            assert_idle(app)

    asyncio.run(main())


def test_a_taken_http_port_stops_start_up_with_one_message(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        client = fake_client(fakes, byte_tokenizer_dir)
        monkeypatch.setattr(app_module, "ExecutorClient", lambda *args, **kwargs: client)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            config = SchedulerConfig(
                host="127.0.0.1", port=0, metrics_port=0, admin_port=0, http_host="127.0.0.1", http_port=port
            )
            app = app_module.SchedulerApp(config)
            with pytest.raises(ValueError, match=f"--http-port {port}: cannot listen"):
                await app.start()
            await app.stop(grace=0)

    asyncio.run(main())


def test_served_model_name_is_the_api_model_the_getinfo_name_and_the_metrics_label(
    fakes, byte_tokenizer_dir, monkeypatch
):
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, served_model_name="team/chat-v2") as (app, _, base):
            client = sdk(base)
            assert [m.id for m in (await client.models.list()).data] == ["team/chat-v2"]
            out = await client.completions.create(model="team/chat-v2", prompt="hello", max_tokens=4, temperature=0)
            assert out.model == "team/chat-v2" and out.choices[0].finish_reason == "length"
            with pytest.raises(openai.NotFoundError):  # the executor's name is no longer the API's
                await client.completions.create(model="fake", prompt="hello", max_tokens=4)
            text = out.choices[0].text
            stopped = await client.completions.create(
                model="team/chat-v2", prompt="hello", max_tokens=4, temperature=0, stop=[text[1]]
            )
            assert stopped.choices[0].finish_reason == "stop"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                info = await pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest())
            assert info.model_name == "team/chat-v2"

            def sample(name, model="team/chat-v2", **labels):
                return app.metrics.registry.get_sample_value(f"chunkserve_{name}", {"model_name": model, **labels})

            assert sample("num_requests_running") is not None and sample("num_requests_running", model="fake") is None
            assert sample("request_success_total", finished_reason="length") == 1
            assert sample("request_success_total", finished_reason="stop") == 1  # a stop string, as vLLM labels it
            assert sample("request_prompt_tokens_count") == 2

    asyncio.run(main())


# ---- a real server: both processes, the tiny model --------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_path, launch):
    return launch(["--model", str(tiny_model_path), "--dtype", "float32"], [])


def collect(server, request) -> Completion:
    out = Completion()
    for message in server.stub().Generate(request, timeout=60):
        out.add(message)
    return out


@pytest.mark.slow
def test_real_server_openai_sdk_greedy_equals_grpc_and_abort(server):
    client = openai.OpenAI(base_url=server.http_url, api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    grpc_out = collect(server, build_request("The capital of France", max_tokens=8, temperature=0.0))
    out = client.completions.create(model=model, prompt="The capital of France", max_tokens=8, temperature=0)
    assert out.choices[0].text == grpc_out.text
    streamed = client.completions.create(
        model=model, prompt="The capital of France", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == grpc_out.text
    messages = [{"role": "user", "content": "Say hi"}]
    grpc_chat = collect(server, build_request(messages, max_tokens=8, temperature=0.0, ignore_eos=True))
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == grpc_chat.text and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == grpc_chat.text
    # Closing a long stream aborts it: nothing runs or holds KV afterwards.
    with httpx.stream(
        "POST", server.http_url + "/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True},
        timeout=60,
    ) as response:  # fmt: skip
        assert next(line for line in response.iter_lines() if line).startswith("data: ")
    server.assert_idle_and_no_leaks(timeout=30)
