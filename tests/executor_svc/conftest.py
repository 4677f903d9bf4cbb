"""Tiny random-weight HF models and a paged runner that drives our model step by step."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from chunkserve.launch import tiny_llama_config
from chunkserve_kernels import build_metadata, set_forward_context
from executor_svc.config import ExecutorConfig
from executor_svc.worker import load

TINY = dict(rms_norm_eps=1e-5, initializer_range=0.1)  # on top of chunkserve.launch.TINY_LLAMA
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "llama": lambda: tiny_llama_config(**TINY, tie_word_embeddings=False),
    "smollm_tied": lambda: tiny_llama_config(**TINY, tie_word_embeddings=True, rope_theta=100000.0),
    "llama_bias_headdim": lambda: tiny_llama_config(**TINY, attention_bias=True, mlp_bias=True, head_dim=24),
    "llama3_rope": lambda: tiny_llama_config(**TINY, rope_parameters=LLAMA3_ROPE),
    "mistral": lambda: tiny_llama_config("Mistral", **TINY, sliding_window=4096),
    "qwen2_bias": lambda: tiny_llama_config("Qwen2", **TINY, tie_word_embeddings=True),
}
HF_CLASSES = {
    "LlamaConfig": transformers.LlamaForCausalLM,
    "MistralConfig": transformers.MistralForCausalLM,
    "Qwen2Config": transformers.Qwen2ForCausalLM,
}


def make_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """HF model with random weights, including non-trivial norms and biases (HF initialises
    those to 1 and 0, which would let a swapped norm or a dropped bias pass unnoticed)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = HF_CLASSES[type(config).__name__](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    config.architectures = [type(model).__name__]
    return model


class PagedRunner:
    """Plays the scheduler for tests: grows block tables from a shuffled pool, builds the
    metadata for a step and runs the model inside a forward context."""

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = model.model.embed_tokens.weight.dtype
        self.model, self.block_size = model, block_size
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, head_dim, dtype=dtype
        )
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, work: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute `work[seq_id]` new tokens per sequence; returns each one's hidden rows."""
        ids = list(work)
        for sid in ids:
            table = self.tables.setdefault(sid, [])
            total = self.computed.get(sid, 0) + len(work[sid])
            while len(table) < math.ceil(total / self.block_size):
                table.append(self.free.pop())
        meta, positions = build_metadata(
            [len(work[s]) for s in ids],
            [self.computed.get(s, 0) for s in ids],
            [self.tables[s] for s in ids],
            self.block_size,
            "cpu",
        )
        input_ids = torch.tensor([t for s in ids for t in work[s]])
        with torch.inference_mode(), set_forward_context(meta, self.kv_cache):
            hidden = self.model(input_ids, positions)
        out, start = {}, 0
        for sid in ids:
            out[sid] = hidden[start : start + len(work[sid])]
            start += len(work[sid])
            self.computed[sid] = self.computed.get(sid, 0) + len(work[sid])
        return out


@pytest.fixture(params=sorted(CONFIGS))
def config_name(request):
    return request.param


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture
def hf_model_factory():
    return make_hf_model


@pytest.fixture
def tiny_configs():
    return CONFIGS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved random Llama checkpoint, its HF model, and a loaded executor (block size 4, 32
    blocks, a 64-token budget): the runner tests' model (one per test module)."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = tiny_llama_config(initializer_range=0.2)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    loaded = load(
        ExecutorConfig(
            model=str(path),
            dtype="float32",
            block_size=4,
            num_gpu_blocks_override=32,
            swap_space=0.001,
            max_num_batched_tokens=64,
            cache_dir=str(path / "cache"),
        )
    )
    return hf, loaded, path
