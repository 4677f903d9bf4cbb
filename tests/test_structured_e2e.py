"""Structured output through both real processes over gRPC (slow): the tiny random-weight
model with the default model's tokenizer writes nonsense, so any valid output is the
constraint's doing. A JSON schema's output parses and validates (jsonschema), greedy and at
temperature 1; choices and regexes match; a constraint that does not compile is
INVALID_ARGUMENT; greedy constrained tokens do not depend on chunking, async scheduling or
preemption; nothing leaks."""

from __future__ import annotations

import concurrent.futures
import json
import re

import grpc
import jsonschema
import pytest

from chunkserve.client import Completion, build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb

pytestmark = pytest.mark.slow

# Bounded everywhere (string lengths, item counts, integer ranges): random weights would
# otherwise write digits or characters until max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
        "size": {"anyOf": [{"type": "null"}, {"enum": ["s", "m", "l"]}]},
    },
    "required": ["name", "kind", "tags", "ok", "n", "owner", "size"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a pet as JSON:", "The quick brown fox " * 30, "x"]


def _run(server, prompt, **sampling) -> Completion:
    done = Completion()
    for msg in server.stub().Generate(build_request(prompt, **sampling), timeout=120):
        done.add(msg)
    return done


@pytest.fixture(scope="module")
def tiny_server(tiny_model_path, launch):
    return launch(
        ["--model", str(tiny_model_path), "--dtype", "float32", "--max-num-batched-tokens", "64"],
        ["--max-num-batched-tokens", "64"],
    )


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "tiny_server" in request.fixturenames:
        request.getfixturevalue("tiny_server").assert_idle_and_no_leaks()


def test_json_schema_outputs_parse_and_validate(tiny_server):
    structured = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    for prompt in PROMPTS:
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
            out = _run(tiny_server, prompt, max_tokens=300, structured=structured, **sampling)
            assert out.finish_reason == pb.FINISH_REASON_STOP, out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_choice_regex_and_grammar(tiny_server):
    out = _run(tiny_server, "x", max_tokens=200, temperature=0.0, structured=pb.StructuredOutput(json_object=True))
    # Any object: keys and values are the model's (unbounded), so it may run out of tokens;
    # what it wrote is then the start of an object.
    assert out.text.startswith("{")
    if out.finish_reason == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(out.text), dict)
    choices = ["red", "green", "blue whale"]
    out = _run(tiny_server, "y", max_tokens=20, structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=choices)))
    assert out.text in choices and out.finish_reason == pb.FINISH_REASON_STOP
    out = _run(tiny_server, "z", max_tokens=30, structured=pb.StructuredOutput(regex=r"[A-Z]{2}-[0-9]{3}"))
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.text) and out.finish_reason == pb.FINISH_REASON_STOP
    grammar = 'start: "(" num ("+" num)? ")"\nnum: /[1-9]/'
    out = _run(tiny_server, "w", max_tokens=30, structured=pb.StructuredOutput(grammar=grammar))
    assert re.fullmatch(r"\([1-9](\+[1-9])?\)", out.text)


def test_bad_constraints_are_invalid_argument(tiny_server):
    for structured, words in [
        (pb.StructuredOutput(grammar="start: missing"), "does not compile"),
        (pb.StructuredOutput(json_schema='{"type": "nope"}'), "does not compile"),
        (pb.StructuredOutput(json_schema="[1]"), "sampling.structured.json_schema"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            _run(tiny_server, PROMPTS[1], max_tokens=10, structured=structured)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


@pytest.mark.parametrize(
    "executor_args, scheduler_args",
    [
        ([], ["--max-num-batched-tokens", "16"]),
        ([], ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"]),
        ([], ["--async-scheduling", "--max-num-batched-tokens", "16"]),
        (["--num-gpu-blocks-override", "16", "--block-size", "16"], ["--preemption-mode", "recompute"]),
    ],
    ids=["chunk16", "whole", "async", "preempt"],
)
def test_constrained_greedy_tokens_do_not_depend_on_the_server_settings(
    tiny_model_path, tiny_server, launch, executor_args, scheduler_args
):
    structured = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    prompts = ["Describe a pet as JSON:", "The quick brown fox " * 10, "x"]  # with 150 tokens, fit 256

    def run(server, prompt):
        return _run(server, prompt, max_tokens=150, temperature=0.0, structured=structured)

    expected = [run(tiny_server, p).token_ids for p in prompts]
    other = launch(["--model", str(tiny_model_path), "--dtype", "float32", *executor_args], scheduler_args)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # at once: preemption when the pool is small
            got = list(pool.map(lambda p: run(other, p), prompts))
        assert [c.token_ids for c in got] == expected
        other.assert_idle_and_no_leaks()
    finally:
        other.stop()
