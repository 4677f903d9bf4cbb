"""The native CPU kernels (chunkserve_kernels/csrc/*.cpp via chunkserve_kernels/cpu_native.py):
the torch backend with `use_native()` against the `torch_ref` oracle on random paged batches,
the native K/V write against the aten one, the refusals, the build's failure path, and the
executor's --cpu-kernels switch, and the few-row product (the linear plan's "gemv"). Skipped where
this machine has no C++ compiler."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve_kernels import cpu_native, get_backend
from tests.kernels.conftest import make_paged_batch

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def native():
    """A torch backend switched to the native ops (built on first use, ~10 s, kept after)."""
    why = cpu_native.load()
    assert why is None, why
    backend = get_backend("torch")
    backend.use_native()
    return backend


def _step(backend, batch, scale=0.3):
    backend.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    return backend.forward(batch.q, batch.cache, batch.meta, scale)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 1, 2, 5])), min_size=1, max_size=6
    ),  # (context before, query length): mostly decodes, some prefill chunks in the same step
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2), (9, 3), (8, 8)]),
    head_dim=st.sampled_from([8, 16, 64, 80]),
    shuffle=st.randoms(use_true_random=False),
    seed=st.integers(0, 2**16),
)
def test_native_matches_reference_on_random_steps(native, seqs, block_size, heads, head_dim, shuffle, seed):
    """Decodes (ragged contexts, in any order among prefill chunks), GQA groups of 1-4, head
    sizes that are and are not a multiple of the vector width: the oracle's output within
    float32 rounding, and the cache holds the same K/V afterwards."""
    shuffle.shuffle(seqs)
    hq, hkv = heads
    batch = make_paged_batch(seqs, block_size, hq, hkv, head_dim, seed=seed)
    ref_batch = make_paged_batch(seqs, block_size, hq, hkv, head_dim, seed=seed)
    out = _step(native, batch)
    ref = _step(get_backend("torch_ref"), ref_batch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(batch.cache, ref_batch.cache)


def test_native_runs_large_steps_on_all_threads_and_matches(native):
    """Beyond the serial threshold (256 key rows by default) the op splits sequences x KV heads
    over the threads; results are the same per row as on one thread (each row is one task)."""
    seqs = [(700, 1), (1200, 1), (5, 1), (900, 1)]
    batch = make_paged_batch(seqs, 16, 8, 2, 64, seed=5)
    ref_batch = make_paged_batch(seqs, 16, 8, 2, 64, seed=5)
    out = _step(native, batch)
    torch.testing.assert_close(out, _step(get_backend("torch_ref"), ref_batch), atol=2e-5, rtol=1e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        native.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
        one = native.forward(batch.q, batch.cache, batch.meta, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, one)
    # the threshold chooses threads, never the result: one sequence (3 KV heads x 100 rows)
    small = make_paged_batch([(100, 1)], 16, 9, 3, 64, seed=6)
    args = (small.q, small.cache, small.meta.block_table.int(), small.meta.seqused_k.int(), 0.3)
    op = torch.ops.chunkserve.paged_decode_attention
    assert torch.equal(op(*args, 0), op(*args, 10**9)) and torch.equal(op(*args), op(*args, 0))


def test_long_contexts_split_into_pieces_match_and_do_not_depend_on_the_batch(native):
    """Contexts over 512 tokens are attended in 512-token pieces and merged: at and around the
    piece boundaries the oracle's output within float32 rounding; a sequence's rows are the
    same bitwise alone, in a batch and on one thread (the split follows its own length only)."""
    seqs = [(511, 1), (512, 1), (1023, 1), (1400, 1), (40, 1)]  # contexts 512, 513, 1024, 1401, 41
    batch = make_paged_batch(seqs, 16, 9, 3, 64, seed=7)
    ref_batch = make_paged_batch(seqs, 16, 9, 3, 64, seed=7)
    out = _step(native, batch)
    torch.testing.assert_close(out, _step(get_backend("torch_ref"), ref_batch), atol=2e-5, rtol=1e-5)
    op = torch.ops.chunkserve.paged_decode_attention
    tables, lens = batch.meta.block_table.int(), batch.meta.seqused_k.int()
    for i in (1, 3):
        alone = op(batch.q[i : i + 1], batch.cache, tables[i : i + 1], lens[i : i + 1], 0.3)
        assert torch.equal(alone, out[i : i + 1])
        assert torch.equal(op(batch.q[i : i + 1], batch.cache, tables[i : i + 1], lens[i : i + 1], 0.3, 10**9), alone)


@pytest.mark.parametrize("ctx0, rows", [(5, 4), (509, 6), (1020, 9), (1400, 9), (40, 1)])
def test_a_verify_run_reads_the_cache_once_and_gives_each_row_what_it_gets_alone(native, ctx0, rows):
    """A decode and its drafts (speculative decoding) come as consecutive rows with one block
    table and contexts c, c + 1, ...: the op attends them as one run, and every row is bitwise
    what it gets alone (short contexts, pieces, a run across the 512-token piece boundary)."""
    batch = make_paged_batch([(ctx0 + rows - 1, 1)], 16, 9, 3, 64, seed=3)
    (table,) = batch.meta.block_table.int()
    q = torch.randn(rows, 9, 64, generator=torch.Generator().manual_seed(ctx0))
    lens = torch.arange(ctx0, ctx0 + rows, dtype=torch.int32)
    op = torch.ops.chunkserve.paged_decode_attention
    run = op(q, batch.cache, table.repeat(rows, 1), lens, 0.3)
    alone = torch.cat([op(q[j : j + 1], batch.cache, table[None], lens[j : j + 1], 0.3) for j in range(rows)])
    assert torch.equal(run, alone)
    assert torch.equal(op(q, batch.cache, table.repeat(rows, 1), lens, 0.3, 10**9), run)  # one thread or many


@pytest.mark.parametrize("head_dim, ctx0, rows", [(8, 509, 6), (80, 20, 9), (48, 3, 2)])
def test_a_verify_run_is_bitwise_its_rows_alone_at_other_head_sizes(native, head_dim, ctx0, rows):
    """Head sizes that are not 64: not a whole number of vectors (8: padded copies), five
    vectors (80: a value tile of four and one of one), three (48); runs of 2-9 rows."""
    batch = make_paged_batch([(ctx0 + rows - 1, 1)], 16, 6, 2, head_dim, seed=head_dim)
    (table,) = batch.meta.block_table.int()
    q = torch.randn(rows, 6, head_dim, generator=torch.Generator().manual_seed(ctx0))
    lens = torch.arange(ctx0, ctx0 + rows, dtype=torch.int32)
    op = torch.ops.chunkserve.paged_decode_attention
    run = op(q, batch.cache, table.repeat(rows, 1), lens, 0.3)
    alone = torch.cat([op(q[j : j + 1], batch.cache, table[None], lens[j : j + 1], 0.3) for j in range(rows)])
    assert torch.equal(run, alone)


@pytest.mark.parametrize("layout", ["head slice", "transposed"])
def test_native_write_kv_equals_aten_write_from_strided_views(native, layout):
    """k and v as the model passes them: views into a wider tensor, or of a transposed product
    (the CPU GEMM returns (W @ x^T)^T: head_dim not contiguous)."""
    batch = make_paged_batch([(3, 4), (0, 1), (17, 2)], 4, 6, 2, 16, seed=2)
    if layout == "head slice":
        wide = torch.randn(7, 10, 16)
    else:
        wide = torch.randn(10 * 16, 8).t()[:7].view(7, 10, 16)
        assert wide.stride(2) != 1
    k, v = wide[:, 6:8], wide[:, 8:10]
    assert not k.is_contiguous()
    a, b = batch.cache.clone(), batch.cache.clone()
    native.write_kv(a, k, v, batch.meta.slot_mapping)
    get_backend("torch").write_kv(b, k, v, batch.meta.slot_mapping)
    assert torch.equal(a, b) and not torch.equal(a, batch.cache)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 6),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2), (9, 3), (8, 8)]),
    head_dim=st.sampled_from([2, 8, 15, 64, 80]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_rotary_kv_is_apply_rotary_and_write_kv_bitwise(native, tokens, heads, head_dim, scale, seed):
    """The fused layers' one-pass rotary + K/V write (cpu_rotary.cpp) against what the Python
    layers run: `apply_rotary` with the tables' rows at each token's position, then the native
    K/V write. Random tables (not only real cos/sin) and large values, where a fused
    multiply-add would round differently; odd head sizes roll by the floor of half."""
    from executor_svc.models.layers import apply_rotary

    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, generator=gen) * scale
    cos, sin = (torch.randn(9, head_dim, generator=gen) for _ in range(2))
    positions = torch.randint(0, 9, (tokens,), generator=gen)
    cache = torch.randn(2, 5, 4, hkv, head_dim, generator=gen)
    slots = torch.randperm(20, generator=gen)[:tokens]
    want_cache = cache.clone()
    qk = apply_rotary(qkv[:, : hq + hkv], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    native.write_kv(want_cache, qk[:, hq:], qkv[:, hq + hkv :], slots)
    q = torch.ops.chunkserve.rotary_kv(qkv, cos, sin, positions, cache, slots, hq)
    assert q.shape == (tokens, hq, head_dim)
    assert torch.equal(q, qk[:, :hq])
    assert torch.equal(cache, want_cache)


def test_rotary_kv_refuses_bad_input_without_crashing(native):
    qkv, cos, cache = torch.randn(2, 5, 8), torch.randn(4, 8), torch.zeros(2, 3, 4, 1, 8)
    slots, pos = torch.tensor([0, 11]), torch.tensor([0, 3])
    op = torch.ops.chunkserve.rotary_kv
    for args, message in (
        ((qkv, cos, cos, pos, cache, torch.tensor([0, 12]), 3), "outside the cache"),
        ((qkv, cos, cos, pos + 1, cache, slots, 3), "position 4 outside the tables' 4"),
        ((qkv, cos, cos, pos - 1, cache, slots, 3), "position -1 outside"),
        ((qkv, cos, cos, pos, cache, slots, 2), "KV heads"),
        ((qkv, cos, cos[:2], pos, cache, slots, 3), "cos and sin"),
        ((qkv, cos[:, :4], cos[:, :4], pos, cache, slots, 3), "cos and sin"),
        ((qkv.transpose(0, 1), cos, cos, pos, cache, slots, 3), "contiguous float32"),
        ((qkv, cos, cos, pos, cache, slots.int(), 3), "int64"),
        ((qkv, cos, cos, pos.int(), cache, slots, 3), "positions must be int64"),
    ):
        before = cache.clone()
        with pytest.raises(RuntimeError, match=message):
            op(*args)
        assert torch.equal(cache, before)
    assert op(qkv, cos, cos, pos, cache, slots, 3).shape == (2, 3, 8)


def test_native_refuses_bad_input_without_crashing(native):
    batch = make_paged_batch([(5, 1), (9, 1)], 4, 6, 2, 16, seed=3)
    cache, meta = batch.cache, batch.meta
    op = torch.ops.chunkserve.paged_decode_attention
    bad_table = meta.block_table.clone()
    bad_table[1, 0] = cache.shape[1] + 3
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(batch.q, cache, bad_table, meta.seqused_k, 0.3)
    too_long = meta.seqused_k.clone()
    too_long[0] = 10_000
    with pytest.raises(RuntimeError, match="does not fit"):
        op(batch.q, cache, meta.block_table, too_long, 0.3)
    with pytest.raises(RuntimeError, match="float32"):
        op(batch.q.double(), cache, meta.block_table, meta.seqused_k, 0.3)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.chunkserve.write_kv(cache, batch.k_new, batch.v_new, meta.slot_mapping + 10_000)


def test_other_dtypes_and_layouts_keep_the_aten_path(native):
    """A bfloat16 cache (or any the op does not take) goes through the aten ops unchanged."""
    batch = make_paged_batch([(5, 1), (0, 3)], 4, dtype=torch.bfloat16, seed=4)
    ref_batch = make_paged_batch([(5, 1), (0, 3)], 4, dtype=torch.bfloat16, seed=4)
    out = _step(native, batch)
    ref = _step(get_backend("torch"), ref_batch)
    assert torch.equal(out, ref)


def test_use_native_needs_the_library_loaded(monkeypatch):
    monkeypatch.setattr(cpu_native, "_state", {"error": "no compiler"})
    with pytest.raises(RuntimeError, match="not loaded"):
        get_backend("torch").use_native()


def test_a_failed_build_is_a_reason_not_an_exception(tmp_path):
    """No compiler: load() says why (once), the process goes on. Own process: a load is once per process."""
    code = textwrap.dedent(
        """
        from chunkserve_kernels import cpu_native
        first = cpu_native.load()
        print(repr(first), repr(cpu_native.load() == first), cpu_native.loaded())
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no C++ compiler" in out.stdout and "True False" in out.stdout
    assert not any(tmp_path.iterdir())  # nothing built


def test_build_name_changes_with_what_it_is_built_from(monkeypatch):
    from chunkserve_contracts.cpu import CpuInfo

    name = cpu_native.build_name()
    monkeypatch.setattr(cpu_native, "CFLAGS", (*cpu_native.CFLAGS, "-DX"))
    flagged = cpu_native.build_name()
    assert flagged != name
    monkeypatch.setattr(cpu_native, "cpu_info", lambda: CpuInfo("another cpu", frozenset({"avx2"})))
    assert cpu_native.build_name() not in (name, flagged)


# --- residual add + RMSNorm ---------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 40),
    width=st.sampled_from([8, 24, 64, 100, 576]),
    residual=st.sampled_from([None, "float32"]),
    x_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    transposed=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_matches_aten(native, rows, width, residual, x_dtype, transposed, scale, seed):
    """The sum is bitwise `residual + x` (the old `h + y`, a bfloat16 y promoted exactly); the
    norm is F.rms_norm's within float32 rounding of a reordered sum of squares; x may be a
    transposed view (as the CPU GEMM returns)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(width, rows, generator=gen).t() if transposed else torch.randn(rows, width, generator=gen)
    x = (x * scale).to(x_dtype)
    h = None if residual is None else torch.randn(rows, width, generator=gen) * scale
    w = torch.randn(width, generator=gen)
    normed, s = torch.ops.chunkserve.add_rms_norm(x, h, w, 1e-5)
    want_s = x.float() if h is None else h + x
    assert torch.equal(s, want_s)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(want_s, (width,), w, 1e-5), rtol=2e-6, atol=1e-6)


def test_add_rms_norm_rows_do_not_depend_on_the_batch(native):
    """Large inputs split rows over threads; each row's result is what it is alone."""
    gen = torch.Generator().manual_seed(3)
    x, h, w = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen), torch.randn(576)
    normed, s = torch.ops.chunkserve.add_rms_norm(x, h, w, 1e-6)
    for i in (0, 17, 299):
        one, one_s = torch.ops.chunkserve.add_rms_norm(x[i : i + 1], h[i : i + 1], w, 1e-6)
        assert torch.equal(normed[i : i + 1], one) and torch.equal(s[i : i + 1], one_s)


# --- the few-row product (linear plan kernel "gemv") -------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 11),
    k=st.sampled_from([1, 7, 31, 32, 33, 64, 100, 576]),
    n=st.integers(1, 300),
    bias=st.booleans(),
    transposed=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_gemv_matches_a_float64_product(native, rows, k, n, bias, transposed, scale, seed):
    """x W^T (+ b) within float32 rounding of the float64 product (bounded by the sum of
    |x||w| terms, as any float32 summation order is), for widths below, at and off the
    32-lane blocks, rows in groups of 8 and a remainder, x a transposed view."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, rows, generator=gen).t() if transposed else torch.randn(rows, k, generator=gen)
    x = x * scale
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = torch.ops.chunkserve.gemv(x, w, b)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    bound = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs() <= 4 * k * 2**-24 * bound + 1e-30).all()


def test_gemv_rows_do_not_depend_on_the_batch_or_the_threads(native):
    """Each output is one thread's one dot product in a fixed order: a row's result is the
    same alone, in any group of rows, and with one thread or two (bitwise)."""
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(9, 576, generator=gen), torch.randn(1000, 576, generator=gen), torch.randn(1000)
    y = torch.ops.chunkserve.gemv(x, w, b)
    for i in range(9):
        assert torch.equal(torch.ops.chunkserve.gemv(x[i : i + 1], w, b), y[i : i + 1])
        # "gemv-stream": one row without the software prefetch is the same arithmetic
        assert torch.equal(torch.ops.chunkserve.gemv(x[i : i + 1], w, b, True), y[i : i + 1])
    assert torch.equal(torch.ops.chunkserve.gemv(x, w, b, True), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.chunkserve.gemv(x, w, b), y)
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(threads=st.integers(2, 9), n=st.integers(1, 5000), rows=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gemv_shares_every_weight_row_once_at_any_thread_count(native, threads, n, rows, seed):
    """Each thread reads its own run of weight rows and, once done, takes tasks from the back of
    another's. With more threads than cores (2-9 here, on any machine) the OS preempts threads
    mid-run, so the others steal; every output must still be its row's one dot product: equal
    to the one-thread result bitwise (a row no thread took would be whatever `empty` held)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, 64, generator=gen), torch.randn(n, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = torch.ops.chunkserve.gemv(x, w)
        torch.set_num_threads(threads)
        for _ in range(3):
            assert torch.equal(torch.ops.chunkserve.gemv(x, w), want)
            assert torch.equal(torch.ops.chunkserve.gemv(x, w, None, True), want)
    finally:
        torch.set_num_threads(before)


def test_gemv_refuses_bad_input_without_crashing(native):
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    bad = [
        ((x.double(), w, None), "x must be"),
        ((x[0], w, None), "x must be"),
        ((x, w.t().contiguous().t(), None), "weight must be"),
        ((x, w.half(), None), "weight must be"),
        ((torch.randn(2, 9), w, None), "columns"),
        ((x, w, torch.randn(4)), "bias must be"),
        ((x, w, torch.randn(5).double()), "bias must be"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.chunkserve.gemv(*args)
    assert torch.ops.chunkserve.gemv(torch.randn(0, 8), w).shape == (0, 5)


def test_decoder_layers_pass_the_residual_stream_bitwise_as_before(tiny_model):
    """The aten path of the residual-passing layers is bitwise `h = h + attn(norm(h)); h + mlp(norm(h))`."""
    from chunkserve_kernels import build_metadata, set_forward_context

    model = tiny_model
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ids = torch.randint(0, 64, (7,), generator=gen)
    meta, positions = build_metadata([7], [0], [[0, 1]], 4)
    cache = torch.zeros(2, 2, 2, 4, 2, 8)

    def old_forward():
        m = model.model
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(positions, h.dtype)
        for layer in m.layers:
            h = h + layer.self_attn.forward(layer.input_layernorm.forward(h), cos, sin)
            h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
        return m.norm(h)

    with torch.inference_mode():
        with set_forward_context(meta, cache.clone()):
            new = model(ids, positions)
        with set_forward_context(meta, cache.clone()):
            old = old_forward()
    assert torch.equal(new, old)


# --- the executor's start-up phase (executor_svc/worker.load_native_kernels) -------------------


def test_setup_switches_every_layer_or_says_why(native, tiny_model, monkeypatch, caplog):
    from types import SimpleNamespace

    from executor_svc.config import ExecutorConfig
    from executor_svc.models.layers import RMSNorm
    from executor_svc.worker import Placement, load_native_kernels

    def place(backend="torch", dtype=torch.float32):
        name = SimpleNamespace(name=backend)
        return Placement(torch.device("cpu"), dtype, None, None, tiny_model.backend if backend == "torch" else name)

    def setup(choice, where):
        return load_native_kernels(tiny_model, ExecutorConfig(cpu_kernels=choice), where)

    norms = [m for m in tiny_model.modules() if isinstance(m, RMSNorm)]
    assert setup("auto", place())
    assert tiny_model.backend.native and len(norms) == 5 and all(n.native for n in norms)
    tiny_model.use_native_kernels(False)
    assert not tiny_model.backend.native and not any(n.native for n in norms)
    assert not setup("torch", place())
    assert not setup("auto", place("torch_ref"))
    with pytest.raises(ValueError, match="needs --device cpu"):
        setup("native", place("triton"))
    with pytest.raises(ValueError, match="needs --device cpu"):
        setup("native", place(dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_native, "load", lambda: "RuntimeError: no C++ compiler")
    with caplog.at_level(logging.WARNING):
        assert not setup("auto", place())
    assert "no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match="did not build or load: RuntimeError: no C\\+\\+ compiler"):
        setup("native", place())
    assert not tiny_model.backend.native and not any(n.native for n in norms)


@pytest.fixture
def tiny_model():
    from chunkserve.launch import tiny_llama_config
    from executor_svc.models.llama import LlamaForCausalLM

    config = tiny_llama_config(hidden_size=32, intermediate_size=64, vocab_size=64, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def test_cli_flag_is_validated():
    from executor_svc.config import ExecutorConfig

    with pytest.raises(ValueError, match="--cpu-kernels must be one of auto, native, torch"):
        ExecutorConfig(cpu_kernels="fast")
    assert all(Path(src).exists() for src in cpu_native.SOURCES)
