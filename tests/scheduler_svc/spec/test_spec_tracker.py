"""The per-request draft length: bounded, long while drafts are accepted, off after sustained
rejection with probes spaced further apart, back on when a probe succeeds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.spec.tracker import AcceptanceTracker, TrackerSettings


@settings(max_examples=200, deadline=None)
@given(k_max=st.integers(0, 16), outcomes=st.lists(st.floats(0, 1), max_size=300))
def test_the_draft_length_stays_in_bounds_whatever_is_accepted(k_max, outcomes):
    tracker = AcceptanceTracker(TrackerSettings(k_max=k_max))
    for fraction in outcomes:
        k = tracker.draft_len()
        assert 0 <= k <= k_max
        assert 0.0 <= tracker.acceptance <= 1.0
        tracker.record(k, int(k * fraction))


def test_accepted_drafts_earn_k_max_and_rejected_ones_shrink_it():
    good = AcceptanceTracker(TrackerSettings(k_max=8))
    for _ in range(20):
        k = good.draft_len()
        good.record(k, k)
    assert good.draft_len() == 8
    half = AcceptanceTracker(TrackerSettings(k_max=8))
    for _ in range(40):
        k = half.draft_len()
        half.record(k, k // 2)
    assert 1 <= half.draft_len() < 8 and half.enabled


def test_a_higher_acceptance_never_earns_a_shorter_draft():
    lengths = []
    for accepted_per_4 in range(5):
        tracker = AcceptanceTracker(TrackerSettings(k_max=12, off_after=1000))
        for _ in range(50):
            tracker.draft_len()
            tracker.record(4, accepted_per_4)
        lengths.append(tracker.draft_len())
    assert lengths == sorted(lengths), lengths


def test_sustained_rejection_switches_off_then_probes_back_off_exponentially():
    s = TrackerSettings(k_max=6, off_after=4, probe_every=8, probe_max=32, probe_len=2)
    tracker = AcceptanceTracker(s)
    steps = 0
    while tracker.enabled:
        k = tracker.draft_len()
        tracker.record(k, 0)
        steps += 1
        assert steps < 20, "never switched off"
    gaps, since = [], 0
    for _ in range(200):
        k = tracker.draft_len()
        since += 1
        if k:
            assert k == 2  # a probe
            gaps.append(since)
            since = 0
            tracker.record(k, 0)  # fails
    assert gaps[:4] == [8, 16, 32, 32] and set(gaps[3:]) == {32}
    assert not tracker.enabled and tracker.num_probes == len(gaps)


def test_an_accepted_probe_switches_drafting_back_on():
    s = TrackerSettings(k_max=6, off_after=2, probe_every=4)
    tracker = AcceptanceTracker(s)
    while tracker.enabled:
        tracker.record(tracker.draft_len(), 0)
    k = 0
    while not k:
        k = tracker.draft_len()
    tracker.record(k, k)
    assert tracker.enabled and tracker.draft_len() >= 1
    for _ in range(10):
        k = tracker.draft_len()
        tracker.record(k, k)
    assert tracker.draft_len() == 6


def test_a_step_without_a_draft_teaches_nothing_and_bad_counts_are_refused():
    tracker = AcceptanceTracker(TrackerSettings(k_max=4))
    before = tracker.acceptance
    tracker.record(0, 0)
    assert tracker.acceptance == before
    with pytest.raises(ValueError):
        tracker.record(2, 3)
    with pytest.raises(ValueError):
        TrackerSettings(k_max=-1)
    with pytest.raises(ValueError):
        TrackerSettings(k_max=4, probe_every=0)
    assert AcceptanceTracker(TrackerSettings(k_max=0)).draft_len() == 0
