"""Structured output: what a request's output must match (the Constraint value).

A Constraint is plain data, checked for shape when it is made (Constraint.make), so both
fronts (gRPC SamplingParams.structured, the OpenAI response_format / tools / guided_*) build
the same value and the engine never sees a malformed one. Whether the grammar compiles is
decided later, off the event loop, by scheduler_svc/grammar.py (llguidance): a grammar that
does not compile ends the request with INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# json_object: any JSON object (spec ""); json_schema: the schema as JSON text; regex: the
# whole output matches it; choice: a JSON list of strings, the output is one of them;
# grammar: a Lark grammar (llguidance's dialect, docs: guidance-ai/llguidance docs/syntax.md);
# structural_tag: vLLM's structural tags as JSON text, {"structures": [{"begin", "schema", "end"}],
# "triggers": [...]}: free text, in which each structure, once its trigger is written, is its
# begin text, a JSON value of its schema and its end text (tool calls inside running text).
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
# Bounds a spec before any compile work: a schema or grammar this long is not a real one.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_STRUCTURES = 128


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match: one of CONSTRAINT_KINDS and its spec text."""

    kind: str  # one of CONSTRAINT_KINDS
    spec: str  # schema JSON text / regex / JSON list of choice strings / Lark grammar; "" for json_object

    @staticmethod
    def make(kind: str, spec: str = "") -> Constraint:
        """A checked Constraint. Raises ValueError with a message fit for the client (the
        servicer maps it to INVALID_ARGUMENT, the HTTP front to 400) when the kind is
        unknown, the spec is missing, too long, or not of its kind's shape (a schema that is
        not a JSON object, a choice list that is not a non-empty list of non-empty strings).
        Compiling is not done here: it may take long and runs off the event loop."""
        if kind not in CONSTRAINT_KINDS:
            raise ValueError(f"unknown constraint kind {kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
        if not isinstance(spec, str):
            raise ValueError(f"{kind}: the spec must be a string")
        if len(spec) > MAX_SPEC_CHARS:
            raise ValueError(f"{kind}: the spec has {len(spec)} characters; at most {MAX_SPEC_CHARS}")
        if kind == "json_object":
            if spec:
                raise ValueError("json_object takes no spec")
            return Constraint(kind, "")
        if not spec:
            raise ValueError(f"{kind}: the spec is empty")
        if kind == "json_schema":
            _check_schema(spec)
        elif kind == "choice":
            _check_choices(spec)
        elif kind == "structural_tag":
            _check_structural_tag(spec)
        return Constraint(kind, spec)

    @staticmethod
    def choices(options: list[str] | tuple[str, ...]) -> Constraint:
        """A choice constraint from a list of strings (checked as make does)."""
        return Constraint.make("choice", json.dumps(list(options)))


def _check_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")


def _check_structural_tag(spec: str) -> None:
    """vLLM's structural tag format: structures of begin / schema / end, each begin starting with
    one of the triggers (xgrammar's newer `format` form is not llguidance's, so it is refused)."""
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {type(tag).__name__}")
    if unknown := sorted(set(tag) - {"type", "structures", "triggers"}):
        raise ValueError(f"structural_tag.{unknown[0]} is not supported: give structures and triggers")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag.type must be structural_tag, got {tag['type']!r}")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not 0 < len(structures) <= MAX_STRUCTURES:
        raise ValueError(f"structural_tag.structures must be a list of 1 to {MAX_STRUCTURES} structures")
    for s in structures:
        if not isinstance(s, dict) or set(s) != {"begin", "schema", "end"}:
            raise ValueError("each of structural_tag.structures must be an object of exactly begin, schema and end")
        if not isinstance(s["begin"], str) or not isinstance(s["end"], str) or not isinstance(s["schema"], dict):
            raise ValueError("a structure's begin and end must be strings and its schema a JSON object")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag: the begin {s['begin']!r} starts with none of the triggers")


def _check_choices(spec: str) -> None:
    try:
        options = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choice is not a JSON list of strings: {exc}") from None
    if not isinstance(options, list) or not options:
        raise ValueError("choice must be a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"choice has {len(options)} options; at most {MAX_CHOICES}")
    for option in options:
        if not isinstance(option, str) or not option:
            raise ValueError(f"choice options must be non-empty strings, got {option!r}")


# JSON keywords whose value is one subschema, a map of them, or a list of them (Draft 2020-12
# and the older `definitions`, `items` as a list): where _close_objects looks for objects.
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def with_json_options(
    constraint: Constraint,
    *,
    any_whitespace: bool | None = None,
    whitespace_pattern: str | None = None,
    close_objects: bool = False,
) -> Constraint:
    """A JSON constraint with vLLM's structured_outputs options, written into its schema.

    Why in the schema: llguidance reads a schema's top-level `x-guidance` options (the
    whitespace between JSON tokens, the separators), so the options travel in the spec a gRPC
    client could have written itself, and requests that differ only in them never share a
    compiled grammar. As vLLM's guidance backend: `any_whitespace` True allows any whitespace
    between tokens (`disable_any_whitespace: false`), False none at all (`true`; separators
    "," and ":"), None keeps chunkserve's default (", " and ": ", no other whitespace);
    `whitespace_pattern` is the regex whitespace must match instead; `close_objects`
    (`disable_additional_properties`) makes every object that lists properties and says nothing
    of others allow no others. A structural tag gets them in each structure's schema, as vLLM
    applies them. ValueError, fit for the client, when the constraint has no JSON or the
    options contradict each other."""
    if constraint.kind not in ("json_schema", "json_object", "structural_tag"):
        raise ValueError(
            f"applies to JSON output (a schema, any JSON object, structural tags), not to {constraint.kind}"
        )
    if any_whitespace is False and whitespace_pattern is not None:
        raise ValueError("disable_any_whitespace and whitespace_pattern contradict each other")
    if any_whitespace is None and whitespace_pattern is None and not close_objects:
        return constraint

    def apply(schema: dict) -> None:
        if close_objects:
            _close_objects(schema)
        if any_whitespace is not None or whitespace_pattern is not None:
            options = dict(schema.get("x-guidance") or {})
            options.update(whitespace_flexible=any_whitespace is not False, item_separator=",", key_separator=":")
            if whitespace_pattern is not None:
                options["whitespace_pattern"] = whitespace_pattern
            schema["x-guidance"] = options

    if constraint.kind == "structural_tag":
        tag = json.loads(constraint.spec)
        for structure in tag["structures"]:
            apply(structure["schema"])
        return Constraint.make("structural_tag", json.dumps(tag))
    schema = json.loads(constraint.spec) if constraint.kind == "json_schema" else {"type": "object"}
    apply(schema)
    return Constraint.make("json_schema", json.dumps(schema))


def _close_objects(schema: object) -> None:
    """Adds `additionalProperties: false` to every object schema under `schema` that lists
    properties (or property patterns) and does not say whether others are allowed. Walks the
    subschema keywords only, so a property that happens to be named `properties` is left alone."""
    if not isinstance(schema, dict):
        return
    for key in _ONE_SCHEMA:
        _close_objects(schema.get(key))
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _close_objects(sub)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                _close_objects(sub)
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False


class GrammarMatcher(Protocol):
    """One request's grammar state (scheduler_svc/grammar.py has the llguidance one): the mask
    of the next token, and the tokens output so far fed in order."""

    def token_mask(self) -> bytes:
        """The next token's packed mask: ceil(vocab_size / 32) little-endian 32-bit words,
        bit i (word i // 32, bit i % 32) set when token i is allowed."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advances by an output token; False when the grammar does not allow it."""
        ...

    def draft_masks(self, draft: Sequence[int]) -> list[bytes]:
        """Speculative decoding: the next-token masks after each token of the longest prefix of
        `draft` the grammar allows (row j after its first j + 1 tokens); the state is left as it
        was (the drafts may be rejected)."""
        ...

    def is_stopped(self) -> bool:
        """Whether the grammar is complete: no token but EOS can follow (the request ends)."""
        ...
