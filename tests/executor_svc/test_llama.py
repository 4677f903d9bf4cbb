"""Our Llama-family models against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from executor_svc.models import get_model_class

TOL = dict(atol=2e-5, rtol=1e-4)


def _ours(hf_model, dtype=torch.float32, backend="torch"):
    model = get_model_class(hf_model.config)(hf_model.config, backend, dtype)
    model.load_weights(hf_model.state_dict().items())
    return model


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def test_full_prompt_logits_match_hf(tiny_configs, config_name, hf_model_factory, paged_runner):
    hf = hf_model_factory(tiny_configs[config_name]())
    model = _ours(hf)
    tokens = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = paged_runner(model, block_size=4).step({0: tokens})[0]
    torch.testing.assert_close(model.compute_logits(hidden), _hf_logits(hf, tokens), **TOL)


@pytest.mark.parametrize(("block_size", "chunks"), [(4, [5, 1, 7]), (16, [3, 3, 3, 3]), (1, [13])])
def test_chunked_prefill_then_decode_matches_hf(
    tiny_configs, config_name, hf_model_factory, paged_runner, block_size, chunks
):
    """Two sequences share every step: one prefills in chunks while the other decodes, then
    both decode token by token. Each sampled row must equal HF's logits at that position."""
    hf = hf_model_factory(tiny_configs[config_name](), seed=2)
    model = _ours(hf)
    gen = torch.Generator().manual_seed(3)
    seq_a = torch.randint(0, 128, (sum(chunks) + 6,), generator=gen).tolist()
    seq_b = torch.randint(0, 128, (len(chunks) + 12,), generator=gen).tolist()
    ref = {0: _hf_logits(hf, seq_a), 1: _hf_logits(hf, seq_b)}
    runner = paged_runner(model, block_size, num_blocks=80, seed=block_size)
    done = {0: 0, 1: 0}
    runner.step({1: seq_b[:6]})
    done[1] = 6
    plan = [{0: c, 1: 1} for c in chunks] + [{0: 1, 1: 1}] * 6
    for work in plan:
        # Alternate which sequence comes first so decodes are not always tokens 0..D-1.
        order = sorted(work, reverse=len(work) % 2 == 0 and done[0] % 2 == 1)
        step = {sid: (seq_a, seq_b)[sid][done[sid] : done[sid] + work[sid]] for sid in order}
        hidden = runner.step(step)
        for sid, rows in hidden.items():
            done[sid] += len(step[sid])
            logits = model.compute_logits(rows[-1:])
            torch.testing.assert_close(logits[0], ref[sid][done[sid] - 1], **TOL)
    assert done[0] == len(seq_a)


def test_bf16_forward_tracks_fp32(tiny_configs, hf_model_factory, paged_runner):
    hf = hf_model_factory(tiny_configs["smollm_tied"]())
    tokens = list(range(3, 40))
    fp32 = _ours(hf)
    bf16 = _ours(hf, torch.bfloat16)
    a = fp32.compute_logits(paged_runner(fp32, 4).step({0: tokens})[0])
    b = bf16.compute_logits(paged_runner(bf16, 4).step({0: tokens})[0])
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99


def test_reference_backend_gives_same_model_output(tiny_configs, hf_model_factory, paged_runner):
    hf = hf_model_factory(tiny_configs["llama"]())
    tokens = list(range(1, 30))
    fast = paged_runner(_ours(hf), 4).step({0: tokens[:20]})[0]
    ref = paged_runner(_ours(hf, backend="torch_ref"), 4).step({0: tokens[:20]})[0]
    torch.testing.assert_close(fast, ref, **TOL)


def test_unsupported_architecture_is_refused():
    config = transformers.GPT2Config(n_layer=1)
    config.architectures = ["GPT2LMHeadModel"]
    supported = "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=f"GPT2LMHeadModel.*{supported}"):
        get_model_class(config)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}])
def test_unsupported_rope_type_is_refused(tiny_configs, rope):
    config = tiny_configs["llama"]()
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=f"unsupported rope_type '{rope['rope_type']}'; supported: default, llama3"):
        get_model_class(config)(config)


def test_weight_loading_is_strict(tiny_configs, hf_model_factory):
    hf = hf_model_factory(tiny_configs["llama"]())
    model = get_model_class(hf.config)(hf.config)
    state = dict(hf.state_dict())
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 weights: model.layers.1.self_attn.qkv_proj.weight\[k\]"):
        model.load_weights(state.items())
    with pytest.raises(ValueError, match="has no matching model parameter"):
        model.load_weights([("model.layers.0.self_attn.rope.weight", torch.zeros(1))])


def test_sliding_window_caps_max_model_len(tiny_configs):
    config = tiny_configs["mistral"]()
    config.sliding_window = 64
    config.architectures = ["MistralForCausalLM"]
    assert get_model_class(config)(config).max_model_len == 64


def test_rotary_tables_on_cpu_equal_computing_and_do_not_depend_on_the_step():
    """On a CPU cos/sin come from tables grown in blocks (layers.RotaryEmbedding): equal bit for
    bit to computing them per step where that is all vector arithmetic (head_dim 64), a
    position's rows the same whatever else the step holds (head_dim 80: 40 frequencies, where a
    per-step tensor of 3 tokens would end in the scalar cos), and rows kept as they grow."""
    from executor_svc.models.layers import RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0}
    rot = RotaryEmbedding(64, params, "cpu")
    positions = torch.tensor([0, 5, 511, 512, 4095, 1])
    cos, sin = rot(positions, torch.float32)
    want_cos, want_sin = rot._compute(positions)
    assert torch.equal(cos, want_cos.unsqueeze(1)) and torch.equal(sin, want_sin.unsqueeze(1))
    first, _ = rot.tables(1)
    assert first.shape[0] >= 4096 and first.shape[0] % RotaryEmbedding.TABLE_BLOCK == 0
    grown, _ = rot.tables(first.shape[0] + 1)
    assert grown.shape[0] >= 2 * first.shape[0] and torch.equal(grown[: first.shape[0]], first)
    odd = RotaryEmbedding(80, params, "cpu")
    alone = [odd(torch.tensor([p]), torch.float32) for p in (7, 300, 2000)]
    together = odd(torch.tensor([7, 300, 2000]), torch.float32)
    for i, (c, s) in enumerate(alone):
        assert torch.equal(together[0][i], c[0]) and torch.equal(together[1][i], s[0])
    bf16 = rot(positions, torch.bfloat16)
    assert torch.equal(bf16[0], cos.to(torch.bfloat16)) and bf16[0].shape == (6, 1, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bitwise_hf(dtype):
    """apply_rotary with the full-width tables RotaryEmbedding builds once per step (issue 18)
    equals HF's `q*cos + rotate_half(q)*sin` bit for bit, on a strided q/k slice like the model's."""
    from transformers.models.llama.modeling_llama import rotate_half

    from executor_svc.models.layers import RotaryEmbedding, apply_rotary

    head_dim, positions = 64, torch.tensor([0, 5, 130, 4095])
    rot = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0}, "cpu")
    qkv = torch.randn(4, 15, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    x = qkv[:, :12]
    cos, sin = rot(positions, dtype)
    freqs = positions.float()[:, None] * rot.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    hf_cos, hf_sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    assert torch.equal(apply_rotary(x, cos, sin), x * hf_cos + rotate_half(x) * hf_sin)
