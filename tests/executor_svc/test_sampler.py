"""Sampler behaviour a user would notice: greedy, filters, seeds, distribution, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from executor_svc.sampler import SamplingSpec, sample


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw_many(logits_row: torch.Tensor, spec: SamplingSpec, n: int) -> Counter:
    out = sample(logits_row.expand(n, -1), [spec] * n, list(range(n)))
    return Counter(out.token_ids)


def test_greedy_is_argmax_and_reports_no_logprobs_by_default():
    logits = _logits(8)
    out = sample(logits, [SamplingSpec(temperature=0)] * 8, list(range(8)))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(math.isnan(lp) for lp in out.logprobs) and out.top == [[]] * 8


@pytest.mark.parametrize("spec", [SamplingSpec(top_k=1), SamplingSpec(top_p=1e-6), SamplingSpec(min_p=1.0)])
def test_degenerate_filters_equal_greedy(spec):
    torch.manual_seed(0)
    logits = _logits(16, seed=1)
    out = sample(logits, [spec] * 16, list(range(16)))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_min_p_restrict_the_support():
    torch.manual_seed(0)
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    top2 = _draw_many(row, SamplingSpec(top_k=2), 2000)
    assert set(top2) == {0, 1}
    # min_p=0.4 -> floor 0.4 * 0.5 = 0.2: tokens 2 (0.15) and 3 (0.05) are dropped.
    kept = _draw_many(row, SamplingSpec(min_p=0.4), 2000)
    assert set(kept) == {0, 1}
    nucleus = _draw_many(row, SamplingSpec(top_p=0.85), 2000)  # 0.5 + 0.3 < 0.85: token 2 stays
    assert set(nucleus) == {0, 1, 2}


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_scaled_frequencies_match(seeded):
    """p_T(i) ∝ p(i)^(1/T). At T=2: (0.415, 0.322, 0.263) vs (0.5, 0.3, 0.2) unscaled;
    20k draws give a standard error of ~0.0035, so 0.015 separates them by > 5 sigma."""
    torch.manual_seed(123)
    base = torch.tensor([0.5, 0.3, 0.2])
    expected = base.sqrt() / base.sqrt().sum()
    n = 20_000
    counts = _draw_many(base.log(), SamplingSpec(temperature=2.0, seed=7 if seeded else None), n)
    freqs = torch.tensor([counts[i] / n for i in range(3)])
    torch.testing.assert_close(freqs, expected, atol=0.015, rtol=0)


def test_seeded_token_does_not_depend_on_batch_neighbours():
    logits = _logits(6, vocab=1000, seed=2)
    target = logits[0]
    spec = SamplingSpec(temperature=1.0, seed=1234)
    alone = [sample(target[None], [spec], [pos]).token_ids[0] for pos in range(20)]
    for pos in range(20):
        torch.manual_seed(pos)  # unseeded neighbours consume the global stream differently
        batch = torch.stack([logits[1], logits[2], target, logits[3]])
        specs = [SamplingSpec(), SamplingSpec(temperature=0), spec, SamplingSpec(seed=9, top_k=5)]
        out = sample(batch, specs, [pos + 3, 1, pos, pos])
        assert out.token_ids[2] == alone[pos]


def test_different_seeds_and_positions_diverge():
    flat = torch.zeros(1, 1000)
    by_seed = {sample(flat, [SamplingSpec(seed=s)], [10]).token_ids[0] for s in range(50)}
    by_position = {sample(flat, [SamplingSpec(seed=5)], [p]).token_ids[0] for p in range(50)}
    assert len(by_seed) > 40 and len(by_position) > 40  # ~49 expected for 50 uniform draws


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    logits = _logits(3, seed=4)
    specs = [
        SamplingSpec(temperature=0.5, top_k=3, num_logprobs=4),
        SamplingSpec(temperature=0, num_logprobs=0),
        SamplingSpec(num_logprobs=-1),
    ]
    out = sample(logits, specs, [0, 0, 0])
    lp = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        assert out.logprobs[row] == pytest.approx(lp[row, out.token_ids[row]].item(), abs=1e-6)
    vals, ids = lp[0].topk(4)
    assert [t for t, _ in out.top[0]] == ids.tolist()
    assert [v for _, v in out.top[0]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.top[1] == [] and math.isnan(out.logprobs[2]) and out.top[2] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(num_logprobs=-2), "num_logprobs"),
    ],
)
def test_invalid_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSpec(**kwargs)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="one SamplingSpec and one position per row"):
        sample(_logits(2), [SamplingSpec()], [0, 1])


def test_transposed_logits_sample_like_contiguous_ones():
    """compute_logits hands the sampler the transposed view its CPU matmul returns (issue 18):
    greedy, seeded and logprob rows must come out exactly as from a contiguous copy."""
    contiguous = _logits(6, vocab=64, seed=3)
    strided = contiguous.t().contiguous().t()
    assert not strided.is_contiguous() and torch.equal(strided, contiguous)
    specs = [
        SamplingSpec(temperature=0),
        SamplingSpec(temperature=0, num_logprobs=3),
        SamplingSpec(temperature=0.8, seed=7, num_logprobs=0),
        SamplingSpec(temperature=1.2, top_k=5, top_p=0.9, seed=8),
        SamplingSpec(temperature=0.5, min_p=0.1, seed=9, num_logprobs=2),
        SamplingSpec(temperature=0),
    ]
    a = sample(contiguous, specs, list(range(6)))
    b = sample(strided, specs, list(range(6)))
    assert a.token_ids == b.token_ids and a.top == b.top
    assert [x for x in a.logprobs if not math.isnan(x)] == [x for x in b.logprobs if not math.isnan(x)]
