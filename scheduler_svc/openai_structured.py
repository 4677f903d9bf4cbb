"""Structured output over the OpenAI API: response_format, vLLM's structured_outputs and its
older guided_* fields, each becoming one checked Constraint (scheduler_svc/structured.py) that
travels in the GenerateRequest's SamplingParams.structured like a gRPC client's.

One source per request: two of them (or one with a forced tool choice) is a 400, where vLLM
would silently prefer one. A constraint the server cannot compile still ends the request with
a 400 (the grammar is compiled off the event loop, scheduler_svc/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.openai_fields import bad, get
from scheduler_svc.structured import Constraint, with_json_options

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",  # vLLM's older top-level field (JSON text)
}
_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
}
# structured_outputs options accepted where they change nothing here (any other name is a 400).
_OUTPUT_NO_EFFECT = {"disable_fallback": "llguidance never falls back", "backend": None}
# structured_outputs options of a JSON constraint (structured.with_json_options): name -> type.
_JSON_OPTIONS = {"disable_any_whitespace": bool, "whitespace_pattern": str, "disable_additional_properties": bool}
BACKENDS = (None, "auto", "guidance", "llguidance")  # what chunkserve compiles with (guidance = llguidance)


def structured_constraint(body: dict[str, Any]) -> tuple[str, Constraint] | None:
    """(the field it came from, the Constraint) for the body's structured-output fields."""
    found: list[tuple[str, Constraint]] = []
    if (fmt := get(body, "response_format", (dict,), "an object")) is not None:
        if (c := _response_format(fmt)) is not None:
            found.append(("response_format", c))
    if (outputs := get(body, "structured_outputs", (dict,), "an object")) is not None:
        found += [("structured_outputs", c) for c in _structured_outputs(outputs)]
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _make(name, kind, body[name])))
    backend = body.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise bad(
            "guided_decoding_backend", f"guided_decoding_backend {backend!r}: only llguidance (guidance) runs here"
        )
    if len(found) > 1:
        names = " and ".join(sorted({n for n, _ in found}))
        raise bad(found[1][0], f"one structured-output constraint per request: got {names}")
    return _with_options(body, outputs or {}, found[0] if found else None)


def _with_options(
    body: dict[str, Any], outputs: dict[str, Any], found: tuple[str, Constraint] | None
) -> tuple[str, Constraint] | None:
    """The constraint with the request's JSON options (structured_outputs' whitespace and
    additional-properties switches, the older guided_whitespace_pattern) applied, whichever
    field the constraint came from. With no JSON constraint to apply to, false and "" (vLLM's
    defaults, which clients that send every field send) change nothing; anything else is a 400."""
    options = {k: outputs[k] for k in _JSON_OPTIONS if outputs.get(k) is not None}
    if options.get("disable_additional_properties") is False:
        del options["disable_additional_properties"]  # its default: nothing to do for any constraint
    for key, kind in _JSON_OPTIONS.items():
        if key in options and not isinstance(options[key], kind):
            raise bad("structured_outputs", f"structured_outputs.{key} must be a {kind.__name__}")
    field = "structured_outputs"
    if (pattern := body.get("guided_whitespace_pattern")) is not None:
        if not isinstance(pattern, str) or "whitespace_pattern" in options:
            raise bad("guided_whitespace_pattern", "guided_whitespace_pattern must be a string (and given once)")
        options["whitespace_pattern"], field = pattern, "guided_whitespace_pattern"
    if found is None or found[1].kind not in ("json_schema", "json_object", "structural_tag"):
        options = {k: v for k, v in options.items() if v not in (False, "")}
    if not options:
        return found
    if found is None:
        raise bad(
            field,
            f"{field}: {', '.join(sorted(options))} needs a JSON constraint (json, json_object, structural_tag "
            "or response_format)",
        )
    try:
        constraint = with_json_options(
            found[1],
            any_whitespace=None if "disable_any_whitespace" not in options else not options["disable_any_whitespace"],
            whitespace_pattern=options.get("whitespace_pattern"),
            close_objects=options.get("disable_additional_properties", False),
        )
    except ValueError as exc:
        raise bad(field, f"{field}: {exc}") from None
    return found[0], constraint


def set_proto(s: pb.SamplingParams, constraint: Constraint) -> None:
    """The constraint in SamplingParams.structured (validation.structured_constraint reads it back)."""
    if constraint.kind == "choice":
        s.structured.choice.choices.extend(json.loads(constraint.spec))
    elif constraint.kind == "json_object":
        s.structured.json_object = True
    else:
        setattr(s.structured, constraint.kind, constraint.spec)


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.make("json_object")
    if kind == "structural_tag":  # vLLM: {"type": "structural_tag", "structures": [...], "triggers": [...]}
        return _make("response_format", "structural_tag", fmt)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format", "response_format.json_schema.schema must be a JSON schema object")
        if not isinstance(spec.get("strict"), bool | None):
            raise bad("response_format", "response_format.json_schema.strict must be a boolean")
        return _make("response_format", "json_schema", schema)  # strict or not, the output follows it
    raise bad(
        "response_format",
        f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}",
    )


def _structured_outputs(outputs: dict[str, Any]) -> list[Constraint]:
    found = [
        _make("structured_outputs", kind, outputs[key])
        for key, kind in _OUTPUTS.items()
        if outputs.get(key) is not None
    ]
    if outputs.get("json_object"):
        found.append(Constraint.make("json_object"))
    if outputs.get("backend") not in BACKENDS:
        raise bad("structured_outputs", "structured_outputs.backend: only llguidance (guidance) runs here")
    known = set(_OUTPUTS) | {"json_object", *_OUTPUT_NO_EFFECT, *_JSON_OPTIONS}
    if unknown := sorted(set(outputs) - known):
        raise bad("structured_outputs", f"structured_outputs.{unknown[0]} is not a structured_outputs field")
    return found


def _make(field: str, kind: str, value: Any) -> Constraint:
    """A Constraint from a field's value: a schema as an object or its JSON text, a regex or
    grammar as text, choices as a list of strings."""
    if kind in ("json_schema", "structural_tag") and isinstance(value, dict):
        value = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list):
            raise bad(field, f"{field}: choice must be a list of strings")
        value = json.dumps(value)
    if not isinstance(value, str):
        raise bad(field, f"{field}: {kind} must be a string")
    try:
        return Constraint.make(kind, value)
    except ValueError as exc:
        raise bad(field, f"{field}: {exc}") from None
