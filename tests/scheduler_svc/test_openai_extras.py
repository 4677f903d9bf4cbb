"""Issue 33 item 3: the OpenAI front ignores nothing silently. vLLM's chat-template extras,
output options, stream usage, /tokenize and /detokenize, CORS, JSON bodies for unknown routes,
access and stats logging, --generation-config, --chat-template and the full model id, against
SchedulerApp with a fake executor and the byte-level tokenizer (token = byte, <eos> = 256,
template "<role>content...<assistant>"). No test depends on timing."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from scheduler_svc import http_extras, openai_fields
from scheduler_svc.metrics import Metrics
from scheduler_svc.openai_prompt import PromptSpec
from scheduler_svc.stats_log import Sample, sample, stats_line
from scheduler_svc.tokenizer import IncrementalDetokenizer, Tokenizer, read_chat_template
from tests.scheduler_svc.test_http_api import FAILSAFE_S, assert_idle, running, sdk

HI = [{"role": "user", "content": "hi"}]


def fields_warnings(caplog) -> list[logging.LogRecord]:
    """What the field rules logged (an unknown field accepted under warn)."""
    return [r for r in caplog.records if r.name == "scheduler_svc.openai_fields"]


def post(http: httpx.AsyncClient, base: str, path: str, body: dict) -> asyncio.Future:
    return http.post(base + path, json=body)


async def rendered(http: httpx.AsyncClient, base: str, body: dict) -> str:
    """The prompt text a chat body renders to (the byte tokenizer: one token per byte)."""
    response = await http.post(base + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["count"] == len(out["tokens"]), out
    return (await http.post(base + "/detokenize", json={"tokens": out["tokens"]})).json()["prompt"]


def test_chat_template_options_change_the_prompt(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, trust_request_chat_template=True) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                assert await rendered(http, base, {"messages": HI}) == "<user>hi<assistant>"
                body = {"messages": HI, "add_generation_prompt": False}
                assert await rendered(http, base, body) == "<user>hi"
                prefill = [*HI, {"role": "assistant", "content": "Sure"}]
                body = {"messages": prefill, "continue_final_message": True}
                assert await rendered(http, base, body) == "<user>hi<assistant>Sure"
                template = "{{ greeting }}|{% for d in documents %}{{ d.title }}{% endfor %}|{{ messages[0].content }}"
                body = {
                    "messages": HI,
                    "chat_template": template,
                    "chat_template_kwargs": {"greeting": "yo"},
                    "documents": [{"title": "doc1", "text": "x"}],
                }
                assert await rendered(http, base, body) == "yo|doc1|hi"
                # the same options reach generation: prompt_tokens is the rendered length
                chat = {"messages": HI, "max_tokens": 2, "add_generation_prompt": False}
                out = (await http.post(base + "/v1/chat/completions", json=chat)).json()
                assert out["usage"]["prompt_tokens"] == len("<user>hi")
                for bad_body, param in [
                    ({"messages": HI, "continue_final_message": True, "add_generation_prompt": True}, None),
                    ({"messages": HI, "continue_final_message": True}, "continue_final_message"),
                    ({"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                    ({"messages": HI, "chat_template": "{% for %}"}, "chat_template"),
                    ({"messages": HI, "documents": ["x"]}, "documents"),
                ]:
                    response = await http.post(base + "/v1/chat/completions", json=bad_body)
                    assert response.status_code == 400, bad_body
                    assert response.json()["error"]["param"] == (param or "continue_final_message")
            assert_idle(app)

    asyncio.run(main())


def test_a_request_chat_template_needs_the_trust_flag(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"messages": HI, "chat_template": "{{ messages[0].content }}"}
                response = await http.post(base + "/v1/chat/completions", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
                assert "--trust-request-chat-template" in response.json()["error"]["message"]

    asyncio.run(main())


def test_server_chat_template_inline_or_file(fakes, byte_tokenizer_dir, monkeypatch, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("[{% for m in messages %}{{ m.content }}{% endfor %}]")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not valid Jinja"):
        read_chat_template("{% if %}")

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, chat_template=str(path)) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                assert await rendered(http, base, {"messages": HI}) == "[hi]"

    asyncio.run(main())


def test_stop_string_kept_and_special_tokens_decoded_when_asked(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, client, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
                text = (await http.post(base + "/v1/completions", json=body)).json()["choices"][0]["text"]
                stop = text[2:4]
                cut = text[: text.index(stop)]
                for include, want in ((False, cut), (True, cut + stop)):
                    for stream in (False, True):
                        got = await completion_text(
                            http, base, {**body, "stop": [stop], "include_stop_str_in_output": include}, stream
                        )
                        assert got == want, (include, stream)
                client.fake.eos_after = len("hello") + 2  # two letters, then <eos> forever
                eos = {**body, "ignore_eos": True, "max_tokens": 4}
                assert await completion_text(http, base, eos, False) == text[:2]
                raw = await completion_text(http, base, {**eos, "skip_special_tokens": False}, False)
                assert raw == text[:2] + "<eos><eos>"
                stopped = {**body, "max_tokens": 4}  # <eos> ends it: its text is kept only on request
                assert await completion_text(http, base, {**stopped, "skip_special_tokens": False}, False) == text[:2]
                kept = {**stopped, "skip_special_tokens": False, "include_stop_str_in_output": True}
                assert await completion_text(http, base, kept, True) == text[:2] + "<eos>"
            assert_idle(app)

    asyncio.run(main())


async def completion_text(http: httpx.AsyncClient, base: str, body: dict, stream: bool, chat: bool = False) -> str:
    """The first choice's whole text (chat: its message content), streamed or not."""
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    if not stream:
        response = await http.post(url, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    choices = [json.loads(line[6:])["choices"][0] for line in lines]
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)


def test_chat_echo_puts_the_last_message_first_where_its_role_is_the_answers(fakes, byte_tokenizer_dir, monkeypatch):
    """vLLM's chat echo: a continued assistant message (or, without a generation prompt, any
    last message) comes back before the answer, streamed or not; after a user message the
    answer is unchanged. The prompt, so the answer, is the same with echo or without."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                partial = {"messages": [*HI, {"role": "assistant", "content": "Sure"}], "max_tokens": 5}
                continued = {**partial, "continue_final_message": True, "add_generation_prompt": False}
                plain_user = {"messages": HI, "max_tokens": 5}
                no_prompt = {**plain_user, "add_generation_prompt": False}
                for stream in (False, True):
                    for body, echoed in ((continued, "Sure"), (no_prompt, "hi"), (plain_user, "")):
                        answer = await completion_text(http, base, body, stream, chat=True)
                        echo = {**body, "echo": True}
                        assert answer and await completion_text(http, base, echo, stream, chat=True) == echoed + answer
            assert_idle(app)

    asyncio.run(main())


def test_detokenizer_options_on_fixed_ids(byte_tokenizer_dir):
    tok = Tokenizer(byte_tokenizer_dir)
    ids = [*b"ab", 256, *b"cd"]
    for skip, want in ((True, "abcd"), (False, "ab<eos>cd")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(detok.add(t) for t in ids) + detok.flush() == want
    for include, want in ((False, "a"), (True, "abc")):
        detok = IncrementalDetokenizer(tok, [], stop=["bc"], include_stop=include)
        out = "".join(detok.add(t) for t in b"abcd" if detok.matched_stop is None) + detok.flush()
        assert out == want and detok.matched_stop == "bc"


def test_continuous_usage_stats_count_tokens_in_every_chunk(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            client = sdk(base)
            options = {"include_usage": True, "continuous_usage_stats": True}
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="fake", messages=HI, max_tokens=4, temperature=0, stream=True, stream_options=options
                )
            ]
            assert all(c.usage is not None for c in chunks)
            counts = [c.usage.completion_tokens for c in chunks]
            assert counts == sorted(counts) and counts[-1] == 4 and counts[0] == 0
            assert {c.usage.prompt_tokens for c in chunks} == {len("<user>hi<assistant>")}
            plain = [
                c
                async for c in await client.chat.completions.create(
                    model="fake", messages=HI, max_tokens=4, stream=True, stream_options={"include_usage": True}
                )
            ]
            assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]

    asyncio.run(main())


REFUSED = [  # (endpoint, extra fields, param)
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"use_beam_search": True, "temperature": 0.5}, "temperature"),  # beam search chooses the tokens
    ("completions", {"logits_processors": ["x.y"]}, "logits_processors"),
    ("completions", {"length_penalty": 2.0}, "length_penalty"),
    ("chat/completions", {"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, "echo"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"structural_tag": "{}"}, "structural_tag"),
    ("chat/completions", {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ("chat/completions", {"skip_special_tokens": "no"}, "skip_special_tokens"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("chat/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    # OpenAI's own fields outside vLLM's request
    ("chat/completions", {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ("chat/completions", {"web_search_options": {}}, "web_search_options"),  # OpenAI: search, default options
    ("chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {"store": True}, "store"),
    ("chat/completions", {"verbosity": "low"}, "verbosity"),
    # SGLang's, beyond the value vllm-router writes
    ("completions", {"no_stop_trim": True}, "no_stop_trim"),
    ("chat/completions", {"return_hidden_states": True}, "return_hidden_states"),
]


def test_known_fields_chunkserve_cannot_honour_are_refused_by_name(fakes, byte_tokenizer_dir, monkeypatch, caplog):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                for endpoint, extra, param in REFUSED:
                    base_body = {"prompt": "hi"} if endpoint == "completions" else {"messages": HI}
                    response = await http.post(f"{base}/v1/{endpoint}", json={**base_body, **extra})
                    assert response.status_code == 400, (extra, response.text)
                    assert response.json()["error"]["param"] == param, (extra, response.json())
                assert not app.ready.engine.scheduler.requests
                # an unknown field (a typo of `max_tokens`, another server's feature) is refused by name
                for endpoint, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": HI})):
                    response = await http.post(f"{base}/v1/{endpoint}", json={**body, "max_token": 1})
                    assert response.status_code == 400 and response.json()["error"]["param"] == "max_token"
                    assert "--openai-unknown-fields warn" in response.json()["error"]["message"]
                assert not app.ready.engine.scheduler.requests
                # neutral values and no-effect fields are fine
                ok = {"prompt": "hi", "max_tokens": 1, "echo": False, "best_of": 1, "user": "u"}
                assert (await http.post(base + "/v1/completions", json=ok)).status_code == 200
                chat_ok = {
                    "messages": HI,
                    "max_tokens": 1,
                    "store": False,
                    "modalities": ["text"],
                    "verbosity": "medium",
                    "metadata": {"team": "a"},
                    "service_tier": "auto",
                    "prompt_cache_key": "k",
                    "safety_identifier": "s",
                    "prediction": {"type": "content", "content": "hi"},
                }
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="scheduler_svc.openai_fields"):
                    assert (await http.post(base + "/v1/chat/completions", json=chat_ok)).status_code == 200
                # each is known: none is taken for an unknown field (other loggers' records, e.g. an
                # earlier test's client collected now, are not this test's business)
                assert not fields_warnings(caplog)

    asyncio.run(main())


# The bodies vllm-router 0.1.17 (PyPI) forwards for a client's plain requests, captured from its
# cache_aware and round_robin policies: it re-serializes a typed request with SGLang's defaults.
VLLM_ROUTER_BODIES = [
    (
        "completions",
        {"prompt": "hi", "max_tokens": 3, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
         "echo": False, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True,
         "return_hidden_states": False},
    ),
    (
        "chat/completions",
        {"messages": HI, "stream": False, "max_tokens": 3, "logprobs": False, "no_stop_trim": False,
         "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
         "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
         "include_reasoning": True},
    ),
]  # fmt: skip


def test_what_vllm_router_forwards_is_accepted(fakes, byte_tokenizer_dir, monkeypatch, caplog):
    """A gateway that adds its own defaults must not turn every request into a 400 (they were
    unknown fields before): each is accepted at the value it sends, and none is logged as unknown."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                with caplog.at_level(logging.WARNING, logger="scheduler_svc.openai_fields"):
                    for endpoint, body in VLLM_ROUTER_BODIES:
                        response = await http.post(f"{base}/v1/{endpoint}", json=body)
                        assert response.status_code == 200, (endpoint, response.text)
                assert not fields_warnings(caplog)
                assert_idle(app)

    asyncio.run(main())


def test_render_answers_what_generation_would_run_without_running_it(fakes, byte_tokenizer_dir, monkeypatch):
    """vLLM's /v1/completions/render and /v1/chat/completions/render (vllm-router's cache_aware
    asks them first): the prompt's token ids as generation computes them, the resolved sampling
    parameters, the same refusals; nothing is queued."""

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "hi there", "max_tokens": 3, "temperature": 0.5, "stop": ["x"], "seed": 7}
                r = await http.post(base + "/v1/completions/render", json=body)
                assert r.status_code == 200, r.text
                out = r.json()
                assert out["request_id"].startswith("cmpl-") and out["features"] is None
                assert out["token_ids"] == list(b"hi there")  # the byte tokenizer: one id per byte
                sp = out["sampling_params"]
                assert (sp["max_tokens"], sp["temperature"], sp["stop"], sp["seed"]) == (3, 0.5, ["x"], 7)
                assert sp["structured_outputs"] is None
                done = (await http.post(base + "/v1/completions", json=body)).json()
                assert done["usage"]["prompt_tokens"] == len(out["token_ids"])
                chat = {"messages": HI, "max_tokens": 2, "response_format": {"type": "json_object"}, "request_id": "q"}
                r = await http.post(base + "/v1/chat/completions/render", json=chat)
                assert r.status_code == 200, r.text
                assert r.json()["request_id"] == "chatcmpl-q"
                tokenized = await http.post(base + "/tokenize", json={"messages": HI})
                assert r.json()["token_ids"] == tokenized.json()["tokens"]  # the chat template, as generation
                assert r.json()["sampling_params"]["structured_outputs"] == {"json_object": True}
                schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
                guided = {"prompt": "hi", "structured_outputs": {"json": schema}}
                r = await http.post(base + "/v1/completions/render", json=guided)
                assert r.json()["sampling_params"]["structured_outputs"] == {"json": schema}, r.text
                r = await http.post(base + "/v1/completions/render", json={"prompt": "hi", "guided_choice": ["x", "y"]})
                assert r.json()["sampling_params"]["structured_outputs"] == {"choice": ["x", "y"]}, r.text
                # refused as generation refuses it, by name
                r = await http.post(base + "/v1/completions/render", json={"prompt": "hi", "best_of": 2})
                assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
                r = await http.post(base + "/v1/completions/render", json={"prompt": "hi", "model": "nope"})
                assert r.status_code == 404
                assert (await http.get(base + "/v1/completions/render")).status_code == 405
            assert not app.ready.engine.scheduler.requests
            assert_idle(app)

    asyncio.run(main())


def test_unknown_fields_under_warn_are_accepted_and_logged_once(fakes, byte_tokenizer_dir, monkeypatch, caplog):
    """--openai-unknown-fields warn: vLLM's behaviour, one warning per field name."""

    async def main():
        cfg = {"openai_unknown_fields": "warn"}
        async with running(fakes, byte_tokenizer_dir, monkeypatch, **cfg) as (app, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                openai_fields._WARNED.discard("frobnicate")
                ok = {"prompt": "hi", "max_tokens": 1, "frobnicate": 1}
                with caplog.at_level(logging.WARNING, logger="scheduler_svc.openai_fields"):
                    for _ in range(2):
                        assert (await http.post(base + "/v1/completions", json=ok)).status_code == 200
                assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 1
                bad = {"prompt": "hi", "best_of": 2}  # known and not honoured: refused under warn too
                assert (await http.post(base + "/v1/completions", json=bad)).status_code == 400

    asyncio.run(main())


def test_tokenize_and_detokenize_shapes(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                out = (await http.post(base + "/tokenize", json={"prompt": "hé", "return_token_strs": True})).json()
                assert out == {
                    "count": 3,
                    "max_model_len": 100,
                    "tokens": list("hé".encode()),
                    "token_strs": ["h", "Ã", "©"],
                }
                out = (await http.post(base + "/tokenize", json={"prompt": "hi", "model": "fake"})).json()
                assert out["tokens"] == list(b"hi") and out["token_strs"] is None
                back = await http.post(base + "/detokenize", json={"tokens": [*b"hi", 256]})
                assert back.json() == {"prompt": "hi<eos>"}
                for path, body, param in [
                    ("/detokenize", {"tokens": [999]}, "tokens"),
                    ("/detokenize", {}, "tokens"),
                    ("/tokenize", {}, "prompt"),
                    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, "model"),
                ]:
                    response = await http.post(base + path, json=body)
                    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param

    asyncio.run(main())


def test_unknown_routes_and_methods_get_json_errors_and_cors_preflight(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                missing = await http.get(base + "/v1/nothing")
                assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
                wrong = await http.get(base + "/v1/completions")
                assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
                assert "POST" in wrong.headers["allow"]
                preflight = await http.options(base + "/v1/chat/completions", headers=_PREFLIGHT)
                assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
        async with running(fakes, byte_tokenizer_dir, monkeypatch, allowed_origins='["https://ui.example"]') as (
            _,
            _,
            base,
        ):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                preflight = await http.options(base + "/v1/chat/completions", headers=_PREFLIGHT)
                assert preflight.status_code == 200
                assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
                other = await http.options(
                    base + "/v1/chat/completions", headers={**_PREFLIGHT, "Origin": "https://evil.example"}
                )
                assert other.status_code == 400
                out = await http.get(base + "/v1/models", headers={"Origin": "https://ui.example"})
                assert out.headers["access-control-allow-origin"] == "https://ui.example"

    asyncio.run(main())


_PREFLIGHT = {
    "Origin": "https://ui.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type,authorization",
}


def test_parse_origins():
    assert http_extras.parse_origins("") == ()
    assert http_extras.parse_origins("*") == ("*",)
    assert http_extras.parse_origins("https://a, https://b") == ("https://a", "https://b")
    assert http_extras.parse_origins('["https://a"]') == ("https://a",)
    with pytest.raises(ValueError, match="allowed-origins"):
        http_extras.parse_origins('["x", 1]')


@pytest.mark.parametrize("disabled", [False, True])
def test_one_access_log_line_per_request(fakes, byte_tokenizer_dir, monkeypatch, caplog, disabled):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, disable_uvicorn_access_log=disabled) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                with caplog.at_level(logging.INFO, logger="chunkserve.access"):
                    await http.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    await http.get(base + "/v1/nothing")
        lines = [r.getMessage() for r in caplog.records if r.name == "chunkserve.access"]
        if disabled:
            assert lines == []
        else:
            assert len(lines) == 2
            assert '"POST /v1/completions" 200' in lines[0] and lines[0].endswith(" ms")
            assert '"GET /v1/nothing" 404' in lines[1]

    asyncio.run(main())


def test_stats_line_reads_the_metrics_registry():
    metrics = Metrics("m")
    before = sample(metrics.registry, "m", now=0.0)
    metrics.prompt_tokens.inc(200)
    metrics.generation_tokens.inc(50)
    metrics.prefix_queries.inc(100)
    metrics.prefix_hits.inc(25)
    metrics.running.set(3)
    metrics.waiting.set(2)
    metrics.kv_usage.set(0.5)
    now = sample(metrics.registry, "m", now=10.0)
    assert stats_line(before, now) == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, Swapped: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 25.0%"
    )
    assert "hit rate: 0.0%" in stats_line(now, Sample(20.0, dict(now.values)))


def test_generation_config_defaults(fakes, byte_tokenizer_dir, monkeypatch, tmp_path):
    config = {"temperature": 0.0, "top_k": 50, "top_p": 0.9, "max_new_tokens": 3, "repetition_penalty": 1.2}
    (byte_tokenizer_dir / "generation_config.json").write_text(json.dumps(config))
    defaults = http_extras.generation_defaults("auto", str(byte_tokenizer_dir))
    # top_k 50 is transformers' default, so it is no default of the model's (vLLM's reading)
    assert defaults == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 3, "repetition_penalty": 1.2}
    assert http_extras.generation_defaults("vllm", str(byte_tokenizer_dir)) == {}
    (tmp_path / "empty").mkdir()
    assert http_extras.generation_defaults("auto", str(tmp_path / "empty")) == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        http_extras.generation_defaults(str(tmp_path / "empty"), str(byte_tokenizer_dir))

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (app, client, base):
            client.hs.model_path = str(byte_tokenizer_dir)  # the handshake names the model folder
            app.http.settings.defaults = http_extras.generation_defaults("auto", str(byte_tokenizer_dir))
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                out = (await http.post(base + "/v1/completions", json={"prompt": "hi"})).json()
                assert out["usage"]["completion_tokens"] == 3  # max_new_tokens caps it, as in vLLM
                chat = {"messages": HI, "max_tokens": 10}
                out = (await http.post(base + "/v1/chat/completions", json=chat)).json()
                assert out["usage"]["completion_tokens"] == 3
                rendered = (await http.post(base + "/v1/completions/render", json={"prompt": "hi"})).json()
                assert rendered["sampling_params"]["repetition_penalty"] == pytest.approx(1.2)
                body = {"prompt": "hi", "repetition_penalty": 1.0}  # the body's value wins
                rendered = (await http.post(base + "/v1/completions/render", json=body)).json()
                assert rendered["sampling_params"]["repetition_penalty"] == 1.0

    asyncio.run(main())


def test_full_model_id_and_short_name_are_both_served(fakes, byte_tokenizer_dir, monkeypatch):
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, served_model_name=hub_id) as (_, _, base):
            client = sdk(base)
            models = (await client.models.list()).data
            assert [m.id for m in models] == [hub_id]
            for name in (hub_id, "SmolLM2-135M-Instruct"):
                out = await client.completions.create(model=name, prompt="hi", max_tokens=1)
                assert out.model == name
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="HuggingFaceTB/other", prompt="hi", max_tokens=1)

    asyncio.run(main())


def test_request_id_token_ids_as_text_truncation_and_special_tokens(fakes, byte_tokenizer_dir, monkeypatch):
    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"prompt": "hello", "max_tokens": 2, "request_id": "abc"}
                out = (await http.post(base + "/v1/completions", json=body)).json()
                assert out["id"] == "cmpl-abc"
                long_id = await http.post(base + "/v1/completions", json={"prompt": "hi", "request_id": "x" * 300})
                assert long_id.status_code == 400 and long_id.json()["error"]["param"] == "request_id"
                headers = {"X-Request-Id": "from-header"}
                out = (await http.post(base + "/v1/completions", json={"prompt": "hi"}, headers=headers)).json()
                assert out["id"] == "cmpl-from-header"
                body = {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
                body["return_tokens_as_token_ids"] = True
                out = (await http.post(base + "/v1/chat/completions", json=body)).json()
                tokens = out["choices"][0]["logprobs"]["content"]
                assert all(t["token"].startswith("token_id:") for t in tokens)
                assert all(x["token"].startswith("token_id:") for t in tokens for x in t["top_logprobs"])
                for prompt in ("hello", list(b"hello")):
                    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 2}
                    out = (await http.post(base + "/v1/completions", json=body)).json()
                    assert out["usage"]["prompt_tokens"] == 2
                body = {"messages": HI, "max_tokens": 1, "add_special_tokens": True}
                out = (await http.post(base + "/v1/chat/completions", json=body)).json()
                assert out["usage"]["prompt_tokens"] == len("<user>hi<assistant>")  # no BOS in this tokenizer

    asyncio.run(main())


def test_tools_are_rendered_by_a_template_that_reads_them_else_by_the_fallback(fakes, byte_tokenizer_dir, monkeypatch):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 7}'}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "9"}]
    native = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.a }}{% endif %}|{% endfor %}"
    )

    async def main():
        async with running(fakes, byte_tokenizer_dir, monkeypatch, trust_request_chat_template=True) as (_, _, base):
            async with httpx.AsyncClient(timeout=FAILSAFE_S) as http:
                body = {"messages": messages, "tools": tools, "chat_template": native}
                assert await rendered(http, base, body) == "add;user:hi|assistant:7|tool:9|"
                # the byte tokenizer's template has no `tools`: the fallback (too long for this
                # 100-token server, so rendered directly)
                text = PromptSpec(messages=messages, tools=tools)._render(Tokenizer(byte_tokenizer_dir))
                assert text.startswith("<system># Tools") and json.dumps(tools[0]) in text
                assert '<assistant><tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>' in text
                assert text.endswith("<user><tool_response>\n9\n</tool_response><assistant>")

    asyncio.run(main())


def test_stats_lines_while_there_is_work_one_when_it_stops(monkeypatch, caplog):
    """log_stats_forever's rhythm without a clock: each 'interval' is one patched sleep."""
    from scheduler_svc import stats_log

    metrics = Metrics("m")
    script = [  # per interval: (serving, tokens generated in it)
        (True, 0),  # the first sample: nothing to compare with, no line
        (True, 5),  # work: a line
        (True, 0),  # idle after work: one line (the load went to zero)
        (True, 0),  # idle again: quiet
        (False, 0),  # not serving: no line, and the next sample starts over
        (True, 7),  # first sample again: no line
        (True, 1),  # work: a line
    ]
    turn = iter(script)
    serving = [True]

    async def fake_sleep(_):
        try:
            serving[0], generated = next(turn)
        except StopIteration:
            raise asyncio.CancelledError from None
        metrics.generation_tokens.inc(generated)

    monkeypatch.setattr(stats_log.asyncio, "sleep", fake_sleep)

    async def main():
        with caplog.at_level(logging.INFO, logger="chunkserve.stats"):
            with pytest.raises(asyncio.CancelledError):
                await stats_log.log_stats_forever(lambda: (metrics.registry, "m") if serving[0] else None)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "chunkserve.stats"]
    assert len(lines) == 3 and all(line.startswith("Avg prompt throughput") for line in lines)
