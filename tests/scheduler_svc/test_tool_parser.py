"""Tool calls read out of text (scheduler_svc/tool_parser.py) and what the OpenAI front makes of
them (openai_tools.py, openai_structured.py): fixed texts in each format, and the invariant
streaming rests on: however the text is cut into deltas, the content and the calls (each
call's argument fragments concatenated) are exactly those of the whole text at once."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.openai_choice import Choice
from scheduler_svc.openai_fields import HttpError
from scheduler_svc.openai_protocol import build_request
from scheduler_svc.openai_tools import fallback_messages, native_messages, tool_plan
from scheduler_svc.output import StreamDelta
from scheduler_svc.request import FinishReason
from scheduler_svc.tool_parser import Events, ToolParser
from scheduler_svc.validation import structured_constraint

TOOLS = ["get_weather", "search"]


def parse(mode: str, pieces: list[str], **kw):
    """(content, [(name, arguments)], [(index, name, concatenated argument fragments)])."""
    ids = iter(f"id{i}" for i in range(100))
    parser = ToolParser(mode, call_id=lambda: next(ids), **kw)
    events = Events()
    for piece in pieces:
        events.merge(parser.feed(piece))
    events.merge(parser.finish())
    streamed: dict[int, list] = {}
    for d in events.calls:
        entry = streamed.setdefault(d.index, [d.id, d.name, ""])
        assert (d.id is None) == (d.name is None)  # id and name come together, once
        entry[2] += d.arguments
    calls = [(c.id, c.name, c.arguments) for c in parser.calls]
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls  # the stream adds up to the calls
    return events.content, [(name, args) for _, name, args in calls]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
CASES = [  # (mode, text, kwargs, content, calls)
    ("auto", f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n", {}, "Sure.", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (
        "auto",
        '<tool_call>{"arguments": {"q": "a\\"}</tool_call>"}, "name": "search"}</tool_call><tool_call>'
        '{"name": "get_weather", "parameters": {}}</tool_call>',
        {},
        "",
        [("search", '{"q": "a\\"}</tool_call>"}'), ("get_weather", "{}")],
    ),
    ("auto", f" {WEATHER} ", {}, "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("auto", f"[{WEATHER}, {{\"name\": \"search\", \"arguments\": 1}}]", {}, "", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("search", "1")]),
    ("auto", '{"name": "Alice", "age": 3}', {}, '{"name": "Alice", "age": 3}', []),
    ("auto", '{"answer": 3} ', {}, '{"answer": 3} ', []),
    ("auto", "Hello <tool_ world", {}, "Hello <tool_ world", []),
    ("auto", "Hi <tool_call>not json</tool_call> bye", {}, "Hi <tool_call>not json</tool_call> bye", []),
    ("auto", 'x <tool_call>{"name": "search", "arguments": {"q": 1', {}, "x", [("search", '{"q": 1')]),
    ("auto", "plain answer\n", {}, "plain answer\n", []),
    ("required", '[{"name": "search", "parameters": {"q": "x"}}, {"name": "get_weather", "parameters": {}}]', {}, "", [("search", '{"q": "x"}'), ("get_weather", "{}")]),
    ("named", ' {"city": "Oslo"} ', {"named": "get_weather"}, "", [("get_weather", '{"city": "Oslo"}')]),
    ("named", "", {"named": "get_weather"}, "", [("get_weather", "{}")]),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "text", "kw", "content", "calls"), CASES)
def test_fixed_texts(mode, text, kw, content, calls):
    kw = {"tool_names": TOOLS, **kw}
    assert parse(mode, [text], **kw) == (content, calls)
    assert parse(mode, list(text), **kw) == (content, calls)  # one character per delta


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_split_of_a_fixed_text_parses_the_same(case, data):
    mode, text, kw, content, calls = case
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(mode, pieces, tool_names=TOOLS, **kw) == (content, calls)


_args = st.dictionaries(st.text('abc"\\ <>/{}', max_size=4), st.integers() | st.text('xy"}< ', max_size=5), max_size=3)
_content = st.text('ab <>{}\n"_/tolca', max_size=12)


@st.composite
def outputs(draw):
    """A Hermes-format output: content and well-formed calls, with the expected parse."""
    parts, calls = [], []
    for _ in range(draw(st.integers(0, 3))):
        name, args = draw(st.sampled_from(TOOLS)), draw(_args)
        call = {"name": name, "arguments": args} if draw(st.booleans()) else {"arguments": args, "name": name}
        spaced = draw(st.sampled_from(["", "\n", " "]))
        parts.append(f"{spaced}<tool_call>{spaced}{json.dumps(call)}{spaced}</tool_call>")
        calls.append((name, args))
    lead = draw(_content)
    return lead + "".join(parts), calls


@settings(max_examples=300, deadline=None)
@given(sample=outputs(), data=st.data())
def test_generated_calls_parse_whole_and_split(sample, data):
    text, expected = sample
    whole_content, whole_calls = parse("auto", [text], tool_names=TOOLS)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=20)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert parse("auto", pieces, tool_names=TOOLS) == (whole_content, whole_calls)
    # A text that opens with { or [ is read as a bare JSON call first (the tags are then content).
    if expected and text.lstrip()[:1] not in ("{", "["):
        tail = [(n, json.loads(a)) for n, a in whole_calls[-len(expected) :]]
        assert tail == expected


def test_tool_plan_rules_and_forced_schemas():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    assert tool_plan({"tools": tools}).choice == "auto"
    plan = tool_plan({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert plan.choice == "named" and json.loads(plan.constraint().spec) == tools[0]["function"]["parameters"]
    plan = tool_plan({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(plan.constraint().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert tool_plan({"tools": tools, "tool_choice": "none"}).constraint() is None
    for body, param in [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
        ({"tools": tools, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "code"}]}, "tools"),
    ]:
        with pytest.raises(HttpError) as err:
            tool_plan(body)
        assert err.value.param == param


def test_messages_for_templates_with_and_without_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "tool", "content": "43", "tool_call_id": "c2"},
    ]
    native = native_messages(messages)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and native[2] == messages[2]
    fallback = fallback_messages(messages, tools)
    assert [m["role"] for m in fallback] == ["system", "user", "assistant", "user"]
    assert json.dumps(tools[0]) in fallback[0]["content"] and "<tool_call>" in fallback[0]["content"]
    assert fallback[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert fallback[3]["content"] == "<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response>"
    with_system = fallback_messages([{"role": "system", "content": "Be brief."}, *messages[:1]], tools)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 2


HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
NEUTRAL = {"disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": ""}
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f=g>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f="],
}


@pytest.mark.parametrize(
    ("extra", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", 'start: "a"'),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": "\\d+"}, "regex", "\\d+"),
        ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
        ({"guided_grammar": "start: \"x\""}, "grammar", 'start: "x"'),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": TAG}, "structural_tag", TAG),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, "structural_tag", TAG),
        ({"structured_outputs": {"structural_tag": TAG}}, "structural_tag", TAG),
        ({"structural_tag": json.dumps(TAG)}, "structural_tag", TAG),
        # vLLM's defaults of the JSON options, as clients that send every field send them: no-ops
        ({"structured_outputs": {"regex": "[ab]+", **NEUTRAL}}, "regex", "[ab]+"),
        ({"structured_outputs": NEUTRAL}, None, None),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_additional_properties": False}}, "json_schema", SCHEMA),
    ],
)  # fmt: skip
def test_structured_output_fields_become_one_grpc_constraint(extra, kind, spec):
    for chat, base in ((True, {"messages": HI}), (False, {"prompt": "hi"})):
        request = build_request({**base, **extra}, chat).proto
        constraint = structured_constraint(request.sampling)
        if kind is None:
            assert constraint is None
            continue
        assert constraint.kind == kind
        got = json.loads(constraint.spec) if kind in ("json_schema", "choice", "structural_tag") else constraint.spec
        assert got == spec


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),  # no JSON to apply it to
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "structured_outputs"),
        ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": 3}, "guided_whitespace_pattern"),
        (
            {"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True, "whitespace_pattern": " "}},
            "structured_outputs",
        ),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": "yes"}}, "structured_outputs"),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_additional_properties": 1}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"response_format": {**TAG, "triggers": ["<g"]}}, "response_format"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"structural_tag": json.dumps(TAG), "guided_regex": "a"}, "structural_tag"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_structured_output_fields_are_400s_naming_them(extra, param):
    with pytest.raises(HttpError) as err:
        build_request({"messages": HI, **extra}, chat=True)
    assert err.value.param == param and err.value.status == 400


COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
ANY_SPACE = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}


@pytest.mark.parametrize(
    ("extra", "schema"),
    [
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True}}, {**SCHEMA, "x-guidance": COMPACT}),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": False}}, {**SCHEMA, "x-guidance": ANY_SPACE}),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, {"type": "object", "x-guidance": COMPACT}),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}}, {**SCHEMA, "x-guidance": {**ANY_SPACE, "whitespace_pattern": "[ ]?"}}),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": "\\n?"}, {**SCHEMA, "x-guidance": {**ANY_SPACE, "whitespace_pattern": "\\n?"}}),
        (
            {"response_format": TAG, "structured_outputs": {"disable_any_whitespace": True}},
            {**TAG, "structures": [{**TAG["structures"][0], "schema": {**SCHEMA, "x-guidance": COMPACT}}]},
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, "structured_outputs": {"disable_additional_properties": True}},
            {**SCHEMA, "additionalProperties": False},
        ),
        ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": None}}, SCHEMA),  # null: not given
    ],
)  # fmt: skip
def test_structured_outputs_json_options_are_written_into_the_schema(extra, schema):
    """vLLM's structured_outputs options (and the older guided_whitespace_pattern) apply to the
    request's JSON constraint, whichever field it came from, as llguidance's x-guidance options."""
    for chat, base in ((True, {"messages": HI}), (False, {"prompt": "hi"})):
        constraint = structured_constraint(build_request({**base, **extra}, chat).proto.sampling)
        assert constraint.kind == ("structural_tag" if "triggers" in schema else "json_schema")
        assert json.loads(constraint.spec) == schema


def test_forced_tool_choice_is_a_json_schema_constraint():
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    body = {"messages": HI, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    built = build_request(body, chat=True)
    assert json.loads(structured_constraint(built.proto.sampling).spec) == SCHEMA
    assert built.prompt.tools == tools
    auto = build_request({**body, "tool_choice": "auto"}, chat=True)
    assert not auto.proto.sampling.HasField("structured")


def _choice_outputs(choice_kw, text, reason=FinishReason.STOP, cuts=(3, 9, 30)):
    """(non-streamed message, streamed deltas) of one text through Choice.body."""
    whole = Choice(None, True, False, **choice_kw).body(
        StreamDelta(text=text, finished=True, finish_reason=reason), stream=False
    )
    streamer = Choice(None, True, False, **choice_kw)
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)]) if i < len(text)]
    deltas = [streamer.body(StreamDelta(text=p), stream=True) for p in pieces]
    deltas.append(streamer.body(StreamDelta(finished=True, finish_reason=reason), stream=True))
    return whole, deltas


def test_choice_bodies_carry_tool_calls_whole_and_streamed():
    tools = tool_plan({"tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    text = f"Let me check.<tool_call>{WEATHER}</tool_call>"
    whole, deltas = _choice_outputs({"tools": tools}, text)
    assert whole["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    content = "".join(d["delta"].get("content", "") for d in deltas)
    fragments = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert content == "Let me check."
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["type"] == "function"
    assert all("id" not in f and "name" not in f["function"] for f in fragments[1:])
    assert "".join(f["function"]["arguments"] for f in fragments) == call["function"]["arguments"]
    plain, _ = _choice_outputs({"tools": tools}, "No tools needed.")
    assert plain["message"] == {"role": "assistant", "content": "No tools needed."} and plain["finish_reason"] == "stop"
    named = tool_plan({"tools": tools.tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    whole, _ = _choice_outputs({"tools": named}, '{"city": "Oslo"}')
    assert whole["finish_reason"] == "stop" and whole["message"]["content"] is None  # OpenAI's for a forced function
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    cut, _ = _choice_outputs({"tools": named}, '{"city": "Os', reason=FinishReason.LENGTH)
    assert cut["finish_reason"] == "length"


def test_grpc_constraint_field_round_trip():
    request = build_request({"prompt": "x", "guided_choice": ["a", "b"]}, chat=False).proto
    assert list(request.sampling.structured.choice.choices) == ["a", "b"]
    assert pb.GenerateRequest.FromString(request.SerializeToString()) == request
