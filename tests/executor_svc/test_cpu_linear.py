"""float32 CPU linears with row padding (`padded_rows`, `--cpu-gemm-row-padding`): the padding
rule's shape, results equal to the unpadded product to float32 rounding whatever the input
layout, a row's result independent of the other rows' values, and the switch off computing
exactly the old product. oneDNN's packed copies (`--cpu-gemm-prepack`): float32 products,
used from PREPACK_MIN_ROWS rows, on every linear and the head, as the flag says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.config import ExecutorConfig
from executor_svc.models.layers import (
    PREPACK_MIN_ROWS,
    Linear,
    linear,
    packed_linear,
    padded_rows,
    prepack_weight,
    set_cpu_gemm_row_padding,
)


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

    common = dict(
        model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path),
        cpu_linear_plan="table",  # the tables (the measured plan: test_linear_plan.py)
    )  # fmt: skip
    load(ExecutorConfig(cpu_gemm_row_padding=False, **common))
    assert layers._ROW_PADDING[0] is False
    load(ExecutorConfig(**common))
    assert layers._ROW_PADDING[0] is True


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.sampled_from([8, 24, 96]),
    k=st.sampled_from([16, 64]),
    bias=st.booleans(),
    column_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_equals_the_plain_product(m, n, k, bias, column_major, seed):
    """oneDNN on the packed copy is float32 arithmetic: the float64 product to float32
    rounding, whatever the input layout (silu(gate) * up reaches down_proj column-major)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(k, m, generator=g).t() if column_major else torch.randn(m, k, generator=g)
    y = packed_linear(x, prepack_weight(w), b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_linear_takes_the_packed_copy_from_its_row_count_on():
    """Routing, made visible: the packed copy is of *other* weights, so each row count's
    result says which copy it used."""
    torch.manual_seed(5)
    lin = Linear(32, 16, True, torch.float32, "cpu")
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    other = torch.randn(16, 32)
    lin.packed = prepack_weight(other)
    for m in range(1, 8):
        x = torch.randn(m, 32)
        plain = linear(x, lin.weight, lin.bias)
        swapped = linear(x, other, lin.bias)
        want = swapped if m >= PREPACK_MIN_ROWS else plain
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_prepack_model_covers_every_linear_and_the_head_and_load_follows_the_flag(
    tiny_configs, hf_model_factory, tiny_model_path, tmp_path, monkeypatch
):
    import executor_svc.server as server
    from executor_svc.models import get_model_class
    from executor_svc.models.llama import prepack_model
    from executor_svc.server import load

    config = tiny_configs["smollm_tied"]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    added = prepack_model(model)
    assert all(m.packed is not None for m in linears) and model.head_packed is not None
    assert added == sum(m.weight.nbytes for m in linears) + model.model.embed_tokens.weight.nbytes
    hidden = torch.randn(5, config.hidden_size)  # >= PREPACK_MIN_ROWS: the packed head
    want = hidden.double() @ model.model.embed_tokens.weight.double().t()
    torch.testing.assert_close(model.compute_logits(hidden).double(), want, rtol=1e-5, atol=1e-5)

    common = dict(
        model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path),
        cpu_linear_plan="table",  # the tables (the measured plan: test_linear_plan.py)
    )  # fmt: skip
    monkeypatch.setattr(server, "prepack_measured", lambda: True)  # a CPU class where it was measured
    on = load(ExecutorConfig(**common)).runner.model
    assert on.head_packed is not None and on.model.layers[0].mlp.down_proj.packed is not None
    off = load(ExecutorConfig(cpu_gemm_prepack=False, **common)).runner.model
    assert off.head_packed is None and off.model.layers[0].mlp.down_proj.packed is None
    # --dtype bfloat16 on a native-bf16 CPU serves every large step from its bfloat16 copy:
    # no packed float32 copy there; without native bf16 its large steps are float32, packed
    import executor_svc.models.quant as quant

    for native, packed in ((True, False), (False, True)):
        monkeypatch.setattr(quant, "native_bf16", lambda native=native: native)
        half = load(ExecutorConfig(dtype="bfloat16", **common)).runner.model
        assert (half.model.layers[0].mlp.down_proj.packed is not None) is packed
    monkeypatch.setattr(server, "prepack_measured", lambda: False)  # elsewhere: not applied
    assert load(ExecutorConfig(**common)).runner.model.head_packed is None
