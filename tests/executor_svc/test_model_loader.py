"""Model resolution and loading: local folders, refusals, and the real default model (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.config import default_cache_dir
from executor_svc.model_loader import load_model, resolve_model


def test_load_saved_hf_folder_matches_hf(tmp_path, tiny_configs, hf_model_factory, paged_runner):
    hf = hf_model_factory(tiny_configs["qwen2_bias"]())
    hf.save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")
    assert config.architectures == ["Qwen2ForCausalLM"]
    tokens = [5, 9, 77, 3, 12, 100, 42]
    hidden = paged_runner(model, block_size=4).step({0: tokens})[0]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=2e-5, rtol=1e-4)


def test_load_in_bf16_converts_weights(tmp_path, tiny_configs, hf_model_factory):
    hf_model_factory(tiny_configs["llama"]()).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), "torch")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unsupported_architecture_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    supported = "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=rf"\['GPT2LMHeadModel'\]; {supported}"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")


def test_unsupported_dtype_for_backend_refused(tmp_path, tiny_configs, hf_model_factory):
    hf_model_factory(tiny_configs["llama"]()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not support dtype float16"):
        load_model(tmp_path, torch.float16, torch.device("cpu"), "torch")


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "no-such-model", "weights.gguf"])
def test_resolve_refuses_names_it_cannot_find_locally(tmp_path, name):
    with pytest.raises(ValueError, match="no hub downloads; pass a local folder or .gguf"):
        resolve_model(name, tmp_path)
    assert not (tmp_path / "models").exists()


def test_resolve_refuses_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path), tmp_path / "cache")


def test_unsupported_gguf_refused_before_conversion(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: llama, mistral, qwen2"):
        resolve_model(str(path), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_default_model_greedy_next_token_matches_hf(paged_runner):
    """The real SmolLM2-135M-Instruct: our greedy next token equals transformers' forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(None, default_cache_dir())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tokenizer.chat_template, "the converted folder must carry the chat template"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    model, _ = load_model(path, torch.float32, torch.device("cpu"), "torch")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompts = ["The capital of France is", "def fibonacci(n):", chat]
    runner = paged_runner(model, block_size=16, num_blocks=64)
    for sid, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        hidden = runner.step({sid: ids})[sid]
        ours = model.compute_logits(hidden[-1:])[0]
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0, -1].float()
        assert int(ours.argmax()) == int(theirs.argmax()), prompt
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", ["llama", "smollm_tied"])
def test_cpu_linear_weights_lie_in_one_buffer_in_step_order(tmp_path, tiny_configs, hf_model_factory, name):
    """models/weights.one_buffer: the weights a decode step reads, back to back in the order it
    reads them, each on a cache line, loaded with the checkpoint's values; a tied head is still
    the embedding's very tensor."""
    hf = hf_model_factory(tiny_configs[name]())
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")
    weights = [lin.weight for lin in model.linears_in_step_order()]
    storage = weights[0].untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in weights)
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(s % 64 == 0 for s in starts)
    for end, start, w in zip(starts, starts[1:], weights, strict=False):  # back to back: at most a line's padding
        assert 0 <= start - (end + w.nbytes) < 64
    tied = tiny_configs[name]().tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    hf_weights = hf.state_dict()
    torch.testing.assert_close(
        model.model.layers[1].mlp.down_proj.weight, hf_weights["model.layers.1.mlp.down_proj.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(model.lm_head.weight, hf_weights["lm_head.weight"], rtol=0, atol=0)


def test_one_buffer_keeps_values_and_refuses_mixed_weights():
    from torch import nn

    from executor_svc.models.weights import one_buffer

    a, b = nn.Linear(5, 3, bias=False), nn.Linear(3, 7, bias=False)
    model = nn.Sequential(a, b)
    before = [a.weight.clone(), b.weight.clone()]
    buffer = one_buffer(model, [b, a])
    assert buffer is not None and buffer.numel() == 32 + 16  # 21 and 15 floats, each padded to a line
    assert b.weight.data_ptr() == buffer.data_ptr() and a.weight.data_ptr() == buffer.data_ptr() + 32 * 4
    torch.testing.assert_close(a.weight, before[0], rtol=0, atol=0)
    torch.testing.assert_close(b.weight, before[1], rtol=0, atol=0)
    assert [p is w for p, w in zip(model.parameters(), (a.weight, b.weight), strict=True)] == [True, True]
    c = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    kept = c.weight
    assert one_buffer(nn.Sequential(a, c), [a, c]) is None and c.weight is kept


def test_huge_page_tensors_start_on_a_huge_page_and_are_advised():
    """executor_svc/memory.py: weights' buffer and KV cache start on a 2 MiB boundary and are
    advised into huge pages (where the kernel has transparent huge pages at all)."""
    from pathlib import Path

    from executor_svc import memory

    t = memory.empty((3, 1 << 19), torch.float32)  # 6 MiB
    assert t.shape == (3, 1 << 19) and t.is_contiguous() and t.data_ptr() % memory.HUGE_PAGE == 0
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * 3 * (1 << 19)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    assert memory.advise_huge_pages(t) == thp.exists()
    assert memory.advise_huge_pages(memory.empty(1 << 20, torch.float32), huge=False) == thp.exists()
    z = memory.zeros((5, 1 << 18), torch.bfloat16, torch.device("cpu"))
    assert z.dtype == torch.bfloat16 and z.data_ptr() % memory.HUGE_PAGE == 0 and not z.any()
    small = memory.empty(100, torch.float32)  # below a huge page: a plain tensor
    assert small.shape == (100,) and small.untyped_storage().nbytes() == 400
