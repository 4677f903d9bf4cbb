"""Scheduling policies: they order the waiting queue and pick preemption victims, nothing else.

Budget arithmetic and block allocation stay in the scheduler, so a policy is a few lines
and cannot break the step invariants. Policies are registered by name; a dotted import
path (`package.module:Class` or `package.module.Class`) loads a user's own.
"""
from __future__ import annotations

import importlib
from typing import Callable, Protocol, Sequence

from scheduler_svc.request import Request


class Policy(Protocol):
    """What the scheduler asks of a policy."""

    name: str

    def order_waiting(self, waiting: Sequence[Request]) -> list[Request]:
        """Returns the waiting requests in the order they should be admitted."""
        ...

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """Chooses which of the running requests (never empty) to preempt."""
        ...


class FCFS:
    """First come, first served; the most recently arrived request is preempted first."""

    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.arrival_time, r.seq_id))

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.arrival_time, r.seq_id))


_REGISTRY: dict[str, Callable[[], Policy]] = {"fcfs": FCFS}


def register_policy(name: str, factory: Callable[[], Policy]) -> None:
    """Makes a policy selectable by name."""
    _REGISTRY[name] = factory


def create_policy(name: str) -> Policy:
    """A registered policy by name, or a class by dotted path."""
    if name in _REGISTRY:
        return _REGISTRY[name]()
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(_REGISTRY))} "
                         "or a dotted path to a class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load scheduling policy {name!r}: {exc}") from exc
    return cls()
