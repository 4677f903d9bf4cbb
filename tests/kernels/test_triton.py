"""The Triton kernels on CPU, through Triton's interpreter, against the torch_ref oracle.

TRITON_INTERPRET=1 is read when triton itself and each kernel are imported, and an
interpreting triton cannot compile real GPU kernels afterwards (its own library functions
become interpreted ones). So the interpreter never runs in the main pytest process: there,
this module is ONE test that re-runs this file in a child pytest with TRITON_INTERPRET=1
set from the start, and shows the child's report if it fails. In the child (or when you
run `TRITON_INTERPRET=1 pytest tests/kernels/test_triton.py` yourself) the cases of
`_InterpretedCases` run one by one. Shapes are tiny: the interpreter runs every program
instance in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chunkserve_kernels import build_metadata, get_backend, set_forward_context

pytest.importorskip("triton")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETING:
    from chunkserve_kernels import triton_attn as ta  # decorated under the interpreter

MIXED = [(0, 7), (5, 1), (13, 1), (20, 6), (0, 1), (31, 1), (3, 2)]  # (context_before, query_len)
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}  # several key tiles and query tiles per sequence
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _reference(batch, scale):
    ref = get_backend("torch_ref")
    cache = batch.cache.clone()
    ref.write_kv(cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    return ref.forward(batch.q, cache, batch.meta, scale), cache


def _check(batch, scale=0.3, config=SMALL_TILES):
    expected, expected_cache = _reference(batch, scale)
    ta.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    assert torch.equal(batch.cache, expected_cache)
    out = ta.paged_attention(batch.q, batch.cache, batch.meta, scale, config)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[batch.q.dtype], rtol=0)


@pytest.mark.skipif(INTERPRETING, reason="this is the parent: it starts the interpreter run")
@pytest.mark.slow  # ~25 s in Triton's interpreter
def test_triton_kernels_under_the_interpreter(request):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    child = subprocess.run(cmd, env=env, cwd=request.config.rootpath, capture_output=True, text=True, timeout=900)
    report = child.stdout[-8000:] + child.stderr[-2000:]
    assert child.returncode == 0, f"interpreted Triton tests failed:\n{report}"
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, report
    print(summary)


class _InterpretedCases:
    """Collected only in the interpreter child (as TestInterpreted, bottom of the file)."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("block_size", [1, 3, 4, 16])
    def test_mixed_batch_matches_reference(self, paged_batch, block_size, dtype):
        """Prefill chunks (fresh and on top of cached context) and decodes in ONE launch,
        contexts across block boundaries, shuffled non-contiguous blocks, GQA 9/3."""
        _check(paged_batch(MIXED, block_size, 9, 3, 16, dtype, seed=block_size))

    @pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 2), (6, 6), (32, 1)])
    def test_gqa_groups(self, paged_batch, num_q_heads, num_kv_heads):
        """Group of 2, no grouping (MHA), and a group wider than the 16-row tile (MQA 32)."""
        seqs = [(3, 5), (9, 1), (0, 1), (17, 2)]
        _check(paged_batch(seqs, 4, num_q_heads, num_kv_heads, 16, torch.float32, seed=num_q_heads), config=None)

    @pytest.mark.parametrize(
        "seqs",
        [
            [(4, 1), (17, 1), (0, 1), (33, 1)],  # decode only, ragged contexts
            [(0, 12), (8, 5)],  # prefill only
            [(70, 3), (45, 1), (0, 40)],  # long: many key tiles, several query tiles
        ],
        ids=["decode", "prefill", "long"],
    )
    @pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default_tiles", "small_tiles"])
    def test_batch_shapes(self, paged_batch, seqs, config):
        _check(paged_batch(seqs, 8, 4, 2, 16, torch.float32, seed=len(seqs)), config=config)

    @pytest.mark.parametrize("splits", [2, 3, 7])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_decode_split_over_the_context_matches_reference(self, paged_batch, splits, dtype):
        """Flash-decoding: each (sequence, KV head) runs `splits` shares of its keys, merged
        by a second kernel. Contexts from 1 key (every share but one empty) to several key
        tiles per share, blocks of 3, GQA 8/2."""
        seqs = [(0, 1), (4, 1), (17, 1), (95, 1), (33, 1), (63, 1)]
        _check(paged_batch(seqs, 3, 8, 2, 16, dtype, seed=splits), config={**SMALL_TILES, "SPLITS": splits})

    def test_decode_split_with_a_group_wider_than_the_tile(self, paged_batch):
        """MQA 32/1 (two 16-row tiles' worth of heads in one program) split in 4."""
        seqs = [(40, 1), (2, 1)]
        _check(
            paged_batch(seqs, 4, 32, 1, 16, torch.float32, seed=3), config={"BLOCK_M": 32, "BLOCK_N": 16, "SPLITS": 4}
        )

    def test_decode_splits_only_on_cuda_and_only_where_the_batch_leaves_room(self, monkeypatch):
        assert ta.decode_splits(1, 8, torch.device("cpu")) == 1
        monkeypatch.setitem(ta._SM_COUNT, 0, 132)  # an H200's multiprocessors
        cuda = torch.device("cuda", 0)
        assert [ta.decode_splits(n, 8, cuda) for n in (1, 2, 4, 16, 32, 33, 128)] == [16, 16, 9, 3, 2, 1, 1]

    @pytest.mark.parametrize("head_dim", [8, 24])
    def test_head_dims_below_and_off_power_of_two(self, paged_batch, head_dim):
        """The head axis is padded to a power of two >= 16 inside the kernel and masked."""
        _check(paged_batch([(5, 3), (11, 1)], 4, 4, 2, head_dim, torch.float32, seed=head_dim))

    def test_strided_views_are_read_in_place(self, paged_batch):
        """The model passes views of its fused qkv output (token stride wider than
        heads * head_dim); the kernels read them through their strides."""
        batch = paged_batch(MIXED, 4, 4, 2, 16, torch.float32, seed=11)
        expected, expected_cache = _reference(batch, 0.3)
        qkv = torch.cat([batch.q, batch.k_new, batch.v_new], dim=1)  # [T, 4 + 2 + 2, D]
        q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        assert not q.is_contiguous() and not k.is_contiguous()
        ta.write_kv(batch.cache, k, v, batch.meta.slot_mapping)
        assert torch.equal(batch.cache, expected_cache)
        out = ta.paged_attention(q, batch.cache, batch.meta, 0.3, SMALL_TILES)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_write_kv_touches_only_the_new_slots(self, paged_batch, dtype):
        batch = paged_batch([(3, 6), (0, 1), (10, 1)], 4, 4, 2, 16, dtype, seed=5)
        before = batch.cache.clone()
        slots = batch.meta.slot_mapping.clone()
        slots[1] = -1  # a padding token is skipped
        ta.write_kv(batch.cache, batch.k_new, batch.v_new, slots)
        expected = before.view(2, -1, 2, 16).clone()
        keep = slots >= 0
        expected[0, slots[keep]] = batch.k_new[keep]
        expected[1, slots[keep]] = batch.v_new[keep]
        assert torch.equal(batch.cache.view(2, -1, 2, 16), expected)

    def test_model_steps_match_the_torch_backend(self):
        """A 2-layer Llama through the registry name "triton": a chunked prefill next to
        a decode, then a decode step; hidden states equal the torch backend's."""
        from chunkserve.launch import tiny_llama_config
        from executor_svc.models.llama import LlamaForCausalLM

        torch.manual_seed(0)
        cfg = tiny_llama_config(max_position_embeddings=2048)
        models = {name: LlamaForCausalLM(cfg, name, torch.float32) for name in ("triton", "torch")}
        with torch.no_grad():
            for p in models["torch"].parameters():
                p.normal_(0, 0.2)
        models["triton"].load_state_dict(models["torch"].state_dict())
        caches = {name: torch.zeros(2, 2, 12, 4, 2, 16) for name in models}
        steps = [([9, 5], [0, 0], [[3, 7, 1], [10, 4]]), ([1, 1], [9, 5], [[3, 7, 1], [10, 4]])]
        gen = torch.Generator().manual_seed(1)
        for q_lens, before, tables in steps:
            meta, pos = build_metadata(q_lens, before, tables, 4)
            ids = torch.randint(0, 128, (sum(q_lens),), generator=gen)
            out = {}
            for name, model in models.items():
                meta.scratch.clear()
                with torch.inference_mode(), set_forward_context(meta, caches[name]):
                    out[name] = model(ids, pos)
            torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 96), (3, 100)])
    @pytest.mark.parametrize("residual", [True, False])
    def test_add_rms_norm_matches_the_torch_path(self, dtype, rows, width, residual):
        """triton_norm's one kernel against RMSNorm.add_forward's torch ops (HF's order): the
        sum bitwise, the normed row within a unit in the dtype's last place; widths off a power
        of two (masked lanes), a row stride wider than the row (a view), no residual (the first
        layer: the sum is x itself)."""
        from chunkserve_kernels import triton_norm
        from executor_svc.models.layers import RMSNorm

        gen = torch.Generator().manual_seed(rows * width)
        x = (torch.randn(rows, width + 8, generator=gen) * 3).to(dtype)[:, :width]  # a strided view
        r = torch.randn(rows, width, generator=gen).to(dtype) if residual else None
        norm = RMSNorm(width, 1e-5, dtype, "cpu")
        with torch.no_grad():
            norm.weight.copy_(torch.rand(width, generator=gen) + 0.5)
        expected, expected_sum = norm.add_forward(x, r)
        assert triton_norm.supports(x, r, norm.weight)
        out, total = triton_norm.add_rms_norm(x, r, norm.weight, norm.eps)
        assert total.dtype == out.dtype == dtype and torch.equal(total, expected_sum)
        ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        torch.testing.assert_close(out, expected, rtol=ulp, atol=1e-6)
        assert (out == expected).float().mean() > 0.9  # a unit off is the exception, not the rule

    def test_add_rms_norm_supports_only_16_bit_rows_of_one_dtype(self):
        from chunkserve_kernels import triton_norm

        x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
        assert triton_norm.supports(x, None, w) and triton_norm.supports(x, x.clone(), w)
        assert not triton_norm.supports(x.float(), None, w.float())  # float32: torch's path, the exact mode
        assert not triton_norm.supports(x, x.half(), w)
        assert not triton_norm.supports(x, None, w.half())
        assert not triton_norm.supports(x.t(), None, torch.ones(2, dtype=torch.bfloat16))  # columns not unit-stride
        assert not triton_norm.supports(x[0], None, w)

    def test_a_16_bit_model_with_triton_norms_matches_torch_norms(self, monkeypatch):
        """A 2-layer bfloat16 Llama (torch attention) with use_triton_norms: every add + norm
        goes through the kernel (the first layer's without a residual), and the hidden states
        match the model's on torch's norms within bfloat16's rounding."""
        from chunkserve.launch import tiny_llama_config
        from chunkserve_kernels import triton_norm
        from executor_svc.models.llama import LlamaForCausalLM

        calls, kernel = [], triton_norm.add_rms_norm
        monkeypatch.setattr(
            triton_norm, "add_rms_norm", lambda x, r, w, eps: calls.append(r is None) or kernel(x, r, w, eps)
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=2048), "torch", torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        meta, pos = build_metadata([9, 1], [0, 4], [[3, 7, 1], [10, 4]], 4)
        ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(1))
        out = {}
        for triton_on in (False, True):
            assert model.use_triton_norms(triton_on) is triton_on
            cache = torch.zeros(2, 2, 12, 4, 2, 16, dtype=torch.bfloat16)
            meta.scratch.clear()
            with torch.inference_mode(), set_forward_context(meta, cache):
                out[triton_on] = model(ids, pos)
        assert calls == [True, False, False, False, False]  # 2 layers' two norms, then the final norm
        torch.testing.assert_close(out[True].float(), out[False].float(), rtol=0.05, atol=0.05)

    def test_registered_backend_declares_its_limits(self):
        backend = get_backend("triton")
        assert isinstance(backend, ta.TritonBackend)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            backend.check_dtype(dtype)
        with pytest.raises(ValueError, match="float64"):
            backend.check_dtype(torch.float64)
        for block_size in (1, 3, 16, 256):
            backend.check_block_size(block_size)
        backend.check_head_size(80)
        with pytest.raises(ValueError, match="head sizes 1..256"):
            backend.check_head_size(512)

    def test_tile_config(self):
        assert ta.tile_config(1, 4, 128)["BLOCK_M"] == 16  # decode: one GQA group per tile
        assert ta.tile_config(1, 32, 128)["BLOCK_M"] == 32
        assert ta.tile_config(2048, 4, 128) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}
        assert ta.tile_config(7, 4, 256)["BLOCK_N"] == 32
        assert ta.tile_config(7, 4, 128, elem_bytes=4)["BLOCK_N"] == 32


if INTERPRETING:
    TestInterpreted = _InterpretedCases
