"""Where a decode step's time goes in the executor (issue 18, item 1): the default model
(SmolLM2-135M, fp32, CPU), B sequences prefilled to a context of CTX tokens, then decode
steps through `ModelRunner.execute(plan)` exactly as the server runs them (plan validation
-> metadata -> forward -> logits -> greedy sampling -> reply proto).

    timeout 900 .venv/bin/python benchmarks/decode_step_profile.py [--batch 1 32] [--ctx 128] [--steps 30]
        [--quantization none int4] [--no-profile] [--repeats 3] [--cpu-kernels torch] [--ab-cpu-kernels]
        [--ab-fused]

Per weight mode (`none` = float32, `int4` = `--quantization int4`, loaded as the server loads
it) and batch size it prints:
- the median wall time of a whole `execute()` of a decode step (no profiler);
- GEMM time: the same 4 x layers + 1 linears (same weights, same shapes, same kernel: the
  measured plan's for this step size (`--cpu-linear-plan`, the default), else the float32
  `linear`, or the int4 kernel on bfloat16 activations and the bfloat16 head) run alone, median of the same number of repeats; the non-GEMM share of the step is 1 - GEMM / step;
- non-GEMM in situ: the same decode steps with every GEMM (float32 `linear`, oneDNN's
  `packed_linear`, the native `native_linear`, `F.linear`, the int4 kernel) replaced by a
  preallocated zero result, so what is left is all the rest of the step (validation,
  metadata, embedding, norms, rotary, attention, activations, dtype casts, sampling, reply,
  Python); its share of the real step is the second non-GEMM figure. The fused decode
  layers (chunkserve_kernels/csrc/cpu_layer.cpp) call their products inside C++, out of a Python
  patch's reach, so this step runs the Python layers (said in the output);
- per-component ms per step: each piece of the step timed alone on the step's real shapes
  and metadata (times its count per step), the rest = no-GEMM step - their sum (Python
  module calls, views, reshapes);
- a split of the step by torch.profiler, self CPU time aggregated by op and grouped into
  GEMM (mm/addmm), attention (K/V write, gather, scores, softmax, P@V), elementwise (norms,
  rotary, silu*mul, residual adds, embedding), logits + sampling (the vocab GEMM, argmax) and
  the rest (Python: plan handling, metadata, module calls) = step wall - profiled ops. The
  profiler adds per-op overhead, so its shares are indicative; the GEMM-alone share is the
  number to quote.

`--ab-cpu-kernels`: steps with the native CPU kernels on and off taking turns (6 rounds x 10
steps, A B B A ...); `--ab-fused`: the same for the fused decode layers against the Python
layers on the same kernels.

torch runs with 2 threads (this machine's cores; --threads to change). To measure another
tree, put a folder with links named executor_svc, chunkserve_contracts and
chunkserve_kernels (-> its chunkserve_kernels/, or kernels/ in a tree from before 3150927)
first on PYTHONPATH; the script prints which files it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import statistics
import time
from collections import defaultdict

import torch

import executor_svc.runner as R
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_kernels import __file__ as kernels_file
from executor_svc.config import ExecutorConfig, default_cache_dir
from executor_svc.models.layers import linear
from executor_svc.models.quant import HalfWeights, half_linear
from executor_svc.worker import load

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul_gemm"}
ATTENTION_OPS = {
    "aten::index_copy_",
    "aten::index_select",
    "aten::matmul",
    "aten::bmm",
    "aten::_softmax",
    "aten::softmax",
    "aten::masked_fill_",
    "aten::embedding_bag",
    "aten::_embedding_bag",
    "aten::_embedding_bag_forward_only",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
}
SAMPLING_OPS = {"aten::argmax", "aten::max", "aten::topk", "aten::log_softmax", "aten::_log_softmax"}


def build(args, quantization: str = "none"):
    loaded = load(
        ExecutorConfig(
            model="default",
            dtype="float32",
            device="cpu",
            block_size=16,
            kv_cache_memory_gib=1.0,
            swap_space=0.0,
            max_num_batched_tokens=max(2048, args.ctx),
            cache_dir=default_cache_dir(),
            num_threads=args.threads,
            quantization=quantization,
            cpu_kernels=getattr(args, "cpu_kernels", "auto"),
        )
    )
    return loaded.runner


def prefill(runner, batch: int, ctx: int, total_len: int, first_id: int) -> list[int]:
    """Registers `batch` greedy sequences holding blocks for `total_len` tokens, prefilled to `ctx`."""
    runner.reset()
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    nb = -(-total_len // runner.block_size)
    ids = list(range(first_id, first_id + batch))
    for k, sid in enumerate(ids):
        plan = epb.StepRequest(step_id=k)
        plan.new_seqs.add(seq_id=sid, sampling=greedy)
        plan.seqs.add(
            seq_id=sid,
            num_computed_tokens=0,
            num_new_tokens=ctx,
            token_ids=[(sid * 7 + i) % 49000 + 10 for i in range(ctx)],
            block_ids=list(range(k * nb, (k + 1) * nb)),
            sample=True,
        )
        runner.execute(plan)
    return ids


def decode_plan(step: int, ids: list[int], computed: int) -> epb.StepRequest:
    seqs = [epb.ScheduledSequence(seq_id=s, num_computed_tokens=computed, num_new_tokens=1, sample=True) for s in ids]
    return epb.StepRequest(step_id=step, seqs=seqs)


def time_steps(runner, ids, ctx, steps, warmup) -> tuple[list[float], list[list[int]]]:
    times, tokens = [], []
    for k in range(warmup + steps):
        plan = decode_plan(1000 + k, ids, ctx + k)
        t = time.perf_counter_ns()
        resp = runner.execute(plan)
        dt = (time.perf_counter_ns() - t) / 1e6
        if k >= warmup:
            times.append(dt)
        tokens.append([s.token_id for s in resp.sampled])
    return times, tokens


def gemm_alone(model, batch: int, repeats: int) -> tuple[float, int]:
    """Median ms of all the model's linears (layers + vocab head) on [batch, in] inputs, each
    through the kernel its plan gives this batch (the one place a step's kernels are decided),
    inputs already in the kernel's dtype: the GEMM work only, no dtype casts."""
    calls = [_planned(lin, lin.plan(batch), batch) for lin in [*model.decoder_linears(), model.lm_head]]
    times = []
    with torch.inference_mode():
        for k in range(repeats + 3):
            t = time.perf_counter_ns()
            for call in calls:
                call()
            if k >= 3:
                times.append((time.perf_counter_ns() - t) / 1e6)
    return statistics.median(times), len(calls)


def _planned(lin, kernel: str, batch: int):
    """One linear's GEMM through a measured plan's kernel, its input already in the kernel's
    dtype (the casts are not GEMM work)."""
    x = torch.randn(batch, lin.weight.shape[1])
    q = lin.reduced
    if kernel == "reduced" and isinstance(q, HalfWeights):
        xh = x.to(q.weight.dtype)
        return lambda: half_linear(xh, q.weight)
    if kernel == "reduced":  # int4
        xb = x.to(torch.bfloat16)
        return lambda: torch._weight_int4pack_mm_for_cpu(xb, q.packed, 32, q.scales_and_zeros)
    if kernel == "half-onednn":
        xh = x.to(q.weight.dtype)
        return lambda: torch.nn.functional.linear(xh, q.weight)
    return lambda: lin.apply_kernel(x, kernel)  # mm, mm-pad, packed: float32 in, float32 out


class NoGemm:
    """Context manager: every GEMM of a step (the float32 `linear`, oneDNN's packed product, the
    native few-row product, `F.linear`, the int4 kernel) returns a cached zero tensor of the right shape instead of computing."""

    def __init__(self, model=None) -> None:
        """`model`: its fused decode layers are switched off inside (their GEMMs are C++ calls
        no Python patch reaches), so the no-GEMM step is that of the Python layers."""
        import executor_svc.models.layers as layers_mod

        self.targets = [(layers_mod, "linear"), (torch.nn.functional, "linear")]
        self.targets += [(layers_mod, "packed_linear"), (layers_mod, "native_linear")]  # "packed", "gemv(-stream)"
        self.targets.append((torch, "_weight_int4pack_mm_for_cpu"))
        self.saved: list = []
        self.cache: dict = {}
        self.model = model
        self.fused = model is not None and model.fused is not None

    def _zeros(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rows, cols, dtype)
        if key not in self.cache:
            self.cache[key] = torch.zeros(rows, cols, dtype=dtype)
        return self.cache[key]

    def __enter__(self):
        fakes = {
            "linear": lambda x, w, b=None, pad=None: self._zeros(x.shape[0], w.shape[0], x.dtype),
            "packed_linear": lambda x, p, b=None: self._zeros(x.shape[0], p.shape[0], x.dtype),
            "native_linear": lambda x, w, b=None, stream=False: self._zeros(x.shape[0], w.shape[0], x.dtype),
            "_weight_int4pack_mm_for_cpu": lambda x, p, g, sz: self._zeros(x.shape[0], p.shape[0], x.dtype),
        }
        for mod, name in self.targets:
            if hasattr(mod, name):
                self.saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fakes[name])
        if self.fused:
            self.model.use_fused_decode(False)
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)
        self.saved.clear()
        if self.fused:
            self.model.use_fused_decode()


def _us(fn, n: int = 200, blocks: int = 5) -> float:
    """Best (minimum) mean us per call over `blocks` blocks of `n` calls: robust to a shared machine."""
    fn()
    best = math.inf
    for _ in range(blocks):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t) / n / 1000)
    return best


def _int4_casts(layer, batch: int, n_layers: int) -> dict[str, float]:
    """ms per step of the int4 path's dtype casts: inputs cast to bfloat16 for every linear;
    outputs back to float32 for all four (before) or only q/k/v and gate/up (o_proj and
    down_proj results added as they are)."""
    attn = layer.self_attn
    folded = "same_dtype" in inspect.signature(type(attn.qkv_proj).forward).parameters
    casts = 0.0
    for lin in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        xin = torch.randn(batch, lin.weight.shape[1])
        yb = torch.randn(batch, lin.weight.shape[0]).to(torch.bfloat16)
        casts += _us(lambda xin=xin: xin.to(torch.bfloat16).contiguous())
        if not (folded and lin in (attn.o_proj, layer.mlp.down_proj)):
            casts += _us(lambda yb=yb: yb.to(torch.float32))
    return {f"int4 dtype casts x {6 if folded else 8}L": casts * n_layers / 1000}


def components(runner, ids: list[int], ctx: int) -> dict[str, float]:
    """ms per decode step of each non-GEMM piece, timed alone on the step's real shapes and
    metadata, times its count per step. Writes K/V at position `ctx` (the next decode's slot)."""
    from chunkserve_kernels.forward_context import set_forward_context
    from chunkserve_kernels.metadata import build_metadata
    from executor_svc.models.layers import apply_rotary
    from executor_svc.sampler import sample

    model = runner.model
    m, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    n_layers, batch = len(m.layers), len(ids)
    plan = decode_plan(9000, ids, ctx)
    states = [runner.seqs[s] for s in ids]
    tables = [st.block_table for st in states]
    out: dict[str, float] = {}
    wire = plan.SerializeToString()
    out["plan decode (proto parse)"] = _us(lambda: epb.StepRequest.FromString(wire)) / 1000
    out["plan validation"] = _us(lambda: runner.validate(plan)) / 1000
    meta_args = ([1] * batch, [ctx] * batch, tables, runner.block_size)
    out["build_metadata"] = _us(lambda: build_metadata(*meta_args)) / 1000
    meta, positions = build_metadata(*meta_args)
    input_ids = torch.tensor([st.last_token or 0 for st in states])
    out["embedding"] = _us(lambda: m.embed_tokens(input_ids)) / 1000
    out["rotary tables"] = _us(lambda: m.rotary_emb(positions, torch.float32)) / 1000
    h = m.embed_tokens(input_ids)
    cos, sin = m.rotary_emb(positions, h.dtype)
    o = torch.randn_like(h)
    # residual add + norm as the layers run them (one native op under --cpu-kernels native)
    norm = layer.input_layernorm
    out["residual add + RMSNorm x (2L+1)"] = _us(lambda: norm.add_forward(o, h)) * (2 * n_layers + 1) / 1000
    x = layer.input_layernorm(h)
    heads, kv_heads, hd = attn.heads, attn.kv_heads, attn.head_dim
    qkv = attn.qkv_proj(x).view(batch, heads + 2 * kv_heads, hd)
    out["rotary apply x L"] = _us(lambda: apply_rotary(qkv[:, : heads + kv_heads], cos, sin)) * n_layers / 1000
    qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
    with set_forward_context(meta, runner.kv_cache):

        def plan_step():
            meta.scratch.clear()
            attn.attn(q, k, v)

        first = _us(plan_step, n=50)
        rest = _us(lambda: attn.attn(q, k, v))
        out["attention plan (once)"] = max(first - rest, 0.0) / 1000
        cache = runner.kv_cache[0]
        be = attn.attn.backend
        kv_write = _us(lambda: be.write_kv(cache, k, v, meta.slot_mapping))
        out["K/V write x L"] = kv_write * n_layers / 1000
        out["decode attention x L"] = (rest - kv_write) * n_layers / 1000
    inter = layer.mlp.down_proj.weight.shape[1]
    gu = torch.randn(batch, 2 * inter)
    if hasattr(layer.mlp, "act"):
        act = layer.mlp.act
    else:

        def act(t):
            gate, up = t.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    out["silu(gate)*up x L"] = _us(lambda: act(gu)) * n_layers / 1000
    if attn.qkv_proj.reduced is not None and attn.qkv_proj.plan(batch) == "reduced":  # the plan decides
        out.update(_int4_casts(layer, batch, n_layers))
    hid = torch.randn(batch, h.shape[1])
    logits = model.compute_logits(hid)
    specs = [st.sampling for st in states]
    pos = [ctx + 1] * batch
    out["greedy sampling"] = _us(lambda: sample(logits, specs, pos)) / 1000
    reply = epb.StepResponse(step_id=1, num_tokens=batch)
    for sid in ids:
        reply.sampled.add(seq_id=sid, token_id=1234)
    out["reply encode (proto)"] = _us(lambda: reply.SerializeToString()) / 1000
    if model.lm_head.plan(batch) == "reduced":
        lb = logits.to(torch.bfloat16)
        out["head dtype casts"] = (_us(lambda: hid.to(torch.bfloat16)) + _us(lambda: lb.float())) / 1000
    return out


def profile_split(runner, ids, ctx, steps, vocab) -> dict[str, float]:
    """Mean ms per step by category, from torch.profiler self CPU times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter_ns()
        for k in range(steps):
            runner.execute(decode_plan(5000 + k, ids, ctx + k))
        wall = (time.perf_counter_ns() - t) / 1e6 / steps
    cats: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages(group_by_input_shape=True):
        ms = ev.self_cpu_time_total / 1000 / steps
        name = ev.key
        shapes = str(ev.input_shapes)
        if name in GEMM_OPS:
            cats["logits+sampling" if str(vocab) in shapes else "GEMM"] += ms
        elif name in ATTENTION_OPS:
            cats["attention"] += ms
        elif name in SAMPLING_OPS:
            cats["logits+sampling"] += ms
        else:
            cats["elementwise+other ops"] += ms
    cats["python (plan, metadata, calls)"] = wall - sum(cats.values())
    cats["_wall_profiled"] = wall
    return dict(cats)


def _old_rotary(x, cos, sin):  # before issue 18: half-width tables, 8 ops per layer
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def changed_pieces(model, batch: int, repeats: int = 2000) -> None:
    """Old vs new form of each piece issue 18 changed, alternated, minimum us over blocks of
    `repeats` calls (robust on a shared machine where whole-step medians swing 10x); checks
    that both give bitwise-equal results."""
    from executor_svc.models.layers import apply_rotary

    rot = model.model.rotary_emb
    positions = torch.arange(128, 128 + batch)
    freqs = positions.float()[:, None] * rot.inv_freq[None, :]
    cos_h, sin_h = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    cos_f, sin_f = rot(positions, torch.float32)
    attn = model.model.layers[0].self_attn
    qkv = attn.qkv_proj(torch.randn(batch, attn.qkv_proj.weight.shape[1])).view(batch, -1, attn.head_dim)
    x = qkv[:, : attn.heads + attn.kv_heads]
    assert torch.equal(_old_rotary(x, cos_h, sin_h), apply_rotary(x, cos_f, sin_f))
    head = model.lm_head.weight
    logits = linear(torch.randn(batch, head.shape[1]), head)
    assert torch.equal(logits.contiguous().argmax(dim=-1), logits.argmax(dim=-1))
    pairs = {
        "rotary, one layer": (lambda: _old_rotary(x, cos_h, sin_h), lambda: apply_rotary(x, cos_f, sin_f), 30),
        "greedy pick from logits": (lambda: logits.contiguous().argmax(dim=-1), lambda: logits.argmax(dim=-1), 1),
    }
    for name, (old, new, per_step) in pairs.items():
        best = {"old": math.inf, "new": math.inf}
        n = repeats if per_step > 1 else max(20, repeats // 20)
        for _ in range(6):
            for label, fn in (("old", old), ("new", new)):
                t = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                best[label] = min(best[label], (time.perf_counter_ns() - t) / n / 1000)
        saved = (best["old"] - best["new"]) * per_step / 1000
        print(
            f"  {name:26s} old {best['old']:8.1f} us  new {best['new']:8.1f} us  x{per_step} per step: "
            f"{saved:+.2f} ms saved"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--quantization", nargs="+", default=["none", "int4"], choices=["none", "int4"])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler split")
    ap.add_argument("--no-components", action="store_true", help="skip the per-component timings")
    ap.add_argument("--pieces", action="store_true", help="also time old vs new form of the pieces issue 18 changed")
    ap.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "native", "torch"],
        help="the executor flag: native C++ decode attention, K/V writes and add + RMSNorm, or aten ops",
    )
    ap.add_argument(
        "--ab-cpu-kernels",
        action="store_true",
        help="also: steps with the native CPU kernels on and off taking turns (needs them loaded)",
    )
    ap.add_argument(
        "--ab-fused",
        action="store_true",
        help="also: steps with the fused decode layers and with the Python layers taking turns",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"runner {R.__file__}\nkernels {kernels_file}\ntorch {torch.__version__}, {torch.get_num_threads()} threads")
    for quantization in args.quantization:
        runner = build(args, quantization)
        run_mode(args, runner, quantization)
        del runner


@contextlib.contextmanager
def _native(model, on: bool):
    """--cpu-kernels native (as loaded) or torch for the `with` body, switched the way the
    executor switches them (`use_native_kernels`; the fused decode layers need the native ops,
    so torch drops them too)."""
    was, fused = model.backend.native, model.fused is not None
    model.use_native_kernels(on)
    try:
        yield
    finally:
        model.use_native_kernels(was)
        model.use_fused_decode(fused)


@contextlib.contextmanager
def _fused(model, on: bool):
    """The fused decode layers (as loaded) or the Python layers for the `with` body."""
    was = model.fused is not None
    model.use_fused_decode(on)
    try:
        yield
    finally:
        model.use_fused_decode(was)


def _take_turns(runner, ids, ctx: int, arms: dict, rounds: int, steps: int) -> dict[str, float]:
    """Median ms per decode step of each arm (name -> a context manager factory), the arms
    taking turns every `steps` steps on the same sequences, in order A B .. then .. B A: a slow
    minute on a shared machine falls on all alike, which separate runs cannot promise."""
    names, times = list(arms), {name: [] for name in arms}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            with arms[name]():
                t, _ = time_steps(runner, ids, ctx, steps, 1)
            times[name] += t
            ctx += steps + 1
    return {name: statistics.median(t) for name, t in times.items()}


def ab_fused(runner, batch: int, rounds: int = 6, steps: int = 10, ctx: int = 128) -> None:
    """Whole decode steps with the fused decode layers (chunkserve_kernels/csrc/cpu_layer.cpp) and with
    the Python layers on the same native ops, taking turns."""
    model = runner.model
    if model.fused is None:
        print("  fused decode layers: not switched on in this executor (--cpu-kernels, plan): no A/B")
        return
    ids = prefill(runner, batch, ctx, ctx + 2 * rounds * (steps + 1) + 8, first_id=batch * 1000 + 700)
    arms = {"fused": lambda: _fused(model, True), "python": lambda: _fused(model, False)}
    med = _take_turns(runner, ids, ctx, arms, rounds, steps)
    on, off = med["fused"], med["python"]
    print(
        f"  fused decode layers: step {on:.2f} ms vs Python layers {off:.2f} ms -> {on / off:.3f}x "
        f"({rounds} rounds x {steps} steps, taking turns)"
    )


def ab_cpu_kernels(runner, batch: int, args, rounds: int = 6, steps: int = 10) -> None:
    """Whole decode steps and no-GEMM steps with the native CPU kernels on and off, taking turns."""
    model = runner.model
    ids = prefill(runner, batch, args.ctx, args.ctx + 4 * rounds * (steps + 1) + 8, first_id=batch * 1000 + 500)

    def arm(on: bool, zero: bool):
        def enter():
            stack = contextlib.ExitStack()
            stack.enter_context(_native(model, on))
            if zero:
                stack.enter_context(NoGemm(model))
            return stack

        return enter

    arms = {(on, zero): arm(on, zero) for on in (True, False) for zero in (False, True)}
    med = _take_turns(runner, ids, args.ctx, arms, rounds, steps)
    for on in (False, True):
        name = "native" if on else "torch (aten)"
        print(
            f"  --cpu-kernels {name:13s}: step {med[(on, False)]:.2f} ms, no-GEMM step {med[(on, True)]:.2f} ms "
            f"-> non-GEMM share in situ {100 * med[(on, True)] / med[(on, False)]:.1f}%"
        )
    print(
        f"  native / torch: step {med[(True, False)] / med[(False, False)]:.3f}x, "
        f"no-GEMM step {med[(True, True)] / med[(False, True)]:.3f}x ({rounds} rounds x {steps} steps, taking turns)"
    )


def run_mode(args, runner, quantization: str) -> None:
    model, vocab = runner.model, runner.vocab_size
    total_len = args.ctx + 4 * (args.warmup + args.steps) + 8
    for batch in args.batch:
        ids = prefill(runner, batch, args.ctx, total_len, first_id=batch * 1000)
        times, tokens = time_steps(runner, ids, args.ctx, args.steps, args.warmup)
        step_ms = statistics.median(times)
        gemm_ms, n_lin = gemm_alone(model, batch, args.steps)
        ctx2 = args.ctx + args.warmup + args.steps
        with NoGemm(model):
            rest_times, _ = time_steps(runner, ids, ctx2, args.steps, args.warmup)
        rest_ms = statistics.median(rest_times)
        print(
            f"\n[{quantization}] batch {batch}, context {args.ctx}: decode step median {step_ms:.2f} ms "
            f"(min {min(times):.2f}) over {args.steps} steps"
        )
        print(
            f"  {n_lin} linears alone (same shapes and kernels): {gemm_ms:.2f} ms -> non-GEMM share "
            f"{100 * (1 - gemm_ms / step_ms):.1f}% ({step_ms - gemm_ms:.2f} ms)"
        )
        print(
            f"  step with every GEMM replaced by zeros: {rest_ms:.2f} ms (min {min(rest_times):.2f}) -> "
            f"non-GEMM share in situ {100 * rest_ms / step_ms:.1f}%"
            + (" (of the Python layers: the fused layers' GEMMs run inside C++)" if model.fused else "")
        )
        print(f"  tokens of sequence 0, first steps: {[t[0] for t in tokens[:8]]}")
        ctx3 = ctx2 + args.warmup + args.steps
        if not args.no_components:
            with torch.inference_mode():
                comps = components(runner, ids, ctx3)
            listed = sum(comps.values())
            print("  non-GEMM components, each timed alone (ms per step):")
            for name, ms in comps.items():
                print(f"    {name:32s} {ms:7.3f}")
            print(f"    {'sum':32s} {listed:7.3f}   rest (Python calls, views) {rest_ms - listed:7.3f}")
        if args.pieces:
            with torch.inference_mode():
                changed_pieces(model, batch)
        if not args.no_profile:
            # The executor's cursor, whatever the runs above left it at (components() computes
            # no step; the timed runs each moved it).
            cats = profile_split(runner, ids, runner.seqs[ids[0]].num_computed_tokens, args.steps, vocab)
            wall = cats.pop("_wall_profiled")
            print(f"  torch.profiler split (step under profiler: {wall:.2f} ms):")
            for name, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
                print(f"    {name:32s} {ms:7.2f} ms  {100 * ms / wall:5.1f}%")
        if args.ab_cpu_kernels:  # last: it prefills sequences of its own
            ab_cpu_kernels(runner, batch, args)
        if args.ab_fused:
            ab_fused(runner, batch, ctx=args.ctx)


if __name__ == "__main__":
    main()
