"""Command-line flags generated from config dataclasses, each also an environment variable.

Every config field becomes `--field-name` (booleans get `--no-field-name` too) and may be
set by `CHUNKSERVE_FIELD_NAME`; an explicit flag wins over the environment, which wins over
the default. The environment is read when the parser is built, never at import time.
The field's `metadata["help"]` is the flag's help text, so the dataclass stays the single
place a setting is documented; `metadata["aliases"]` adds other spellings (vLLM's `-tp`),
`metadata["names"]` named values (`auto`); `metadata["secret"]` keeps a value out of `--help` and out of
config_to_argv.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "CHUNKSERVE_"


def env_name(field_name: str) -> str:
    """The environment variable for a config field: CHUNKSERVE_<FIELD_NAME>."""
    return ENV_PREFIX + field_name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _base_type(annotation: Any) -> type:
    """int | None -> int; str -> str. Annotations are strings under `from __future__`, and
    config fields only use these scalars, optionally `| None`."""
    if isinstance(annotation, str):
        names = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
        if len(names) != 1 or names[0] not in _SCALARS:
            raise TypeError(f"config fields must be int, float, str or bool (optionally | None), got {annotation}")
        return _SCALARS[names[0]]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _with_names(kind: type, names: dict[str, Any]) -> Any:
    """kind's parser that also accepts the field's named values (metadata "names", e.g.
    {"auto": 0}); argparse's error still says "invalid int value"."""

    def convert(text: str) -> Any:
        key = text.strip().lower()
        return names[key] if key in names else kind(text)

    convert.__name__ = kind.__name__
    return convert


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = (), seen: set[str] | None = None
) -> None:
    """Adds one flag per field of the dataclass `cls` (fields in `skip` or `seen` are left out)."""
    seen = seen if seen is not None else set()
    for field in dataclasses.fields(cls):
        if field.name in skip or field.name in seen or not field.metadata.get("help"):
            continue
        seen.add(field.name)
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(field.type)
        convert = _with_names(kind, field.metadata["names"]) if field.metadata.get("names") else kind
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        env = os.environ.get(env_name(field.name))
        if env is not None and env != "":
            try:
                default = _parse_bool(env) if kind is bool else convert(env)
            except ValueError as exc:
                raise SystemExit(f"{env_name(field.name)}={env!r}: {exc}") from None
        shown = ("set" if default else "unset") if field.metadata.get("secret") else repr(default)
        help_text = f"{field.metadata['help']} [env {env_name(field.name)}; default {shown}]"
        flags = (flag, *field.metadata.get("aliases", ()))  # e.g. vLLM's -tp
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            choices = field.metadata.get("choices")
            parser.add_argument(*flags, type=convert, default=default, choices=choices, help=help_text)


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Builds `cls` from the parsed flags (fields the parser does not know keep defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)  # type: ignore[call-arg]


def config_to_argv(config: Any, skip: Iterable[str] = ()) -> list[str]:
    """The flags that reproduce `config` on another process's command line. Secret fields
    (metadata "secret") are left out: a command line is visible to everyone in `ps`, so
    secrets travel in the environment."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        if field.name in skip or not field.metadata.get("help") or field.metadata.get("secret"):
            continue
        value = getattr(config, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + field.name.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv
