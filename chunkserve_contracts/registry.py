"""One small registry shape for everything chosen by name: policies, attention backends, models.

A registry maps a name to a `"module:Attr"` string, imported only when that name is first
asked for (so a CPU machine never imports flash-attn or Triton, and the scheduler never
imports a model), or to the object itself. Unknown names fail with a ValueError that lists
the known ones. Optionally a registry also accepts a dotted path (`package.module:Class` or
`package.module.Class`) for a user's own class, the way `--scheduling-policy` does.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, loaded lazily."""

    def __init__(self, kind: str, entries: dict[str, str | T] | None = None, allow_dotted_path: bool = False) -> None:
        self.kind = kind  # for messages: "attention backend", "scheduling policy", ...
        self.allow_dotted_path = allow_dotted_path
        self._entries: dict[str, str | T] = dict(entries or {})

    def register(self, name: str, target: str | T) -> None:
        """Makes `target` (an object, or "module:Attr" imported on first use) selectable as name."""
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        """The entry registered as name (imported now if it was a string), or, where allowed,
        the object a dotted path names. ValueError says what is known."""
        if name in self._entries:
            target = self._entries[name]
            if isinstance(target, str):
                target = self._entries[name] = _import(target)
            return target
        module_name, sep, attr = name.replace(":", ".").rpartition(".")
        if not (self.allow_dotted_path and sep and module_name):
            more = " or a dotted path to a class" if self.allow_dotted_path else ""
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}{more}")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {self.kind} {name!r}: {exc}") from exc


def _import(target: str):  # noqa: ANN202 - whatever the module holds
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
