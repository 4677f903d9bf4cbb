"""The fused decode layers (chunkserve_kernels/csrc/cpu_layer.cpp via models/fused.py): a pure-decode step
whose linears the plan gives to the native product or oneDNN's packed copies (float32) or to
the int4 copies runs every
decoder layer in one native call. It must compute exactly what the Python layers compute on
the same native ops (bitwise: same hidden states, same K/V written), and every other step must
keep the Python layers. Skipped where this machine has no C++ compiler."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve_kernels import cpu_native
from executor_svc.collectives import TPInfo
from executor_svc.config import ExecutorConfig
from executor_svc.models import fused as fused_mod
from executor_svc.models import get_model_class
from executor_svc.models.fused import GreedyDecodes
from executor_svc.models.kernel_plan import Plan
from executor_svc.models.quant import quantize_model

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

# the plan a 2-core Zen 5 measured for the default model: the native product up to 3 rows
PLAN = Plan((1, 2, 3, 4, 8), ("gemv", "gemv", "gemv", "mm", "mm"))
PLANS = {
    "float32": PLAN,
    "int4": Plan((1, 2, 3, 4, 8), ("reduced", "reduced", "reduced", "mm", "mm")),
    "packed": Plan((1, 2, 3, 4, 8), ("gemv", "gemv", "gemv", "packed", "packed")),  # every size fused
    # one row read without the prefetch (what a machine whose memory the prefetch slows measures)
    "stream": Plan((1, 2, 3, 4, 8), ("gemv-stream", "gemv", "gemv", "mm", "mm")),
}


def _native_model(tiny_configs, hf_model_factory, name, fused, mode="float32", head="mm"):
    assert cpu_native.load() is None
    torch.manual_seed(0)
    config = tiny_configs[name]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    model.use_native_kernels()
    if mode == "int4":
        quantize_model(model, "int4")
    if mode == "packed":
        assert model.prepack() > 0
    model.use_plan(PLANS[mode], Plan.of(head))
    if fused:
        model.use_fused_decode()
    return model


class _Spy:
    """Counts the steps the fused layers ran (the test must not pass by never taking them)."""

    def __init__(self, model):
        self.fused, real = 0, model.fused.forward

        def spy(*args):
            out = real(*args)
            self.fused += out is not None
            return out

        model.fused.forward = spy


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["llama", "smollm_tied", "llama_bias_headdim", "llama3_rope", "qwen2_bias"]),
    mode=st.sampled_from(["float32", "int4", "packed", "stream"]),
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), st.booleans()),
        min_size=1,
        max_size=8,
    ),  # (which sequences decode, whether a new prompt's prefill joins the step)
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_fused_steps_equal_the_python_layers_bitwise(
    tiny_configs, hf_model_factory, paged_runner, name, mode, prompts, steps, block_size, seed
):
    fused = _native_model(tiny_configs, hf_model_factory, name, fused=True, mode=mode)
    plain = _native_model(tiny_configs, hf_model_factory, name, fused=False, mode=mode)
    gemv = {"gemv", "gemv-stream"}
    want = {"float32": gemv, "int4": gemv | {"reduced"}, "packed": gemv | {"packed"}, "stream": gemv}[mode]
    assert fused.fused.kernels == want
    assert fused.fused.native.native_silu()  # silu * up on the native pass (cpu_silu.cpp), not aten's
    spy = _Spy(fused)
    runs = {m: paged_runner(m, block_size=block_size, num_blocks=256, seed=seed) for m in (fused, plain)}
    gen = torch.Generator().manual_seed(seed)
    vocab = fused.config.vocab_size
    work = {sid: torch.randint(0, vocab, (n,), generator=gen).tolist() for sid, n in enumerate(prompts)}
    outs = {m: r.step(work) for m, r in runs.items()}
    assert all(torch.equal(outs[fused][s], outs[plain][s]) for s in work)
    taken = [work]
    next_sid = len(prompts)
    for decoding, with_prefill in steps:
        work = {s: torch.randint(0, vocab, (1,), generator=gen).tolist() for s in decoding if s < len(prompts)}
        if with_prefill:
            work[next_sid] = torch.randint(0, vocab, (5,), generator=gen).tolist()
            next_sid += 1
        if not work:
            continue
        outs = {m: r.step(work) for m, r in runs.items()}
        taken.append(work)
        for s in work:
            assert torch.equal(outs[fused][s], outs[plain][s]), (name, mode, s)
    assert torch.equal(runs[fused].kv_cache, runs[plain].kv_cache)
    # every pure-decode step (one token per sequence, a 1-token prompt counts) of 1-3 rows (of any
    # size with the packed copies), no other
    most = 6 if mode == "packed" else 3
    assert spy.fused == sum(all(len(t) == 1 for t in w.values()) and len(w) <= most for w in taken)


# the head's kernel in each mode; the fused greedy loop takes these (an "mm" head keeps Python)
HEAD_PLANS = {"float32": "gemv", "int4": "gemv-stream", "packed": "packed", "stream": "gemv-stream"}


def _kv_rows(run, sid: int) -> torch.Tensor:
    """A sequence's cached K/V in position order, [layers, 2, positions, kv_heads, head_dim]."""
    pos = torch.arange(run.computed[sid])
    blocks = torch.tensor(run.tables[sid])[pos // run.block_size]
    return run.kv_cache[:, :, blocks, pos % run.block_size]


def _greedy_loop(run, last: dict[int, int], steps: int, cut: int = 0) -> torch.Tensor | None:
    """`DecodeLayers.greedy` through the model for every sequence in `last` (its last token),
    the block tables grown up front to hold all the steps, as a multi-step plan's are."""
    ids = list(last)
    for sid in ids:
        table = run.tables[sid]
        while len(table) * run.block_size < run.computed[sid] + steps:
            table.append(run.free.pop())
    batch = GreedyDecodes.of(
        [last[s] for s in ids], [run.computed[s] for s in ids], [run.tables[s] for s in ids], run.kv_cache
    )
    with torch.inference_mode():
        out = run.model.greedy_decode(batch, steps, torch.tensor([cut], dtype=torch.int32))
    if out is not None:
        for sid in ids:
            run.computed[sid] += out.shape[0]
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["llama", "smollm_tied", "llama_bias_headdim", "qwen2_bias"]),
    mode=st.sampled_from(["float32", "int4", "packed", "stream"]),
    prompts=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    steps=st.integers(1, 6),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_the_fused_greedy_loop_gives_the_tokens_of_single_steps(
    tiny_configs, hf_model_factory, paged_runner, name, mode, prompts, steps, block_size, seed
):
    """`steps` greedy decodes in one native call (forward, head, argmax, the token fed back)
    against the Python layers step by step with `compute_logits` and the argmax: the same
    tokens, the same K/V at every position."""
    fused = _native_model(tiny_configs, hf_model_factory, name, fused=True, mode=mode, head=HEAD_PLANS[mode])
    plain = _native_model(tiny_configs, hf_model_factory, name, fused=False, mode=mode, head=HEAD_PLANS[mode])
    runs = {m: paged_runner(m, block_size=block_size, num_blocks=256, seed=seed) for m in (fused, plain)}
    gen = torch.Generator().manual_seed(seed)
    vocab = fused.config.vocab_size
    work = {sid: torch.randint(0, vocab, (n,), generator=gen).tolist() for sid, n in enumerate(prompts)}
    hidden = {m: r.step(work) for m, r in runs.items()}  # the prefill: Python layers on both
    last = {sid: int(plain.compute_logits(hidden[plain][sid][-1:]).argmax()) for sid in work}
    want = []
    token = dict(last)
    for _ in range(steps):
        rows = runs[plain].step({sid: [t] for sid, t in token.items()})
        token = {sid: int(plain.compute_logits(rows[sid]).argmax()) for sid in token}
        want.append([token[sid] for sid in work])
    got = _greedy_loop(runs[fused], last, steps)
    assert got is not None and got.tolist() == want, (name, mode)
    for sid in work:
        assert torch.equal(_kv_rows(runs[fused], sid), _kv_rows(runs[plain], sid))


def test_the_fused_greedy_loop_stops_at_a_cut_and_declines_what_it_cannot_run(
    tiny_configs, hf_model_factory, paged_runner
):
    model = _native_model(tiny_configs, hf_model_factory, "llama", fused=True)
    run = paged_runner(model, block_size=4)
    hidden = run.step({0: [1, 2, 3], 1: [4, 5]})
    last = {sid: int(model.compute_logits(rows[-1:]).argmax()) for sid, rows in hidden.items()}
    assert _greedy_loop(run, last, 5) is None  # the head's plan is "mm": the head stays in Python
    model.use_plan(PLAN, Plan.of("gemv"))
    assert _greedy_loop(run, last, 5, cut=1).shape == (1, 2)  # a cut flag already set: the first step only
    assert run.computed == {0: 4, 1: 3}
    model.use_plan(PLAN, Plan.of("packed"))  # no packed copies made
    assert _greedy_loop(run, last, 2) is None
    model.use_plan(Plan.of("mm"), Plan.of("gemv"))  # the layers' plan: not fused
    assert _greedy_loop(run, last, 2) is None
    assert run.computed == {0: 4, 1: 3}  # nothing computed by the declines


def test_other_steps_keep_the_python_layers(tiny_configs, hf_model_factory, paged_runner):
    model = _native_model(tiny_configs, hf_model_factory, "llama", fused=True)
    spy = _Spy(model)
    run = paged_runner(model, block_size=4)
    run.step({0: [1, 2, 3], 1: [4, 5]})  # prefill
    run.step({0: [6], 1: [7]})  # 2 decodes: fused
    assert spy.fused == 1
    run.step({0: [8], 1: [9], 2: [1, 2]})  # a prefill chunk joins: Python layers
    for sid in range(3, 7):
        run.step({sid: [3]})
    run.step({s: [5] for s in range(5)})  # 5 rows: the plan says mm
    assert spy.fused == 1 + 4  # the four 1-token first steps of 3..6 were decodes of a 1-token prompt
    model.use_plan(Plan.of("mm"), Plan.of("mm"))
    run.step({0: [1]})
    assert spy.fused == 5  # the plan no longer gives these rows to the native product
    model.use_plan(PLAN, Plan.of("mm"))
    run.step({0: [1]})
    assert spy.fused == 6  # the plan that the model's linears run is the one the fused path reads
    model.use_fused_decode(False)
    assert model.fused is None
    model.use_fused_decode()
    model.use_native_kernels(False)  # the fused layers call the native ops: they go with them
    assert model.fused is None


def test_the_executor_switches_it_on_with_the_native_kernels(tiny_model_path, tmp_path):
    from executor_svc import worker

    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path))
    fused = worker.load(ExecutorConfig(**common)).runner.model.fused
    assert fused is not None and fused.native.num_layers() == 2 and "reduced" not in fused.kernels
    int4 = worker.load(ExecutorConfig(quantization="int4", **common)).runner.model.fused
    assert "reduced" in int4.kernels  # made after the int4 copies
    assert worker.load(ExecutorConfig(cpu_kernels="torch", **common)).runner.model.fused is None


def test_fused_decode_needs_the_native_ops_and_no_tensor_parallelism(tiny_configs, hf_model_factory):
    model = _native_model(tiny_configs, hf_model_factory, "llama", fused=False)
    model.model.layers[0].input_layernorm.native = False
    with pytest.raises(ValueError, match="native norms and attention"):
        model.use_fused_decode()
    model.tp = TPInfo(rank=0, size=2)
    with pytest.raises(ValueError, match="tensor-parallel"):
        model.use_fused_decode()


def test_the_layers_object_refuses_bad_tensors_and_arguments(tiny_configs, hf_model_factory):
    model = _native_model(tiny_configs, hf_model_factory, "llama", fused=True)
    layer = model.model.layers[0]
    attn = layer.self_attn
    good = {"input_norm": layer.input_layernorm.weight, "post_attention_norm": layer.post_attention_layernorm.weight}
    for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", layer.mlp.gate_up_proj)):
        good |= fused_mod._linear_tensors(name, lin)
    good |= fused_mod._linear_tensors("down", layer.mlp.down_proj)

    def fresh():
        return torch.classes.chunkserve.DecodeLayers(1e-5, attn.heads, attn.kv_heads, attn.attn.scale, 32)

    fresh().add_layer(good)
    for bad, match in (
        ({k: v for k, v in good.items() if k != "o.weight"}, "no tensor named o.weight"),
        (good | {"qkv.extra": layer.input_layernorm.weight}, "unknown tensor names: qkv.extra"),
        (good | {"o.int4": attn.o_proj.weight, "o.int4_scales": attn.o_proj.weight}, "all four linears or none"),
        (good | {"o.packed": attn.o_proj.weight}, "packed copies for all four linears or none"),
    ):
        with pytest.raises(RuntimeError, match=match):
            fresh().add_layer(bad)
    layers = fresh()
    layers.add_layer(good)
    ids = torch.zeros(1, dtype=torch.long)
    cache = torch.zeros(2, 2, 4, 4, attn.kv_heads, attn.head_dim)  # 2 layers of cache for 1 layer
    tail = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    pos, cos = torch.zeros(1, dtype=torch.long), torch.zeros(1, attn.head_dim)
    with pytest.raises(RuntimeError, match="set_ends"):
        layers.forward(ids, pos, cos, cos, cache[:1], *tail, "gemv")
    embedding, norm = model.model.embed_tokens.weight, model.model.norm.weight
    with pytest.raises(RuntimeError, match="contiguous float32"):
        layers.set_ends(embedding.double(), norm, 1e-5)
    with pytest.raises(RuntimeError, match="final norm's weight must be"):
        layers.set_ends(embedding, norm[1:], 1e-5)
    layers.set_ends(embedding, norm, 1e-5)
    with pytest.raises(RuntimeError, match="kv_cache must be"):
        layers.forward(ids, pos, cos, cos, cache, *tail, "gemv")
    with pytest.raises(RuntimeError, match="no int4 copies"):
        layers.forward(ids, pos, cos, cos, cache[:1], *tail, "reduced")
    with pytest.raises(RuntimeError, match="no packed copies"):
        layers.forward(ids, pos, cos, cos, cache[:1], *tail, "packed")
    with pytest.raises(RuntimeError, match="no fused path for the linear kernel mm"):
        layers.forward(ids, pos, cos, cos, cache[:1], *tail, "mm")
    with pytest.raises(RuntimeError, match="position 1 outside the tables' 1"):
        layers.forward(ids, pos + 1, cos, cos, cache[:1], *tail, "gemv")
    vocab = model.config.vocab_size
    for bad_id in (vocab, -1):
        with pytest.raises(RuntimeError, match=f"token id {bad_id} outside the embedding's {vocab} rows"):
            layers.forward(ids + bad_id, pos, cos, cos, cache[:1], *tail, "gemv")
    with pytest.raises(RuntimeError, match="input_ids must be int64"):
        layers.forward(ids.int(), pos, cos, cos, cache[:1], *tail, "gemv")
    assert layers.forward(ids, pos, cos, cos, cache[:1], *tail, "gemv").shape == (1, model.config.hidden_size)
    table, ctx_lens, cut = tail[1], tail[2], torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="set_head before greedy"):
        layers.greedy(ids, pos, cos, cos, cache[:1], table, ctx_lens, 1, "gemv", "gemv", cut)
    with pytest.raises(RuntimeError, match="unknown tensor names: extra"):
        layers.set_head({"weight": embedding, "extra": norm})
    layers.set_head({"weight": embedding})
    for head_kernel in ("reduced", "packed"):  # no int4 head; no packed copy given
        with pytest.raises(RuntimeError, match=f"no fused head for the kernel {head_kernel}"):
            layers.greedy(ids, pos, cos, cos, cache[:1], table, ctx_lens, 1, "gemv", head_kernel, cut)
    with pytest.raises(RuntimeError, match="int32 cut flag"):
        layers.greedy(ids, pos, cos, cos, cache[:1], table, ctx_lens, 1, "gemv", "gemv", cut.long())
    with pytest.raises(RuntimeError, match="steps >= 1"):
        layers.greedy(ids, pos, cos, cos, cache[:1], table, ctx_lens, 0, "gemv", "gemv", cut)
    # the table's one block holds positions 0-3: a fifth step would write outside it (refused before any step)
    rows = torch.zeros(8, attn.head_dim)  # rotary tables for 8 positions

    def run_steps(steps):
        return layers.greedy(ids, pos, rows, rows, cache[:1], table, ctx_lens, steps, "gemv", "gemv", cut)

    before = cache.clone()
    with pytest.raises(RuntimeError, match="position 4 outside the block table's 1 blocks"):
        run_steps(5)
    assert torch.equal(cache, before)
    got = run_steps(4)
    assert got.shape == (4, 1) and got.dtype == torch.long
