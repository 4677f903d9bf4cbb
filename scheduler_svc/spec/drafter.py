"""Speculative decoding in the scheduler: which decodes of a step carry drafts, and how many.

`spec/verify.py` (called by scheduler.py once a step's plan holds every decode, prefill chunk
and swap-in it will carry) asks `Drafter.candidates` for guesses and `Drafter.choose` for how
many tokens of them to keep, so drafts only take the budget and free blocks that are left:
they never delay a decode or a prefill. A draft turns a decode entry into a verify entry of
1 + k tokens (plan.py `draft_token_ids`); the executor keeps the longest accepted prefix plus
one token (executor_svc/runner.py) and `on_result` learns from what came back.

The gate decides with this machine's own step times, learned from the results (`StepTimes`),
not from a model of the hardware: on a CPU a verify step of 1 + k rows runs a different path
than a fused 1-row decode (2-3x its time on the 2-core EPYC, benchmarks/RESULTS.md), and the
figures move with the machine's load. For a step of D decodes it drafts the E tokens with
the best acceptance chances (`a_r ** j`, each request's tracker) only when the expected
tokens per second, (D + sum of those chances) / t(D + E rows, verifying), beat D / t(D rows,
plain). A verify step of a row count not seen lately is assumed to cost what the plain step
costs, so it is tried (twice: `StepTimes.min_seen`) and then known; every figure is
forgotten `forget_after` steps after it was last refreshed, so a machine that got busier or
quieter is measured again (a few exploring steps per bucket and window of 256 steps).
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.plan import StepPlan, StepResult
from scheduler_svc.spec.config import SpeculativeConfig
from scheduler_svc.spec.tracker import AcceptanceTracker, TrackerSettings

if TYPE_CHECKING:
    from scheduler_svc.request import Request


@dataclass(slots=True)
class SpecCounters:
    """Totals since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verify entries (a request's step that carried a draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j


@dataclass(slots=True)
class DraftCandidate:
    """A decode the proposer had a guess for: what `add_drafts` may keep a prefix of."""

    index: int  # the plan entry
    draft: list[int]
    acceptance: float


def _bucket(rows: int) -> int:
    """Rows 1..16 exactly, then powers of two: few enough buckets to measure them all."""
    return rows if rows <= 16 else 1 << (rows - 1).bit_length()


class StepTimes:
    """Executor time of pure-decode steps by row count, plain and verifying (module docstring).

    A bucket's figure is the median of its last `window` observations, so one step slowed by a
    neighbour (or a kernel's first call, which once kept suffix drafts off for a whole request)
    does not decide for the next 256 steps; a verify bucket seen fewer than `min_seen` times
    counts as not seen, so a first slow step is tried again before it is believed (3: the
    median of 2 is their mean, which one first call's 0.5 s still ruins). A verify bucket not
    seen for `retry_verify_after` steps is forgotten and tried again: figures taken in a bad
    moment (a loaded machine) had kept a 200-token request from drafting at all (the same
    workload drafted and ran 2.43x in the next run). Worst case, where verifying never pays:
    `min_seen` probe steps per `retry_verify_after` steps, ~3% at batch 1."""

    def __init__(
        self, window: int = 8, min_seen: int = 3, forget_after: int = 256, retry_verify_after: int = 96
    ) -> None:
        self.window = window
        self.min_seen = min_seen
        self.forget_after = forget_after
        self.retry_verify_after = retry_verify_after
        self._t: dict[tuple[int, bool], tuple[deque[float], int]] = {}  # (bucket, verify) -> (recent seconds, step)

    def _horizon(self, verify: bool) -> int:
        return self.retry_verify_after if verify else self.forget_after

    def observe(self, rows: int, verify: bool, seconds: float, step: int) -> None:
        key = (_bucket(rows), verify)
        old = self._t.get(key)
        if old is None or step - old[1] > self._horizon(verify):
            old = (deque(maxlen=self.window), step)
        old[0].append(seconds)
        self._t[key] = (old[0], step)

    def known(self, rows: int, verify: bool, step: int, min_seen: int = 1) -> float | None:
        """The learned time of such a step; None when seen fewer than `min_seen` times, or not
        within the last `forget_after` (plain) / `retry_verify_after` (verify) steps."""
        got = self._t.get((_bucket(rows), verify))
        if got is None or step - got[1] > self._horizon(verify) or len(got[0]) < min_seen:
            return None
        return statistics.median(got[0])

    def plain(self, rows: int, step: int) -> float | None:
        """A plain decode step of `rows` rows: learned, else the nearest smaller one learned
        scaled by rows (steps grow at most linearly), else None (nothing to compare with)."""
        if (t := self.known(rows, False, step)) is not None:
            return t
        for r in range(min(rows - 1, 16), 0, -1):
            if (t := self.known(r, False, step)) is not None:
                return t * rows / r
        return None

    def verify(self, rows: int, step: int) -> float | None:
        """A verify step of `rows` rows, or None when it has not been seen `min_seen` times lately."""
        return self.known(rows, True, step, self.min_seen)


class Drafter:
    """Proposer, per-request trackers and the gate of one scheduler (module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = config.make_proposer()
        self.settings = TrackerSettings(k_max=config.num_speculative_tokens)
        self.times = StepTimes()
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._trackers: dict[str, AcceptanceTracker] = {}
        self._fed: dict[str, int] = {}  # request id -> output tokens the proposer has

    def prepare(self, request: Request, num_tokens: int) -> None:
        """Indexes up to num_tokens more of a prompt being prefilled, so a long prompt's
        indexing is spread over the steps that prefill it."""
        self.proposer.prepare(request, num_tokens)

    def tracker(self, request: Request) -> AcceptanceTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = self._trackers[request.request_id] = AcceptanceTracker(self.settings)
        return tracker

    def _sync(self, request: Request) -> None:
        """Hands the proposer the output tokens it has not seen (only accepted tokens exist)."""
        fed = self._fed.get(request.request_id, 0)
        if fed < len(request.output_token_ids):
            self.proposer.on_tokens(request, request.output_token_ids[fed:])
            self._fed[request.request_id] = len(request.output_token_ids)

    def candidates(self, decodes: list[tuple[int, Request, int]]) -> list[DraftCandidate]:
        """Guesses for decodes given as (plan entry index, request, most tokens it may take)."""
        out = []
        for index, request, room in decodes:
            tracker = self.tracker(request)
            k = min(tracker.draft_len(), room)
            if k <= 0:
                continue
            self._sync(request)
            draft = self.proposer.propose(request, k)
            if draft:
                out.append(DraftCandidate(index, draft, tracker.acceptance))
        return out

    def could_pay(self, num_decodes: int, max_tokens: int, step: int) -> bool:
        """Whether some number of draft tokens up to max_tokens would pay even if every one
        were accepted: when not, nobody's proposer runs this step (at 32 streams on a CPU that
        is most steps, and proposing costs tens of microseconds per request)."""
        base = self.times.plain(num_decodes, step)
        if base is None:
            return False
        for e in range(1, max_tokens + 1):
            t = self.times.verify(num_decodes + e, step)
            if t is None or (num_decodes + e) / t > num_decodes / base:
                return True
        return False

    def choose(self, num_decodes: int, candidates: list[DraftCandidate], budget: int, step: int) -> dict[int, int]:
        """How many draft tokens each candidate keeps ({entry index: k}, only k > 0): the E
        best acceptance chances, E chosen for the most expected tokens per second."""
        base = self.times.plain(num_decodes, step)
        if base is None or not candidates or budget <= 0:
            return {}
        # Chances in decreasing order: a prefix of each request's draft, greedily.
        heap = [(-c.acceptance, i, 1) for i, c in enumerate(candidates)]
        heapq.heapify(heap)
        order: list[tuple[float, int]] = []
        while heap and len(order) < budget:
            neg, i, j = heapq.heappop(heap)
            order.append((-neg, i))
            c = candidates[i]
            if j < len(c.draft):
                heapq.heappush(heap, (-(c.acceptance ** (j + 1)), i, j + 1))
        best_e, best_rate, gain = 0, num_decodes / base, 0.0
        for e, (chance, _) in enumerate(order, start=1):
            gain += chance
            rows = num_decodes + e
            t = self.times.verify(rows, step)
            if t is None:  # not seen lately: assumed free, so it is tried and then known
                t = base
            if (num_decodes + gain) / t > best_rate:
                best_e, best_rate = e, (num_decodes + gain) / t
        keep: dict[int, int] = {}
        for _, i in order[:best_e]:
            keep[candidates[i].index] = keep.get(candidates[i].index, 0) + 1
        return keep

    def observe_result(self, plan: StepPlan, result: StepResult) -> None:
        """Learns a pure-decode step's executor time (a step with a prefill chunk teaches
        nothing here: no draft rides on one)."""
        if not plan.seqs or not result.execute_ns:
            return
        if all(s.sample and s.num_new_tokens == 1 + len(s.draft_token_ids) for s in plan.seqs):
            verify = any(s.draft_token_ids for s in plan.seqs)
            self.times.observe(plan.num_tokens, verify, result.execute_ns / 1e9, plan.step_id)

    def on_result(self, request: Request, drafted: int, accepted: int) -> None:
        """A verify entry came back with `accepted` of its `drafted` tokens kept."""
        self.tracker(request).record(drafted, accepted)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        for j in range(accepted):
            c.accepted_per_pos[j] += 1

    def on_finish(self, request: Request) -> None:
        """The request ended: its state goes (the suffix proposer keeps its output in its corpus)."""
        self._sync(request)
        self.proposer.on_finish(request)
        self._trackers.pop(request.request_id, None)
        self._fed.pop(request.request_id, None)
