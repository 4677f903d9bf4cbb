"""Paged attention: the fast `torch` backend against the `torch_ref` oracle, and the oracle
against dense causal attention over unpaged K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_kernels import build_metadata, get_backend, get_forward_context, set_forward_context

MIXED = [(0, 7), (5, 1), (13, 1), (20, 6), (0, 1), (31, 1), (3, 2)]  # (context_before, query_len)
DECODE_ONLY_RAGGED = [(4, 1), (17, 1), (0, 1), (33, 1)]
DECODE_ONLY_EQUAL = [(9, 1), (9, 1), (9, 1)]
PREFILL_ONLY = [(0, 12), (8, 5)]


def _run(backend_name, batch, scale=0.25):
    backend = get_backend(backend_name)
    backend.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    return backend.forward(batch.q, batch.cache, batch.meta, scale)


def _column_major(q: torch.Tensor) -> torch.Tensor:
    """q with the same values laid out as a linear's transposed view ((W @ x^T)^T) leaves it."""
    t, h, d = q.shape
    return q.reshape(t, h * d).t().contiguous().t().view(t, h, d)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seqs", [MIXED, DECODE_ONLY_RAGGED, DECODE_ONLY_EQUAL, PREFILL_ONLY])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_torch_backend_matches_reference(paged_batch, block_size, seqs, dtype, atol, layout):
    batch = paged_batch(seqs, block_size, dtype=dtype, seed=block_size)
    ref_batch = paged_batch(seqs, block_size, dtype=dtype, seed=block_size)
    if layout == "column-major":
        batch.q = _column_major(batch.q)
    out = _run("torch", batch)
    ref = _run("torch_ref", ref_batch)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_torch_backend_reuses_plan_across_layers(paged_batch):
    """Two layers of one step share the metadata; the second must see its own cache."""
    batch = paged_batch(MIXED, 4, seed=1)
    backend = get_backend("torch")
    other = torch.randn_like(batch.cache)
    first = backend.forward(batch.q, batch.cache, batch.meta, 0.25)
    second = backend.forward(batch.q, other, batch.meta, 0.25)
    ref = get_backend("torch_ref").forward(batch.q, other, batch.meta, 0.25)
    torch.testing.assert_close(second, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_reference_matches_dense_causal_attention(paged_batch, block_size):
    """Page a full sequence's K/V, query its last q tokens: rows must equal dense SDPA."""
    num_q, num_kv, dim, scale = 6, 2, 8, 0.3
    gen = torch.Generator().manual_seed(7)
    seqs = [(0, 10), (9, 4), (22, 1)]
    batch = paged_batch(seqs, block_size, num_q, num_kv, dim, torch.float64, seed=3)
    dense_qs, expected = [], []
    for i, (before, q_len) in enumerate(seqs):
        total = before + q_len
        k = torch.randn(total, num_kv, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(total, num_kv, dim, generator=gen, dtype=torch.float64)
        q = torch.randn(total, num_q, dim, generator=gen, dtype=torch.float64)
        for p in range(total):
            block = batch.block_tables[i][p // block_size]
            batch.cache[0, block, p % block_size] = k[p]
            batch.cache[1, block, p % block_size] = v[p]
        dense = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(num_q // num_kv, 1).transpose(0, 1),
            v.repeat_interleave(num_q // num_kv, 1).transpose(0, 1),
            is_causal=True,
            scale=scale,
        ).transpose(0, 1)
        dense_qs.append(q[before:])
        expected.append(dense[before:])
    out = get_backend("torch_ref").forward(torch.cat(dense_qs), batch.cache, batch.meta, scale)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-10, rtol=0)


def test_write_kv_places_tokens_at_their_slots(paged_batch):
    block_size, seqs = 4, [(3, 6), (0, 1), (10, 1)]
    batch = paged_batch(seqs, block_size, seed=5)
    batch.cache.zero_()
    get_backend("torch").write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    token = 0
    for i, (before, q_len) in enumerate(seqs):
        for p in range(before, before + q_len):
            block, offset = batch.block_tables[i][p // block_size], p % block_size
            assert torch.equal(batch.cache[0, block, offset], batch.k_new[token])
            assert torch.equal(batch.cache[1, block, offset], batch.v_new[token])
            batch.cache[:, block, offset] = 0
            token += 1
    assert token == batch.k_new.shape[0]
    assert not batch.cache.any(), "write_kv touched slots outside the step's new tokens"


def test_build_metadata_positions_slots_and_lengths():
    meta, positions = build_metadata([3, 1, 2], [0, 6, 4], [[7, 2], [5, 0], [1, 9, 4]], 4, "cpu")
    assert positions.tolist() == [0, 1, 2, 6, 4, 5]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 2, 36, 37]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4, 6] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seqused_k.tolist() == [3, 7, 6] and meta.context_lens == [3, 7, 6]
    assert meta.block_table.tolist() == [[7, 2, 0], [5, 0, 0], [1, 9, 4]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (3, 7)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 90)), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_build_metadata_small_and_large_steps_give_the_same_tensors(seqs, block_size, seed):
    """Steps up to SMALL_STEP_TOKENS work out positions and slots in Python lists, larger ones
    with vectorized ops: both paths, forced on the same random steps, give equal tensors of
    equal dtypes (tables of distinct shuffled blocks, padded to the longest)."""
    import random
    from unittest import mock

    from chunkserve_kernels import metadata

    rng = random.Random(seed)
    query_lens, before = [q for q, _ in seqs], [b for _, b in seqs]
    pool = list(range(sum(-(-(b + q) // block_size) + 2 for q, b in seqs)))
    rng.shuffle(pool)
    tables = []
    for q, b in seqs:
        n = -(-(b + q) // block_size) + rng.randint(0, 2)
        tables.append([pool.pop() for _ in range(n)])
    built = {}
    for bound in (0, 10**9):  # every step large, every step small
        with mock.patch.object(metadata, "SMALL_STEP_TOKENS", bound):
            built[bound] = build_metadata(query_lens, before, tables, block_size, "cpu")
    (large, large_pos), (small, small_pos) = built[0], built[10**9]
    assert small_pos.equal(large_pos) and small_pos.dtype == large_pos.dtype == torch.int64
    for name in ("cu_seqlens_q", "seqused_k", "block_table", "slot_mapping"):
        a, b = getattr(small, name), getattr(large, name)
        assert a.equal(b) and a.dtype == b.dtype, name
    assert small.slot_mapping.dtype == torch.int64 and small.block_table.dtype == torch.int32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([4], [3], [[0]], 4), "cannot hold 7 tokens"),
        (([0], [3], [[0]], 4), "query_len must be >= 1"),
        (([1, 1], [3], [[0]], 4), "one entry per sequence"),
        (([], [], [], 4), "at least one sequence"),
    ],
)
def test_build_metadata_refuses_inconsistent_input(args, message):
    with pytest.raises(ValueError, match=message):
        build_metadata(*args, "cpu")


def test_backends_refuse_unsupported_dtype_and_block_size():
    backend = get_backend("torch")
    with pytest.raises(ValueError, match=r"does not support dtype float16; use one of: float32, bfloat16"):
        backend.check_dtype(torch.float16)
    backend.check_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="block_size must be positive"):
        backend.check_block_size(0)
    backend.check_block_size(3)
    with pytest.raises(ValueError, match="known: flash_attn, torch, torch_ref, triton"):
        get_backend("flash_attn_v9")


def test_forward_context_rules(paged_batch):
    batch = paged_batch([(0, 2)], 4)
    cache = batch.cache.unsqueeze(0)
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with set_forward_context(batch.meta, cache):
        assert get_forward_context().kv_cache is cache
        with pytest.raises(RuntimeError, match="nested forward"):
            with set_forward_context(batch.meta, cache):
                pass
    with pytest.raises(ValueError, match="block size 2 does not match"):
        with set_forward_context(batch.meta, torch.zeros(1, 2, 3, 2, 3, 16)):
            pass
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_of_a_transposed_q_take_sdpa_flash_kernel(paged_batch, dtype):
    """A linear's output is often a transposed view ((W @ x^T)^T: models/layers.linear, the
    16-bit copies from 12 rows), so q's head dimension is not unit-stride. SDPA's CPU flash
    kernel refuses that layout and torch falls back to its math path, 5.8x slower for a
    2K-token chunk (issue 31): the backend must hand SDPA a q it takes, whatever its layout."""
    from torch.profiler import profile

    batch = paged_batch(PREFILL_ONLY, 4, dtype=dtype, seed=5)
    transposed = _column_major(batch.q)
    assert transposed.stride(-1) != 1 and torch.equal(transposed, batch.q)
    backend = get_backend("torch")
    backend.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    expected = backend.forward(batch.q, batch.cache, batch.meta, 0.25)
    with profile() as prof:
        got = backend.forward(transposed, batch.cache, batch.meta, 0.25)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
