"""--quantization int4: the kernel multiplies by exactly the weights it claims, steps pick the
path their table plan gives their row count, Q4_1-born weights are held exactly, and the default model's
int4 path agrees with float32 above the thresholds docs and RESULTS.md state. The CPU 16-bit
modes (--dtype bfloat16 / float16, HalfWeights): the same path choice, the same arithmetic as
the quality benchmark emulates, a server that loads and serves them, and their agreement."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chunkserve_contracts.cpu import CpuInfo
from executor_svc.config import ExecutorConfig
from executor_svc.models.kernel_plan import table_plan
from executor_svc.models.layers import Linear
from executor_svc.models.quant import (
    GROUP_SIZE,
    ROW_RULES,
    HalfWeights,
    Int4Weights,
    RowRule,
    default_rules,
    half_linear,
    half_weights_model,
    int4_reference,
    quantize_int4,
    quantize_model,
)


def _bf16_reference(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: bf16 activations times the reference weights."""
    return x.to(torch.bfloat16).double() @ ref.double().t()


# A reduced mode's greedy tokens may leave float32's only where float32 itself nearly tied: its
# top-2 logprobs within this many nats. Measured on the default model (8 chat prompts x 32
# tokens, every mode, native and aten CPU kernels): every divergence was at a float32 lead of
# <= 0.16 nats (the capital question's first token: "The" -1.88 vs "L" -1.97). A broken mode
# leaves float32 where it is sure (leads of several nats) and fails.
NEAR_TIE_NATS = 0.25


GREEDY_TOKENS = 16  # per chat prompt (qq.PROMPTS), in float32 and in each reduced mode


def _runner(**config):
    """An in-process executor on the default model, its kernels from the tables
    (`--cpu-linear-plan table`): the reduced copies serve the step sizes docs/cpu.md's table
    gives this CPU class, every run alike, and no plan is measured (a measured plan took
    40-140 s per mode on 2 loaded cores, and one measured under load was not used anyway)."""
    from executor_svc.config import default_cache_dir
    from executor_svc.worker import load

    cfg = ExecutorConfig(device="cpu", kv_cache_memory_gib=0.1, swap_space=0.0, cache_dir=default_cache_dir(),
                         cpu_linear_plan="table", **config)  # fmt: skip
    return load(cfg).runner


def _serves_one_token_steps_reduced(runner) -> None:
    """The mode's copies compute the decoder linears and the head of a 1-token (decode) step,
    so the greedy comparison below goes through them (not a float32 kernel throughout)."""
    model = runner.model
    assert model.model.plan(1) in ("reduced", "half-onednn"), model.model.plan
    assert model.lm_head.plan(1) in ("reduced", "half-onednn"), model.lm_head.plan


@pytest.fixture(scope="module")
def fp32_greedy(default_model_path):
    """Per chat prompt of qq.PROMPTS: (text, prompt ids, float32's greedy tokens, each token's
    lead over the runner-up in nats); computed once for every reduced mode's comparison."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import quantization_quality as qq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    runner = _runner(dtype="float32")
    out = []
    with torch.inference_mode():
        for text in qq.PROMPTS:
            prompt = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])  # fmt: skip
            leads: list[float] = []
            out.append((text, prompt, qq.greedy(runner, prompt, GREEDY_TOKENS, leads), leads))
    return out


def _depart_only_at_near_ties(qq, tok, mode_runner, fp32_greedy) -> list[int]:
    """Greedy tokens per chat prompt in the mode against float32's (`fp32_greedy`); asserts
    every first divergence is at a float32 near-tie; returns the common prefixes."""
    prefixes = []
    for text, prompt, want, leads in fp32_greedy:
        got = qq.greedy(mode_runner, prompt, len(want))
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        assert n == len(want) or leads[n] < NEAR_TIE_NATS, (
            f"{text!r}: left float32 at token {n} where float32 led by {leads[n]:.3f} nats: "
            f"{tok.decode(want)!r} vs {tok.decode(got)!r}"
        )
        prefixes.append(n)
    return prefixes


def test_kernel_multiplies_by_the_reference_weights():
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q = Int4Weights(w)
    x = torch.randn(5, 96)
    out = q.matmul(x)
    want = _bf16_reference(x, int4_reference(w))
    # The kernel's output is rounded to bfloat16 (8 bits of mantissa): within 2^-7 relative.
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=1e-3)
    # ... and it is the quantized product, not the float32 one (the test could tell them apart).
    assert (out.double() - x.double() @ w.double().t()).abs().max() > 10 * (out.double() - want).abs().max()


def test_weights_born_from_q4_1_blocks_are_held_exactly():
    """Q4_1: per 32 weights an fp16 scale d and minimum m, w = d * q + m, q in 0..15."""
    torch.manual_seed(1)
    n, k = 32, 128
    d = (torch.rand(n, k // GROUP_SIZE, 1) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // GROUP_SIZE, 1) * 0.1).half().float()
    codes = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's quantizer puts the min at 0 and the max at 15
    w = (d * codes + m).reshape(n, k)
    _, _, exact = quantize_int4(w)
    assert exact == n * k // GROUP_SIZE
    # bf16 scale/zero then move the weights by at most half a step of the bf16 grid
    err = (int4_reference(w) - w).abs().reshape(n, k // GROUP_SIZE, GROUP_SIZE).amax(-1, keepdim=True)
    assert (err <= d * 0.6).all()


def test_in_features_must_be_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(8, 40))


def test_steps_within_max_rows_take_the_int4_path_larger_ones_float32():
    torch.manual_seed(2)
    lin = Linear(64, 32, True, torch.float32, "cpu")
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    plain = torch.nn.functional.linear
    lin.reduced = Int4Weights(lin.weight)
    lin.plan = table_plan(RowRule(4), packed=False, padding=True, upto=64)
    small, big = torch.randn(4, 64), torch.randn(5, 64)
    torch.testing.assert_close(lin(small), lin.reduced.matmul(small) + lin.bias)
    torch.testing.assert_close(lin(big), plain(big, lin.weight, lin.bias), rtol=0, atol=1e-5)
    assert not torch.allclose(lin(small), plain(small, lin.weight, lin.bias), rtol=0, atol=1e-5)


def test_config_refuses_unknown_schemes_and_zero_rows():
    with pytest.raises(ValueError, match="--quantization must be one of none, int4"):
        ExecutorConfig(quantization="int3")
    with pytest.raises(ValueError, match="--quantized-max-rows"):
        ExecutorConfig(quantization="int4", quantized_max_rows=0)


def test_quantize_model_covers_every_decoder_linear_and_adds_a_bf16_head(tiny_configs, hf_model_factory):
    from executor_svc.models import get_model_class

    config = tiny_configs["smollm_tied"]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    stats = quantize_model(model, "int4")
    linears = model.decoder_linears()
    assert stats["layers"] == len(linears) == 4 * config.num_hidden_layers
    assert all(isinstance(m.reduced, Int4Weights) for m in linears)
    head = model.lm_head.reduced
    assert isinstance(head, HalfWeights) and torch.equal(
        head.weight, model.model.embed_tokens.weight.to(torch.bfloat16)
    )


@pytest.mark.slow  # the default model, twice
def test_default_model_int4_agrees_with_float32(default_model_path, fp32_greedy):
    """Teacher-forced over a fixed text (emulating the int4 path's arithmetic on HF's model;
    the kernel == reference test above links the two): perplexity within 3% and top-1 within
    90% of float32, the thresholds docs/cpu.md states; and greedy decoding through the executor
    leaves float32's tokens only at float32's own near-ties (NEAR_TIE_NATS), on 8 chat prompts."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import quantization_quality as qq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    ids = tok(qq.TEXTS["english"] + " " + qq.TEXTS["french"] + " " + qq.TEXTS["code"])["input_ids"]
    fp32 = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    a = qq.teacher_forced(fp32, ids)
    qq.emulate_int4(fp32)
    b = qq.teacher_forced(fp32, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert qq.perplexity(b, ids) / qq.perplexity(a, ids) <= 1.03

    with torch.inference_mode():
        int4 = _runner(dtype="float32", quantization="int4")
        _serves_one_token_steps_reduced(int4)
        prefixes = _depart_only_at_near_ties(qq, tok, int4, fp32_greedy)
    assert sum(prefixes) >= len(prefixes) * GREEDY_TOKENS // 2  # on average the first half of the tokens kept


def test_int4_is_refused_off_the_float32_cpu_path(tiny_model_path, tmp_path):
    from executor_svc.worker import load

    cfg = ExecutorConfig(model=str(tiny_model_path), dtype="bfloat16", quantization="int4", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--quantization int4 is a CPU mode over float32 weights"):
        load(cfg)


@pytest.mark.slow  # a real server pair
def test_a_server_with_int4_weights_serves_and_says_so(tiny_model_path, launch):
    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    server = launch(["--model", str(tiny_model_path), "--quantization", "int4"], [])
    stub = server.stub()
    assert stub.GetInfo(pb.GetInfoRequest()).dtype == "float32+int4"
    # 40 prompt tokens: the prefill runs the float32 path, the decodes the int4 kernel.
    out = [m for m in stub.Generate(build_request(list(range(10, 50)), max_tokens=8, ignore_eos=True))]
    assert sum(len(m.token_ids) for m in out) == 8 and out[-1].finished
    server.assert_idle_and_no_leaks()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_one_row_steps_16_bit_larger_ones_float32(dtype):
    torch.manual_seed(4)
    lin = Linear(64, 32, True, torch.float32, "cpu")
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    lin.reduced = HalfWeights(lin.weight, dtype)
    lin.plan = table_plan(RowRule(1), packed=False, padding=True, upto=64)
    one, two = torch.randn(1, 64), torch.randn(2, 64)
    w16 = lin.weight.to(dtype)
    # exactly the arithmetic benchmarks/quantization_quality.py emulates
    assert torch.equal(lin(one), half_linear(one.to(dtype), w16).float() + lin.bias)
    assert lin.reduced.matmul(one, same_dtype=False).dtype == dtype
    # two rows: the float32 weights, the float32 path bitwise
    from executor_svc.models.layers import linear

    assert torch.equal(lin(two), linear(two, lin.weight, lin.bias))
    assert not torch.allclose(lin(one), linear(one, lin.weight, lin.bias), rtol=0, atol=1e-6)


def test_half_weights_model_covers_every_linear_and_the_head(tiny_configs, hf_model_factory):
    from executor_svc.models import get_model_class

    config = tiny_configs["smollm_tied"]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    stats = half_weights_model(model, "float16")
    linears = model.decoder_linears()
    assert stats["layers"] == len(linears) and all(isinstance(m.reduced, HalfWeights) for m in linears)
    assert all(m.reduced.weight.dtype == torch.float16 for m in linears)
    assert torch.equal(model.lm_head.reduced.weight, model.model.embed_tokens.weight.to(torch.float16))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 kept for larger steps


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_16_bit_dtype_loads_float32_model_with_16_bit_copies(tiny_model_path, tmp_path, dtype):
    from executor_svc.worker import load

    common = dict(
        model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path),
        cpu_linear_plan="table",  # the tables (the measured plan: test_linear_plan.py)
    )  # fmt: skip
    loaded = load(ExecutorConfig(dtype=dtype, **common))
    assert loaded.handshake.dtype == f"float32+{dtype}"
    runner = loaded.runner
    assert runner.kv_cache.dtype == torch.float32
    rows, head_rows = default_rules(dtype)  # the table measured for this CPU's class

    def follows(plan, rule):
        return all((plan(m) == "reduced") == rule(m) for m in range(1, 300))

    model = runner.model
    assert follows(model.lm_head.plan, head_rows) and follows(model.model.plan, rows)
    lin = model.model.layers[0].mlp.down_proj
    assert lin.reduced.weight.dtype == getattr(torch, dtype) and lin.plan is model.model.plan
    model = load(ExecutorConfig(dtype=dtype, quantized_max_rows=3, **common)).runner.model
    assert follows(model.model.plan, RowRule(3)) and follows(model.lm_head.plan, RowRule(3))


@pytest.mark.slow  # the default model, three times
def test_default_model_16_bit_modes_agree_with_float32(default_model_path, fp32_greedy):
    """Teacher-forced over a fixed text with the 16-bit path's arithmetic on HF's model (the
    test above links it to HalfWeights): top-1 >= 0.92 (bf16) / 0.95 (fp16) and perplexity
    within 1% of float32, as docs/cpu.md states; greedy through the executor leaves float32's tokens
    only at float32's own near-ties (NEAR_TIE_NATS), on 8 chat prompts."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import quantization_quality as qq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    ids = tok(qq.TEXTS["english"] + " " + qq.TEXTS["russian"] + " " + qq.TEXTS["code"])["input_ids"]
    fp32 = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    a = qq.teacher_forced(fp32, ids)
    for mode, top1 in (("bfloat16", 0.92), ("float16", 0.95)):
        qq.emulate_half(fp32, getattr(torch, mode))
        b = qq.teacher_forced(fp32, ids)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= top1
        assert qq.perplexity(b, ids) / qq.perplexity(a, ids) <= 1.01
        fp32 = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
        with torch.inference_mode():
            reduced = _runner(dtype=mode)
            _serves_one_token_steps_reduced(reduced)
            prefixes = _depart_only_at_near_ties(qq, tok, reduced, fp32_greedy)
        assert sum(prefixes) >= len(prefixes) * GREEDY_TOKENS // 2


@pytest.mark.slow  # a real server pair
def test_a_server_with_a_cpu_16_bit_dtype_serves_and_says_so(tiny_model_path, launch):
    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb

    server = launch(["--model", str(tiny_model_path), "--dtype", "float16"], [])
    stub = server.stub()
    assert stub.GetInfo(pb.GetInfoRequest()).dtype == "float32+float16"
    out = [m for m in stub.Generate(build_request(list(range(10, 50)), max_tokens=8, ignore_eos=True))]
    assert sum(len(m.token_ids) for m in out) == 8 and out[-1].finished
    server.assert_idle_and_no_leaks()


def test_row_rules_admit_what_they_say():
    assert [n for n in range(1, 10) if RowRule(4)(n)] == [1, 2, 3, 4]
    not_2_to_4 = RowRule(None, frozenset({2, 3, 4}))
    assert [n for n in (1, 2, 3, 4, 5, 64, 4096) if not_2_to_4(n)] == [1, 5, 64, 4096]
    assert str(RowRule(8)) == "<= 8 tokens" and str(not_2_to_4) == "any size but 2, 3, 4"


@pytest.mark.parametrize("native", [False, True])
def test_default_rules_follow_the_cpu_class_and_the_flag(monkeypatch, native):
    import executor_svc.models.quant as quant

    monkeypatch.setattr(quant, "cpu_info", lambda: CpuInfo("test", frozenset({"avx512_bf16"} if native else ())))
    for mode in ("int4", "bfloat16", "float16"):
        assert default_rules(mode) == ROW_RULES[native][mode]
        rows, head = default_rules(mode, 5)
        assert rows == RowRule(5)
        # --quantized-max-rows moves the 16-bit modes' head with the linears; int4's head is
        # a bfloat16 copy and keeps the table's rule
        assert head == (ROW_RULES[native][mode][1] if mode == "int4" else RowRule(5))
    # without a native bfloat16 instruction only one-row steps take a 16-bit copy
    assert ROW_RULES[False]["bfloat16"] == (RowRule(1), RowRule(1))


def test_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    from chunkserve_contracts import cpu

    real_open = builtins.open
    for flags, want in (("fpu avx2 avx512f avx512_bf16", True), ("fpu avx2 amx_bf16", True), ("fpu avx2 fma", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins, "open", lambda p, *a, info=info, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k)
        )
        cpu.cpu_info.cache_clear()
        assert cpu.cpu_info().native_bf16 is want and cpu.cpu_info().model == "Test CPU"
    cpu.cpu_info.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 12, 40])
def test_half_linear_is_the_16_bit_product_on_every_path(dtype, m):
    """Each row count's kernel (one-row GEMV with oneDNN off, F.linear, (W @ x^T)^T from 12
    rows in bfloat16) computes the product of the 16-bit operands: within the 16-bit result's
    rounding of the float64 product, and the oneDNN switch is left as it was."""
    torch.manual_seed(m)
    x, w = torch.randn(m, 96).to(dtype), torch.randn(80, 96).to(dtype)
    was = torch._C._get_mkldnn_enabled()
    y = half_linear(x, w)
    assert torch._C._get_mkldnn_enabled() == was
    assert y.dtype == dtype and y.shape == (m, 80)
    want = x.double() @ w.double().t()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y.double(), want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())
