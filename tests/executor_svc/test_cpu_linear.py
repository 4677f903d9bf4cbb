"""float32 CPU linears with row padding (`padded_rows`, `--cpu-gemm-row-padding`): the padding
rule's shape, results equal to the unpadded product to float32 rounding whatever the input
layout, a row's result independent of the other rows' values, and the switch off computing
exactly the old product."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.config import ExecutorConfig
from executor_svc.models.layers import linear, padded_rows, set_cpu_gemm_row_padding


@pytest.fixture(autouse=True)
def _padding_back_on():
    yield
    set_cpu_gemm_row_padding(True)


def test_padded_rows_rule():
    assert [padded_rows(m) for m in range(10)] == [0, 2, 2, 4, 4, 5, 6, 8, 8, 16]
    for m in range(7, 1100):
        p = padded_rows(m)
        assert p % 8 == 0 and m <= p < m + 8


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40),
    n=st.sampled_from([8, 24, 96]),
    k=st.sampled_from([16, 64]),
    bias=st.booleans(),
    column_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padded_linear_equals_the_plain_product(m, n, k, bias, column_major, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(k, m, generator=g).t() if column_major else torch.randn(m, k, generator=g)
    y = linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 20), row=st.integers(0, 19), seed=st.integers(0, 2**16))
def test_a_rows_result_does_not_depend_on_the_other_rows(m, row, seed):
    """Batch composition at a fixed row count does not move a sequence's logits by a bit."""
    row %= m
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(64, 96, generator=g), torch.randn(m, 96, generator=g)
    other = torch.randn(m, 96, generator=g)
    other[row] = x[row]
    assert torch.equal(linear(x, w)[row], linear(other, w)[row])


def test_padding_off_is_the_unpadded_product_bitwise():
    torch.manual_seed(3)
    w, b = torch.randn(40, 32), torch.randn(40)
    set_cpu_gemm_row_padding(False)
    for m in (1, 3, 7, 13):
        x = torch.randn(m, 32)
        assert torch.equal(linear(x, w), torch.mm(w, x.t()).t())
        assert torch.equal(linear(x, w, b), torch.addmm(b[:, None], w, x.t()).t())


def test_the_executor_flag_sets_the_switch(tiny_model_path, tmp_path):
    import executor_svc.models.layers as layers
    from executor_svc.server import load

    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path))
    load(ExecutorConfig(cpu_gemm_row_padding=False, **common))
    assert layers._ROW_PADDING[0] is False
    load(ExecutorConfig(**common))
    assert layers._ROW_PADDING[0] is True
