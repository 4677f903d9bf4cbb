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
# grammar: a Lark grammar (llguidance's dialect, docs: guidance-ai/llguidance docs/syntax.md).
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Bounds a spec before any compile work: a schema or grammar this long is not a real one.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


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
