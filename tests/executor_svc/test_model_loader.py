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
