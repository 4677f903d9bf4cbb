"""The client examples under examples/ stay correct without their language's toolchain.

CI runs no Node, so examples/node/generate.js is checked by reading it: every field it sets or
reads exists in the chunkserve.v1 messages (from the generated descriptors, so a renamed field
fails here), the proto it loads exists, the package, service and methods exist, and
proto-loader gets the five options the README says Node needs. Where `node` is on PATH the
file must also parse (`node --check`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from chunkserve_contracts.v1 import chunkserve_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
NODE_EXAMPLE = ROOT / "examples" / "node" / "generate.js"
# What proto-loader needs for this API (README, "Other languages").
LOADER_OPTIONS = {"keepCase": "true", "enums": "String", "longs": "String", "defaults": "true", "oneofs": "true"}


def _code(js: str) -> str:
    """The source without comments and string contents; the `${...}` expressions inside
    template literals are kept (they are code: `${msg.usage.prompt_tokens}`)."""
    js = re.sub(r"^\s*//.*$|\s//.*$", "", js, flags=re.MULTILINE)
    js = re.sub(r"`[^`]*`", lambda m: " ".join(re.findall(r"\$\{([^}]*)\}", m.group(0))), js)
    return re.sub(r'"[^"\n]*"', '""', js)


def _literal(code: str, start: int) -> str:
    """The balanced {...} object literal that opens at or after code[start]."""
    i = code.index("{", start)
    depth = 0
    for j in range(i, len(code)):
        depth += {"{": 1, "}": -1}.get(code[j], 0)
        if depth == 0:
            return code[i : j + 1]
    raise AssertionError("unbalanced braces")


def _check_literal(literal: str, message) -> list[str]:
    """Every key of a (nested) object literal is a field of `message`; returns the paths."""
    stack, seen = [message], []
    for key, opens, closes in re.findall(r"(\w+)\s*:\s*(\{)?|(\})", literal[1:]):
        if closes:
            stack.pop()
            continue
        fields = stack[-1].fields_by_name
        assert key in fields, f"{stack[-1].full_name} has no field {key!r}"
        seen.append(f"{stack[-1].name}.{key}")
        if opens:
            assert fields[key].message_type is not None, f"{key} is not a message"
            stack.append(fields[key].message_type)
    return seen


@pytest.fixture(scope="module")
def js() -> str:
    return NODE_EXAMPLE.read_text()


def test_node_example_loads_the_proto_with_the_options_it_needs(js):
    code = _code(js)
    parts = re.search(r"path\.join\(__dirname,([^)]*)\)", js).group(1)
    proto = NODE_EXAMPLE.parent.joinpath(*re.findall(r'"([^"]+)"', parts)).resolve()
    assert proto == ROOT / "protos" / "chunkserve" / "v1" / "chunkserve.proto" and proto.is_file()
    options = _literal(code, code.index("const options"))
    assert dict(re.findall(r"(\w+)\s*:\s*(\w+)", options)) == LOADER_OPTIONS
    assert "loadSync(PROTO, options)" in code
    package = re.search(r"loadPackageDefinition\([^;]*\)\)\.([\w.]+);", code).group(1)
    assert package == pb.DESCRIPTOR.package
    services = re.search(r"const \{\s*([\w\s,]+)\}\s*=\s*grpc\.loadPackageDefinition", code).group(1)
    for name in re.findall(r"\w+", services):
        assert name in pb.DESCRIPTOR.services_by_name, name
    methods = set(pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name)
    called = re.findall(r"\bclient\.([A-Z]\w*)\(", code)
    assert called and set(called) <= methods, called


def test_node_example_uses_only_fields_the_messages_have(js):
    code = _code(js)
    request = _literal(code, code.index("const request"))
    sent = _check_literal(request, pb.GenerateRequest.DESCRIPTOR)
    assert "SamplingParams.max_tokens" in sent  # explicit: unset means only 16 tokens
    read = set()
    for chain in re.findall(r"\bmsg((?:\.\w+)+)", code):  # the stream's messages are `msg`
        message = pb.GenerateResponse.DESCRIPTOR
        for name in chain.split(".")[1:]:
            assert message is not None, f"msg{chain}: {name} of a scalar"
            assert name in message.fields_by_name, f"{message.full_name} has no field {name!r} (msg{chain})"
            read.add(f"{message.name}.{name}")
            message = message.fields_by_name[name].message_type
    # The first message (id, prompt tokens), the text, and the finish reason and usage at the end.
    assert {"GenerateResponse.request_id", "GenerateResponse.text", "GenerateResponse.finished"} <= read
    assert {"GenerateResponse.finish_reason", "Usage.completion_tokens", "Usage.prompt_tokens"} <= read


def test_the_checks_catch_a_wrong_field():
    code = _code('const request = { text: "x", sampling: { maxTokens: 3 } };')
    with pytest.raises(AssertionError, match="maxTokens"):
        _check_literal(_literal(code, 0), pb.GenerateRequest.DESCRIPTOR)


@pytest.mark.skipif(not shutil.which("node"), reason="node is not installed (CI does not need it)")
def test_node_example_parses():
    out = subprocess.run(["node", "--check", str(NODE_EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
