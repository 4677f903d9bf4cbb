"""Scheduling policies: they order the waiting queue and pick preemption victims, nothing else.

Budget arithmetic, chunking and block allocation stay in the scheduler, so a policy is a
few lines and cannot break a step invariant. The contract is the `Policy` base class below
(docs/policies.md shows a complete one). Policies are registered by name; a dotted path
(`package.module.Class` or `package.module:Class`) loads a user's own subclass,
instantiated without arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

from chunkserve_contracts.registry import Registry
from scheduler_svc.request import Request


class Policy(ABC):
    """What the scheduler asks of a policy: two decisions and one optional notification."""

    #: Shown in the step trace, metrics and `chunkserve admin config`.
    name: ClassVar[str] = ""

    @abstractmethod
    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        """The same requests in admission order. `step` is the scheduler's step counter, for
        aging (`request.arrival_step` is when a request arrived)."""

    @abstractmethod
    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """One of the (never empty) running candidates, to be preempted."""

    def on_scheduled(self, request: Request, num_tokens: int) -> None:  # noqa: B027 (optional hook)
        """Told what each step gave each request; the one hook beyond ordering, because
        fairness needs to know who was served. Default: nothing."""


def _arrival(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.seq_id)


class FCFS(Policy):
    """First come, first served; the most recently arrived request is preempted first."""

    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=_arrival)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=_arrival)


class PriorityPolicy(Policy):
    """Lower `priority` first, then arrival; the victim is the lowest priority, latest arrival."""

    name = "priority"

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, *_arrival(r)))

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, *_arrival(r)))


class ShortestJobFirst(Policy):
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


class FairShare(Policy):
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


POLICIES: Registry[type[Policy]] = Registry(
    "scheduling policy",
    {"fcfs": FCFS, "priority": PriorityPolicy, "sjf": ShortestJobFirst, "fair": FairShare},
    allow_dotted_path=True,
)


def register_policy(name: str, cls: type[Policy]) -> None:
    """Makes a policy selectable by name."""
    POLICIES.register(name, cls)


def create_policy(name: str) -> Policy:
    """A registered policy by name, or a Policy subclass by dotted path; ValueError saying what
    exists or what is wrong."""
    cls = POLICIES.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"scheduling policy {name!r} is not a subclass of scheduler_svc.policy.Policy")
    try:
        return cls()
    except TypeError as exc:  # abstract methods missing, or an __init__ that wants arguments
        raise ValueError(f"cannot load scheduling policy {name!r}: {exc}") from exc
