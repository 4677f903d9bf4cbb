"""float32 CPU linears with row padding (`padded_rows`, `--cpu-gemm-row-padding`): the padding
rule's shape, results equal to the unpadded product to float32 rounding whatever the input
layout, a row's result independent of the other rows' values, and padding off computing
exactly the old product. oneDNN's packed copies (`--cpu-gemm-prepack`): float32 products,
used from PREPACK_MIN_ROWS rows by the table plan, on every linear and the head, as the flag says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_contracts.cpu import CpuInfo
from executor_svc.config import ExecutorConfig
from executor_svc.models.kernel_plan import PREPACK_MIN_ROWS, padded_rows, table_plan
from executor_svc.models.layers import Linear, linear, packed_linear, prepack_weight


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
    for m in (1, 3, 7, 13):
        x = torch.randn(m, 32)
        assert torch.equal(linear(x, w, pad=False), torch.mm(w, x.t()).t())
        assert torch.equal(linear(x, w, b, pad=False), torch.addmm(b[:, None], w, x.t()).t())


def test_the_executor_flag_sets_the_table_plan(tiny_model_path, tmp_path):
    from executor_svc.worker import load

    common = dict(
        model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path),
        cpu_linear_plan="table", cpu_gemm_prepack=False,  # the tables (the measured plan: test_linear_plan.py)
    )  # fmt: skip
    off = load(ExecutorConfig(cpu_gemm_row_padding=False, **common)).runner.model
    on = load(ExecutorConfig(**common)).runner.model
    for model, kernel in ((off, "mm"), (on, "mm-pad")):
        for lin in [*model.decoder_linears(), model.lm_head]:
            assert {lin.plan(m) for m in range(1, 300)} == {kernel}


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
    lin.plan = table_plan(None, packed=True, padding=True, upto=64)
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
    import executor_svc.worker as worker
    from executor_svc.models import get_model_class
    from executor_svc.worker import load

    config = tiny_configs["smollm_tied"]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    added = model.prepack()
    assert model.lm_head in linears and model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert all(m.packed is not None for m in linears)
    assert added == sum(m.weight.nbytes for m in linears)
    model.use_plan(
        table_plan(None, packed=True, padding=True, upto=8), table_plan(None, packed=True, padding=True, upto=8)
    )
    hidden = torch.randn(5, config.hidden_size)  # >= PREPACK_MIN_ROWS: the packed head
    want = hidden.double() @ model.model.embed_tokens.weight.double().t()
    torch.testing.assert_close(model.compute_logits(hidden).double(), want, rtol=1e-5, atol=1e-5)

    common = dict(
        model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path),
        cpu_linear_plan="table",  # the tables (the measured plan: test_linear_plan.py)
    )  # fmt: skip
    monkeypatch.setattr(worker, "prepack_measured", lambda: True)  # a CPU class where it was measured
    on = load(ExecutorConfig(**common)).runner.model
    assert on.lm_head.packed is not None and on.model.layers[0].mlp.down_proj.packed is not None
    assert on.lm_head.plan(PREPACK_MIN_ROWS) == "packed" and on.lm_head.plan(PREPACK_MIN_ROWS - 1) == "mm-pad"
    off = load(ExecutorConfig(cpu_gemm_prepack=False, **common)).runner.model
    assert off.lm_head.packed is None and off.model.layers[0].mlp.down_proj.packed is None
    assert "packed" not in off.lm_head.plan.kernels
    # --dtype bfloat16 on a native-bf16 CPU serves every large step from its bfloat16 copy:
    # no packed float32 copy there; without native bf16 its large steps are float32, packed
    import executor_svc.models.quant as quant

    for flags, packed in (({"avx512_bf16"}, False), (set(), True)):
        monkeypatch.setattr(quant, "cpu_info", lambda flags=flags: CpuInfo("test", frozenset(flags)))
        half = load(ExecutorConfig(dtype="bfloat16", **common)).runner.model
        assert (half.model.layers[0].mlp.down_proj.packed is not None) is packed
    monkeypatch.setattr(worker, "prepack_measured", lambda: False)  # elsewhere: not applied
    assert load(ExecutorConfig(**common)).runner.model.lm_head.packed is None
