"""Issue 33, the OpenAI side of structured output and tool calling, through the clients people
use: the official `openai` SDK (`chat.completions.parse` with a pydantic model, tools, streamed
tool calls), langchain-openai (`with_structured_output`, `bind_tools`) and litellm, against a
real two-process server with the tiny random-weight model.

Random weights say nothing sensible, so what is checked is plumbing the grammar guarantees:
a forced choice (a schema, a named function, `required`) always yields output the client
parses into its own types, with bounded schemas (enums, ranges, short strings) so it ends
before max_tokens. Parsing of free (tool_choice auto) output is tested on fixed texts in
tests/scheduler_svc/test_tool_parser.py.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow


class Pet(BaseModel):
    # extra="forbid": additionalProperties false, else random weights add keys until max_tokens
    model_config = ConfigDict(extra="forbid")

    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a", "b"],
                "maxProperties": 2,  # bounded even where a client strips additionalProperties (litellm)
            },
        },
    },
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_path, launch):
    return launch(["--model", str(tiny_model_path), "--dtype", "float32"], [])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").assert_idle_and_no_leaks(timeout=30)


def test_sdk_parse_with_a_pydantic_model(client, model):
    for temperature in (0, 1):
        out = client.chat.completions.parse(
            model=model, messages=ASK, response_format=Pet, temperature=temperature, max_tokens=100, seed=3
        )
        assert isinstance(out.choices[0].message.parsed, Pet), out.choices[0].message.content
    obj = client.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, max_tokens=60, temperature=0
    )
    if obj.choices[0].finish_reason == "stop":  # any JSON object: random weights may run to max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(
        model=model, prompt="Pick:", max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "blue"]}}
    )
    assert choice.choices[0].text in ("red", "blue")
    legacy = client.completions.create(
        model=model, prompt="Pick:", max_tokens=10, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert legacy.choices[0].text.isdigit() and len(legacy.choices[0].text) == 3


def test_sdk_json_whitespace_options(client, model):
    """structured_outputs' whitespace options through the SDK's extra_body: a schema whose every
    value has one spelling, so the text must equal json.dumps with the separators asked for."""
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["ok", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    for extra, separators in (
        ({}, (", ", ": ")),
        ({"structured_outputs": {"disable_any_whitespace": True}}, (",", ":")),
        ({"guided_whitespace_pattern": ""}, (",", ":")),  # whitespace must match the empty regex
    ):
        out = client.chat.completions.create(
            model=model, messages=ASK, response_format=fmt, max_tokens=60, temperature=1, seed=5, extra_body=extra
        )
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", text
        assert text == json.dumps(json.loads(text), separators=separators), (extra, text)


def test_sdk_structural_tag(server, client, model):
    """vLLM's structural tag through the SDK's response_format: free text, and where the trigger
    starts a call, the call is whole. The trigger is " <", pushed by logit_bias so that the
    random-weight model surely writes it."""
    import httpx

    [trigger] = httpx.post(
        server.http_url.removesuffix("/v1") + "/tokenize", json={"prompt": " <", "add_special_tokens": False}
    ).json()["tokens"]
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    structure = {"begin": " <u>", "schema": {**schema, "additionalProperties": False}, "end": "</u>"}
    tag = {"type": "structural_tag", "structures": [structure], "triggers": [" <"]}
    out = client.chat.completions.create(
        model=model, messages=ASK, response_format=tag, max_tokens=40, logit_bias={str(trigger): 100}
    )
    text, cut, at, calls = out.choices[0].message.content, out.choices[0].finish_reason == "length", 0, 0
    while (start := text.find(" <", at)) >= 0:  # each trigger starts a whole call, or max_tokens cut it
        if not text.startswith(" <u>", start):
            assert cut and " <u>".startswith(text[start:]), text
            break
        try:
            value, end = json.JSONDecoder().raw_decode(text, start + len(" <u>"))
        except json.JSONDecodeError:
            assert cut, text
            break
        assert value["unit"] in ("c", "f"), text
        if not text.startswith("</u>", end):
            assert cut and "</u>".startswith(text[end:]), text
            break
        at, calls = end + len("</u>"), calls + 1
    assert calls >= 1, text


def test_sdk_forced_tool_calls_whole_and_streamed(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("c", "f")
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, stream=True, temperature=0
    )
    fragments = [tc for chunk in stream if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    assert fragments[0].function.name == "get_weather" and fragments[0].id
    greedy = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0
    )
    streamed_args = "".join(f.function.arguments or "" for f in fragments)
    assert streamed_args == greedy.choices[0].message.tool_calls[0].function.arguments
    required = client.chat.completions.create(  # one call: random weights would add calls to max_tokens
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert required.choices[0].finish_reason == "tool_calls"
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "add") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # free text: plumbing only
    # a conversation with a tool call and its result renders (the default template has no tools: fallback)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    follow = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5)
    assert follow.usage.prompt_tokens > out.usage.prompt_tokens


def test_langchain_structured_output_and_bind_tools(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=model, base_url=server.http_url, api_key="none", temperature=0, max_tokens=100, max_retries=0
    )
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
        assert isinstance(pet, Pet), method
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke("Weather in Oslo?")
    assert message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo", "Lima")
    chunks = list(bound.stream("Weather in Oslo?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.tool_calls[0]["name"] == "get_weather"


def test_litellm_response_format_and_tools(server, model, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"hosted_vllm/{model}", api_base=server.http_url, api_key="none", max_tokens=100, temperature=0)
    out = litellm.completion(messages=ASK, response_format=Pet, **common)
    assert Pet.model_validate_json(out.choices[0].message.content)
    named = {"type": "function", "function": {"name": "add"}}
    out = litellm.completion(messages=ASK, tools=TOOLS, tool_choice=named, **common)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


def test_auto_tool_calls_parsed_from_output_whole_and_streamed(client, model):
    """tool_choice auto on the real server: a regex makes the random model write a Hermes
    block (with some content before it), which the auto parser must turn into a call."""
    regex = r'Ok\. <tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'
    common = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    extra = {"structured_outputs": {"regex": regex}}
    out = client.chat.completions.create(**common, extra_body=extra)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Ok."
    [call] = message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    chunks = list(client.chat.completions.create(**common, extra_body=extra, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    fragments = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert content == "Ok." and fragments[0].function.name == "add"
    assert "".join(f.function.arguments or "" for f in fragments) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_sdk_penalties_reach_the_sampler(client, model, server):
    """OpenAI's presence/frequency penalties and vLLM's repetition_penalty (extra_body) through
    the SDK give the text the gRPC API gives with the same penalties, and not the plain one
    (random weights repeat themselves greedily, so the penalties change the output)."""
    from chunkserve.client import Completion, build_request
    from tests.hf_reference import PENALTIES

    prompt = "one two one two one two"

    def http(**penalties: float) -> str:
        out = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            frequency_penalty=penalties.get("frequency_penalty"),
            presence_penalty=penalties.get("presence_penalty"),
            extra_body={"repetition_penalty": penalties.get("repetition_penalty", 1.0)},
        )
        return out.choices[0].text

    done = Completion()
    request = build_request(prompt, temperature=0.0, max_tokens=24, **PENALTIES)
    for msg in server.stub().Generate(request, timeout=120):
        done.add(msg)
    assert http(**PENALTIES) == done.text
    assert http() != done.text


def test_sdk_bad_words_keep_a_word_out(client, model, server):
    """vLLM's bad_words (extra_body): a word whose token (with its leading space) the plain
    greedy output holds is never generated with it, where the word alone is one token too;
    the gRPC API gives the same text."""
    import httpx

    from chunkserve.client import Completion, build_request

    prompt = "one two one two one two"

    def grpc_run(**sampling: object) -> Completion:
        done = Completion()
        for msg in server.stub().Generate(
            build_request(prompt, temperature=0.0, max_tokens=24, **sampling), timeout=120
        ):
            done.add(msg)
        return done

    plain = grpc_run()
    root = server.http_url.removesuffix("/v1")
    texts = [httpx.post(root + "/detokenize", json={"tokens": [t]}).json()["prompt"] for t in plain.token_ids]

    def tokens(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return httpx.post(root + "/tokenize", json=body).json()["tokens"]

    # " word" is banned with "word" only where both are one token (vLLM's rule: same length).
    token, word = next(
        (t, x[1:])
        for t, x in zip(plain.token_ids, texts)
        if x[:1] == " " and x[1:].isalpha() and len(tokens(x[1:])) == 1
    )
    banned = grpc_run(bad_words=[word])
    assert token not in banned.token_ids and banned.token_ids != plain.token_ids
    http = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"bad_words": [word]}
    )
    assert http.choices[0].text == banned.text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_beam_search_equals_transformers(client, model, server, tiny_model_path, chat):
    """vLLM's use_beam_search (n = the beam width) gives transformers' beam search: with
    ignore_eos (and transformers' end token off) every beam has the same length, so the
    length penalty orders nothing and both keep the best W by summed logprob each step; the
    W beams come back best first, with their token ids. Refused with a field it would not
    honour, with stream, and a length_penalty without it."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    root = server.http_url.removesuffix("/v1")
    body = {"model": model, "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True}
    body |= {"length_penalty": 0.5, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "one two one two"}]
        prompt = httpx.post(root + "/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    else:
        body["prompt"] = "one two one two"
        prompt = httpx.post(root + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    answer = httpx.post(f"{server.http_url}/{'chat/' if chat else ''}completions", json=body, timeout=300).json()
    got = [c["token_ids"] for c in answer["choices"]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=6,
            min_new_tokens=6, eos_token_id=None, pad_token_id=0, length_penalty=0.5,
        )  # fmt: skip
    assert got == [row[len(prompt) :] for row in out.tolist()]
    assert len({tuple(g) for g in got}) == 3 and all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 18 and answer["usage"]["prompt_tokens"] == len(prompt)
    for extra, param in (({"top_p": 0.5}, "top_p"), ({"stream": True}, "stream"), ({"n": 11}, "n")):
        beams = {"model": model, "prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
        refused = httpx.post(server.http_url + "/completions", json=beams, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    plain = {"model": model, "prompt": "x", "length_penalty": 2.0}
    assert (
        httpx.post(server.http_url + "/completions", json=plain, timeout=60).json()["error"]["param"]
        == "length_penalty"
    )


def test_sdk_logit_bias_forces_and_bans_tokens(client, model, server):
    """+100 on one token makes greedy output that token every time, whatever else is likely;
    -100 on the plain greedy output's first token moves it; values past 100 are clamped (as
    vLLM), and the gRPC API gives the same tokens for the same bias."""
    import httpx

    from chunkserve.client import Completion, build_request

    [yes] = httpx.post(server.http_url.removesuffix("/v1") + "/tokenize", json={"prompt": " yes"}).json()["tokens"]
    out = client.completions.create(
        model=model, prompt="Say no.", max_tokens=6, temperature=0, logit_bias={str(yes): 500}
    )
    assert out.choices[0].text == " yes" * 6
    plain = client.completions.create(model=model, prompt="Say no.", max_tokens=1, temperature=0)
    first = httpx.post(
        server.http_url.removesuffix("/v1") + "/tokenize", json={"prompt": plain.choices[0].text}
    ).json()["tokens"][0]
    banned = client.completions.create(
        model=model, prompt="Say no.", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != plain.choices[0].text
    done = Completion()
    for msg in server.stub().Generate(build_request("Say no.", temperature=0.0, max_tokens=6, logit_bias={yes: 100.0})):
        done.add(msg)
    assert done.token_ids == [yes] * 6
    only = client.completions.create(
        model=model, prompt="Say no.", max_tokens=4, temperature=1.0, seed=2, extra_body={"allowed_token_ids": [yes]}
    )
    assert only.choices[0].text == " yes" * 4  # vLLM's allowed_token_ids: nothing else can be drawn


def test_sdk_n_seeded_choices_are_the_single_requests_with_seed_plus_i(client, model):
    """OpenAI's n with a seed: choice i samples as a request of its own with seed + i (vLLM's
    parallel sampling), so the choices differ from one another and each is reproducible."""
    ask = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    out = client.completions.create(n=3, seed=7, **ask)
    singles = [client.completions.create(seed=7 + i, **ask).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    assert len(set(singles)) > 1
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=8, temperature=1.0, n=2, seed=11, stream=True
    )
    texts = ["", ""]
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    single = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=1.0, seed=12)
    assert texts[1] == single.choices[0].message.content


def test_sdk_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, model, server):
    """lm-evaluation-harness scores text through a completions API with echo, logprobs 1 and
    max_tokens 1: the prompt's tokens come back first with their logprobs (the first null),
    the same values the gRPC API's prompt_logprobs gives."""
    from chunkserve.client import Completion, build_request

    text = "The capital of France is Paris"
    out = client.completions.create(model=model, prompt=text, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(text)
    assert len(lp.tokens) == out.usage.prompt_tokens + 1 and lp.token_logprobs[0] is None
    done = Completion()
    for msg in server.stub().Generate(build_request(text, temperature=0.0, max_tokens=1, prompt_logprobs=1)):
        done.add(msg)
    assert lp.token_logprobs[1:-1] == pytest.approx([p.logprob for p in done.prompt_logprobs], abs=1e-6)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # vLLM's own prompt_logprobs field: by token id, with rank and text, the same values
    raw = client.completions.create(
        model=model, prompt=text, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    scored = raw.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(done.prompt_token_ids)
    for token, entry, p in zip(done.prompt_token_ids[1:], scored[1:], done.prompt_logprobs):
        assert entry[str(token)]["logprob"] == pytest.approx(p.logprob, abs=1e-6)
        assert entry[str(token)]["rank"] == p.rank >= 1
