"""Scheduling policies: they order the waiting queue and pick preemption victims, nothing else.

Budget arithmetic, chunking and block allocation stay in the scheduler, so a policy is a
few lines and cannot break a step invariant. The contract (docs/policies.md):

- `order_waiting(waiting, step)` returns the same requests in admission order. `step` is the
  scheduler's step counter, for aging (`request.arrival_step` is when it arrived).
- `pick_victim(candidates)` returns one of the (never empty) running candidates.
- `on_scheduled(request, num_tokens)`, optional, is told what each step gave each request.
  It is the one hook beyond ordering, because fairness needs to know who was served.

Policies are registered by name; a dotted path (`package.module.Class` or
`package.module:Class`) loads a user's own class, instantiated without arguments.
"""
from __future__ import annotations

import importlib
from collections import defaultdict
from typing import Callable, Protocol, Sequence

from scheduler_svc.request import Request


class Policy(Protocol):
    """What the scheduler asks of a policy."""

    name: str

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]: ...

    def pick_victim(self, candidates: Sequence[Request]) -> Request: ...


def _arrival(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.seq_id)


class FCFS:
    """First come, first served; the most recently arrived request is preempted first."""

    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=_arrival)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=_arrival)


class PriorityPolicy:
    """Lower `priority` first, then arrival; the victim is the lowest priority, latest arrival."""

    name = "priority"

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, *_arrival(r)))

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, *_arrival(r)))


class ShortestJobFirst:
    """Fewest tokens left to prefill first, with aging so that long prompts are not starved.

    A request's key shrinks by `aging_tokens_per_step` for every step it has waited, so a
    request with L tokens left can only be overtaken by requests of at most S tokens that
    arrived less than (L - S) / aging_tokens_per_step steps after it: behind a stream the
    server keeps up with, it starts within that many steps. The victim is the request with
    most work left.
    """

    name = "sjf"
    aging_tokens_per_step = 64

    def _key(self, r: Request, step: int) -> tuple[float, float, int]:
        return (r.num_remaining_tokens - self.aging_tokens_per_step * (step - r.arrival_step), *_arrival(r))

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: self._key(r, step))

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.num_tokens - r.num_computed_tokens, *_arrival(r)))


class FairShare:
    """Round-robin across `tenant` labels, weighted by the tokens each tenant was served.

    Waiting requests are interleaved: every tenant's first request (least-served tenant
    first), then every tenant's second, and so on; FIFO within a tenant. The victim is the
    latest request of the most-served tenant among the candidates.
    """

    name = "fair"

    def __init__(self) -> None:
        self.served: defaultdict[str, int] = defaultdict(int)

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        self.served[request.tenant] += num_tokens

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        rank: defaultdict[str, int] = defaultdict(int)
        keyed = []
        for r in sorted(waiting, key=_arrival):
            keyed.append(((rank[r.tenant], self.served[r.tenant], *_arrival(r)), r))
            rank[r.tenant] += 1
        return [r for _, r in sorted(keyed, key=lambda kr: kr[0])]

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (self.served[r.tenant], *_arrival(r)))


_REGISTRY: dict[str, Callable[[], Policy]] = {
    "fcfs": FCFS, "priority": PriorityPolicy, "sjf": ShortestJobFirst, "fair": FairShare}


def register_policy(name: str, factory: Callable[[], Policy]) -> None:
    """Makes a policy selectable by name."""
    _REGISTRY[name] = factory


def create_policy(name: str) -> Policy:
    """A registered policy by name, or a class by dotted path; ValueError saying what exists."""
    if name in _REGISTRY:
        return _REGISTRY[name]()
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(sorted(_REGISTRY))} "
                         "or a dotted path to a class")
    try:
        policy = getattr(importlib.import_module(module_name), attr)()
    except (ImportError, AttributeError, TypeError) as exc:
        raise ValueError(f"cannot load scheduling policy {name!r}: {exc}") from exc
    for method in ("order_waiting", "pick_victim"):
        if not callable(getattr(policy, method, None)):
            raise ValueError(f"scheduling policy {name!r} has no {method}() method")
    return policy
