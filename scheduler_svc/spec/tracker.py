"""Per-request draft length from recent acceptance: long drafts while they are accepted, short
ones when they are not, none for a request whose drafts keep failing (with an occasional
probe, so a request whose text turns repetitive later gets drafts again).

Model: draft token j (1-based) is accepted with probability a^j, a being the per-token
acceptance (greedy verification stops at the first mismatch). A step that drafted d tokens
and had n accepted observed min(n + 1, d) positions, n of them accepted; `a` is the ratio of
exponentially decayed sums of those two counts (the censored-geometric estimate), starting
from an optimistic prior. The draft length is the largest k <= k_max whose last token still
has an acceptance chance a^k >= min_marginal; the per-step gate (docs/speculative.md) sets
how much a draft row must be worth.

Pure logic, no clock: `draft_len` is called once per step that could draft, `record` after
each step that drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrackerSettings:
    k_max: int
    decay: float = 0.7  # weight of the past per recorded step
    prior: float = 0.8  # per-token acceptance assumed before any step (weight of one step)
    min_marginal: float = 0.3  # draft the k-th token only while a^k >= this
    off_below: float = 0.15  # a below this for off_after recorded steps in a row: off
    off_after: int = 6
    probe_every: int = 16  # steps off before a probe; doubles after each failed probe
    probe_max: int = 512
    probe_len: int = 2  # tokens drafted by a probe

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        if not 0 <= self.decay < 1 or not 0 < self.prior <= 1 or not 0 < self.min_marginal <= 1:
            raise ValueError("need 0 <= decay < 1, 0 < prior <= 1, 0 < min_marginal <= 1")
        if self.off_after < 1 or not 1 <= self.probe_every <= self.probe_max or self.probe_len < 1:
            raise ValueError("need off_after >= 1, 1 <= probe_every <= probe_max, probe_len >= 1")


class AcceptanceTracker:
    """One request's recent acceptance and the draft length it earns (module docstring)."""

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings
        self._accepted = settings.prior  # decayed sums: accepted positions ...
        self._observed = 1.0  # ... and observed positions
        self.enabled = True
        self._low_streak = 0
        self._steps_off = 0
        self._interval = settings.probe_every
        self._probing = False
        self.num_probes = 0

    @property
    def acceptance(self) -> float:
        """The current per-token acceptance estimate, in [0, 1]."""
        return self._accepted / self._observed

    def draft_len(self) -> int:
        """Tokens to draft this step, in [0, k_max] (0: do not speculate)."""
        s = self.settings
        if s.k_max == 0:
            return 0
        if not self.enabled:
            self._steps_off += 1
            if self._steps_off < self._interval:
                return 0
            self._steps_off = 0
            self._probing = True
            self.num_probes += 1
            return min(s.probe_len, s.k_max)
        a = self.acceptance
        if a >= 1.0:
            return s.k_max
        if a <= 0.0:
            return 1
        k = int(math.log(s.min_marginal) / math.log(a) + 1e-9)  # largest k with a^k >= min_marginal
        return max(1, min(s.k_max, k))

    def record(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` draft tokens and accepted the first `accepted` of them."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        if drafted == 0:
            return  # nothing proposed: nothing learned
        s = self.settings
        observed = min(accepted + 1, drafted)
        if self._probing:
            self._probing = False
            if accepted / observed >= s.off_below:  # the text turned predictable: start afresh
                self.enabled = True
                self._low_streak = 0
                self._interval = s.probe_every
                self._accepted, self._observed = float(accepted) + s.prior, observed + 1.0
            else:
                self._interval = min(self._interval * 2, s.probe_max)
            return
        if not self.enabled:
            return  # a late result of a step drafted before the switch-off
        self._accepted = s.decay * self._accepted + accepted
        self._observed = s.decay * self._observed + observed
        self._low_streak = self._low_streak + 1 if self.acceptance < s.off_below else 0
        if self._low_streak >= s.off_after:
            self.enabled = False
            self._steps_off = 0
