"""OpenAI's `n`: n choices of one prompt, each a request of its own on the scheduler, in one
response (non-streamed: `choices[i]`; streamed: chunks of every index interleaved), with the
usage of all of them, against SchedulerApp with a fake executor and the byte tokenizer (as
test_http_api.py). The fake executor ignores seeds, so seeded choices are checked on a real
server in tests/test_openai_clients.py. No test depends on timing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.scheduler_svc.test_http_api import FAILSAFE_S, assert_idle, running, sdk

HI = [{"role": "user", "content": "hi"}]


def test_n_choices_whole_with_their_usage(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            client = sdk(base)
            one = await client.completions.create(model="fake", prompt="hello", max_tokens=5, temperature=0)
            out = await client.completions.create(model="fake", prompt="hello", max_tokens=5, temperature=0, n=3)
            assert [c.index for c in out.choices] == [0, 1, 2]
            assert [c.text for c in out.choices] == [one.choices[0].text] * 3  # greedy: the same three times
            assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
            assert out.usage.completion_tokens == 3 * one.usage.completion_tokens
            chat = await client.chat.completions.create(model="fake", messages=HI, max_tokens=4, n=2, temperature=0)
            assert [c.index for c in chat.choices] == [0, 1]
            assert chat.choices[0].message.content == chat.choices[1].message.content
            assert chat.usage.completion_tokens == 2 * 4
            assert_idle(app)

    asyncio.run(main())


def test_n_choices_streamed_interleave_and_end_with_one_usage(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            client = sdk(base)
            whole = await client.chat.completions.create(model="fake", messages=HI, max_tokens=6, temperature=0)
            stream = await client.chat.completions.create(
                model="fake",
                messages=HI,
                max_tokens=6,
                temperature=0,
                n=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            *deltas, last = chunks
            assert last.choices == [] and last.usage.completion_tokens == 3 * 6
            assert all(c.usage is None for c in deltas)
            texts, roles, reasons = ["", "", ""], [], {}
            for c in deltas:
                [choice] = c.choices
                if choice.delta.role:
                    roles.append(choice.index)
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
            assert roles == [0, 1, 2]  # each choice's first chunk names the role, before any content
            assert texts == [whole.choices[0].message.content] * 3
            assert reasons == {0: "length", 1: "length", 2: "length"}
            assert_idle(app)

    asyncio.run(main())


@pytest.mark.parametrize("n", [0, -1, 129, 1.5])
def test_n_out_of_range_is_400(fakes, byte_tokenizer_dir, monkeypatch, n):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                response = await http.post(base + "/v1/completions", json={"prompt": "hi", "n": n})
                assert response.status_code == 400 and response.json()["error"]["param"] == "n"
            assert_idle(app)

    asyncio.run(main())


def test_n_choices_past_the_queue_limit_are_429_and_leave_nothing_queued(fakes, byte_tokenizer_dir, monkeypatch):
    """The queue takes 2 waiting requests: the third choice is refused, and the two queued
    before it are taken back (none runs for a response that will not come)."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, max_waiting_requests=2) as (app, client, base):
            client.hold_after = 0  # no step completes: whatever is queued stays queued
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "hi", "max_tokens": 2, "n": 3}
                response = await http.post(base + "/v1/completions", json=body)
                assert response.status_code == 429, response.text
                engine = app.ready.engine
                assert not engine.scheduler.waiting and not engine.scheduler.running
                client.release.set()
                ok = await http.post(base + "/v1/completions", json={**body, "n": 2})
                assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
            assert_idle(app)

    asyncio.run(main())


def test_render_and_raw_stream_of_n_choices(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "hi", "max_tokens": 3, "n": 2, "stream": True}
                async with http.stream("POST", base + "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                assert lines[-1] == "data: [DONE]"
                indexes = [json.loads(line[6:])["choices"][0]["index"] for line in lines[:-1]]
                assert sorted(set(indexes)) == [0, 1]
            assert_idle(app)

    asyncio.run(main())


def test_completions_echo_puts_the_prompt_and_its_logprobs_first(fakes, byte_tokenizer_dir, monkeypatch):
    """echo: the prompt's text before the output; with logprobs each prompt token's logprob
    too (the first null, as OpenAI), which the fake executor makes -(position + byte / 1000).
    A request with prompt logprobs never starts on cached blocks: a repeat gets them all."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                prompt = "hello there, cache me"
                plain = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
                out = (await http.post(base + "/v1/completions", json=plain)).json()["choices"][0]["text"]
                echoed = (await http.post(base + "/v1/completions", json={**plain, "echo": True})).json()
                assert echoed["choices"][0]["text"] == prompt + out
                for _ in range(2):  # the second: the prompt's blocks are cached by now
                    body = {**plain, "echo": True, "logprobs": 1}
                    whole = (await http.post(base + "/v1/completions", json=body)).json()
                    lp = whole["choices"][0]["logprobs"]
                    assert whole["choices"][0]["text"] == prompt + out
                    assert lp["tokens"][: len(prompt)] == list(prompt) and len(lp["tokens"]) == len(prompt) + 3
                    want = [None] + [-(p + ord(c) / 1000) for p, c in enumerate(prompt) if p > 0]
                    assert lp["token_logprobs"][: len(prompt)] == want
                    assert lp["top_logprobs"][0] is None and all(isinstance(t, dict) for t in lp["top_logprobs"][1:])
                    assert lp["text_offset"] == list(range(len(prompt) + 3))
                    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                again = (await http.post(base + "/v1/completions", json=plain)).json()
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # plain ones do hit
                stream = {**plain, "echo": True, "logprobs": 1, "stream": True}
                async with http.stream("POST", base + "/v1/completions", json=stream) as response:
                    chunks = [
                        json.loads(x[6:]) for x in [line async for line in response.aiter_lines()] if x[6:7] == "{"
                    ]
                assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + out
                streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
                assert streamed == lp["token_logprobs"]
            assert_idle(app)

    asyncio.run(main())


def test_vllm_prompt_logprobs_field_by_token_id(fakes, byte_tokenizer_dir, monkeypatch):
    """vLLM's prompt_logprobs: null first, then per prompt token a map from token id to its
    logprob, rank and text (the fake executor: -(position + byte / 1000), rank 1 + byte % 5);
    per choice on completions, once on chat; refused with stream (as vLLM)."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "abc", "max_tokens": 2, "prompt_logprobs": 0, "n": 2}
                out = (await http.post(base + "/v1/completions", json=body)).json()
                for choice in out["choices"]:
                    assert choice["prompt_logprobs"] == [
                        None,
                        {
                            str(ord("b")): {
                                "logprob": -(1 + ord("b") / 1000),
                                "rank": 1 + ord("b") % 5,
                                "decoded_token": "b",
                            }
                        },
                        {
                            str(ord("c")): {
                                "logprob": -(2 + ord("c") / 1000),
                                "rank": 1 + ord("c") % 5,
                                "decoded_token": "c",
                            }
                        },
                    ]
                chat = {"messages": HI, "max_tokens": 2, "prompt_logprobs": 1}
                out = (await http.post(base + "/v1/chat/completions", json=chat)).json()
                prompt_tokens = out["usage"]["prompt_tokens"]
                assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == prompt_tokens
                assert "prompt_logprobs" not in out["choices"][0]
                streamed = {**body, "stream": True}
                response = await http.post(base + "/v1/completions", json=streamed)
                assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
                too_many = {**body, "prompt_logprobs": 21}
                response = await http.post(base + "/v1/completions", json=too_many)
                assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
            assert_idle(app)

    asyncio.run(main())
