"""`--attention-backend auto`, what each backend declares, and the flash_attn call contract.

None of this needs a GPU: the choice is made from the device, dtype, block size and which
packages are installed; flash_attn's argument mapping is checked against a stand-in that
implements the documented semantics of `flash_attn_varlen_func` with a block table.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import chunkserve_kernels.backend as backend_mod
from chunkserve.launch import tiny_llama_config
from chunkserve_kernels import choose_backend, get_backend


@pytest.mark.parametrize(
    ("device", "dtype", "block_size", "installed", "expected"),
    [
        ("cpu", torch.float32, 256, {"flash_attn", "triton"}, "torch"),
        ("cuda", torch.bfloat16, 256, {"flash_attn", "triton"}, "flash_attn"),
        ("cuda", torch.bfloat16, 512, {"flash_attn"}, "flash_attn"),
        ("cuda", torch.bfloat16, 16, {"flash_attn", "triton"}, "triton"),  # FA2 pages only in 256s
        ("cuda", torch.float32, 256, {"flash_attn", "triton"}, "triton"),  # FA2 has no float32
        ("cuda", torch.bfloat16, 256, {"triton"}, "triton"),
        ("cuda", torch.bfloat16, 16, {"flash_attn"}, "torch"),
        ("cuda", torch.bfloat16, 16, set(), "torch"),
    ],
)
def test_auto_choice(monkeypatch, device, dtype, block_size, installed, expected):
    monkeypatch.setattr(backend_mod, "_importable", lambda name: name in installed)
    assert choose_backend(torch.device(device), dtype, block_size) == expected


def test_flash_attn_declares_its_limits_in_plain_words():
    fa = get_backend("flash_attn")  # importable without flash_attn: it is imported lazily
    fa.check_block_size(256)
    fa.check_block_size(512)
    with pytest.raises(ValueError, match="multiple of 256.*got 16.*--block-size 256"):
        fa.check_block_size(16)
    with pytest.raises(ValueError, match="float32"):
        fa.check_dtype(torch.float32)
    fa.check_dtype(torch.bfloat16)
    fa.check_head_size(128)
    for bad in (20, 512):
        with pytest.raises(ValueError, match="multiples of 8 up to 256"):
            fa.check_head_size(bad)


def test_model_start_up_refuses_a_head_size_the_backend_cannot_run():
    from executor_svc.models.llama import LlamaForCausalLM

    cfg = tiny_llama_config(
        hidden_size=80, intermediate_size=32, num_hidden_layers=1, vocab_size=16, max_position_embeddings=2048
    )  # head_dim 20
    with pytest.raises(ValueError, match="got 20"):
        LlamaForCausalLM(cfg, "flash_attn", torch.bfloat16)
    LlamaForCausalLM(cfg, "torch", torch.float32)


def _documented_varlen(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    block_table=None,
    **unused,
):
    """flash_attn_varlen_func as its docstring describes it, paged: sequence b has
    cu_seqlens_k[b+1] - cu_seqlens_k[b] keys found through block_table[b]; causal is
    bottom-right aligned; GQA maps query head h to KV head h // (Hq / Hkv)."""
    assert causal and block_table is not None and block_table.dtype == torch.int32
    assert cu_seqlens_k.dtype == torch.int32 and not unused
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert q1 - q0 <= max_seqlen_q and n_k <= max_seqlen_k
        pos = torch.arange(n_k)
        blocks = block_table[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].repeat_interleave(group, 1)
        v = v_cache[blocks, pos % block_size].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k.float()) * softmax_scale
        q_pos = torch.arange(n_k - (q1 - q0), n_k)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
    return out


def test_flash_attn_passes_the_paged_cache_as_documented(monkeypatch, paged_batch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_documented_varlen))
    seqs = [(0, 7), (5, 1), (300, 1), (20, 6), (257, 3)]
    batch = paged_batch(seqs, 256, 8, 2, 16, torch.bfloat16, seed=3)
    ref_cache = batch.cache.clone()
    fa, ref = get_backend("flash_attn"), get_backend("torch_ref")
    fa.write_kv(batch.cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    ref.write_kv(ref_cache, batch.k_new, batch.v_new, batch.meta.slot_mapping)
    out = fa.forward(batch.q, batch.cache, batch.meta, 0.25)
    expected = ref.forward(batch.q, ref_cache, batch.meta, 0.25)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)
    assert batch.meta.scratch["flash_attn"].tolist() == [0, 7, 13, 314, 340, 600]
