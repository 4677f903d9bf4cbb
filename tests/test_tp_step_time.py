"""benchmarks/tp_step_time.py: its Llama-3-8B shape is Hugging Face's Llama of that config,
the random model it writes loads in the executor (sharded too), warm-up rounds are not
measured, and the CPU plans are what they were. The GPU run itself is benchmarks/GPU.md's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _module("tp_step_time")


def test_llama3_8b_shape_is_hf_llama_and_gpu_bench_s(bench):
    import torch
    import transformers

    assert bench.LLAMA3_8B == _module("gpu_bench").LLAMA3_8B
    two_layers = dict(bench.LLAMA3_8B, num_hidden_layers=2)  # every layer is alike; 32 take seconds more
    config = transformers.LlamaConfig(**two_layers, tie_word_embeddings=False)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    assert bench.tensor_shapes(two_layers) == {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    params = sum(torch.Size(s).numel() for s in bench.tensor_shapes(bench.LLAMA3_8B).values())
    assert 8.0e9 < params < 8.1e9  # Llama-3-8B: 8.03 B


def test_cpu_plans_are_unchanged_and_warmup_rounds_come_first(bench):
    plans = bench.plans(2, 20, 3, 127)
    assert [p.step_id for p in plans] == [0, 1, 2, 3]
    assert [list(s.block_ids) for s in plans[0].seqs] == [[0, 1], [64, 65]]  # 64 blocks per sequence
    assert [list(s.token_ids)[:3] for s in plans[0].seqs] == [[0, 1, 2], [7, 8, 9]]
    warm = bench.plans(2, 20, 3, 127, warmup=1)
    assert [p.step_id for p in warm] == list(range(7))
    assert [[s.seq_id for s in p.seqs] for p in warm] == [[10000, 10001]] * 3 + [[0, 1]] * 4
    assert list(warm[3].finished_seq_ids) == [10000, 10001]  # the warm-up frees its sequences
    # The measured round is the unwarmed one, apart from the step ids and that finish.
    for a, b in zip(plans, warm[3:]):
        assert list(a.seqs) == list(b.seqs) and list(a.new_seqs) == list(b.new_seqs)


@pytest.mark.slow
def test_random_llama_loads_sharded_and_the_script_measures_it(bench, tmp_path):
    """A scaled-down shape through write_random_llama, then the script on it at TP=2 (CPU,
    gloo: every rank reads its slices of the files by name) with one warm-up round."""
    shape = dict(bench.LLAMA3_8B, hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=256)
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = bench.write_random_llama(tmp_path / "model", shape)
    files = sorted(p.name for p in model.glob("*.safetensors"))
    assert files == ["model-0.safetensors", "model-1.safetensors", "model-other.safetensors"]
    assert bench.write_random_llama(model, shape) == model  # kept: same config, nothing rewritten
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tp_step_time.py"), "--model", str(model), "--tp", "2"]
    cmd += ["--batch", "2", "--prompt", "8", "--decode", "2", "--warmup", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("TP=")]
    assert line.startswith("TP=2: prefill step") and "decode step median" in line and "comm share" in line


def test_script_help_names_the_gpu_options_without_cuda():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tp_step_time.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--device {cpu,cuda}" in done.stdout and "llama3-8b" in done.stdout
