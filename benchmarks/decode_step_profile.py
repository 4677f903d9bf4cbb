"""Where a decode step's time goes in the executor (issue 18, item 1): the default model
(SmolLM2-135M, fp32, CPU), B sequences prefilled to a context of CTX tokens, then decode
steps through `ModelRunner.execute(plan)` exactly as the server runs them (plan validation
-> metadata -> forward -> logits -> greedy sampling -> reply proto).

    timeout 900 .venv/bin/python benchmarks/decode_step_profile.py [--batch 1 32] [--ctx 128] [--steps 30]

Per batch size it prints:
- the median wall time of a whole `execute()` of a decode step (no profiler);
- GEMM time: the same 4 x layers + 1 linears (same weights, same shapes, same `linear`
  function) run alone, median of the same number of repeats; the non-GEMM share of the step
  is 1 - GEMM / step;
- a split of the step by torch.profiler, self CPU time aggregated by op and grouped into
  GEMM (mm/addmm), attention (K/V write, gather, scores, softmax, P@V), elementwise (norms,
  rotary, silu*mul, residual adds, embedding), logits + sampling (the vocab GEMM, argmax) and
  the rest (Python: plan handling, metadata, module calls) = step wall - profiled ops. The
  profiler adds per-op overhead, so its shares are indicative; the GEMM-alone share is the
  number to quote.

torch runs with 2 threads (this machine's cores; --threads to change). To measure another
tree, put a folder with links named executor_svc, chunkserve_contracts and
chunkserve_kernels (-> its kernels/) first on PYTHONPATH; the script prints which files it
runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict

import torch
from chunkserve_kernels import __file__ as kernels_file

import executor_svc.runner as R
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.config import ExecutorConfig, default_cache_dir
from executor_svc.models.layers import linear
from executor_svc.server import load

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


def build(args):
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


def gemm_alone(model, batch: int, repeats: int) -> float:
    """Median ms of all the model's linears (layers + vocab head) on [batch, in] inputs."""
    weights = []
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            weights.append((lin.weight, lin.bias))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    weights.append((head, None))
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w, _ in weights}
    times = []
    with torch.inference_mode():
        for k in range(repeats + 3):
            t = time.perf_counter_ns()
            for w, b in weights:
                linear(xs[w.shape[1]], w, b)
            if k >= 3:
                times.append((time.perf_counter_ns() - t) / 1e6)
    return statistics.median(times), len(weights)


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
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
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
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler split")
    ap.add_argument("--pieces", action="store_true", help="also time old vs new form of the pieces issue 18 changed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = build(args)
    print(f"runner {R.__file__}\nkernels {kernels_file}\ntorch {torch.__version__}, {torch.get_num_threads()} threads")
    model, vocab = runner.model, runner.vocab_size
    total_len = args.ctx + 3 * (args.warmup + args.steps) + 8
    for batch in args.batch:
        ids = prefill(runner, batch, args.ctx, total_len, first_id=batch * 1000)
        times, tokens = time_steps(runner, ids, args.ctx, args.steps, args.warmup)
        step_ms = statistics.median(times)
        gemm_ms, n_lin = gemm_alone(model, batch, args.steps)
        print(
            f"\nbatch {batch}, context {args.ctx}: decode step median {step_ms:.2f} ms (min {min(times):.2f}) "
            f"over {args.steps} steps"
        )
        print(
            f"  {n_lin} linears alone (same shapes): {gemm_ms:.2f} ms -> non-GEMM share "
            f"{100 * (1 - gemm_ms / step_ms):.1f}% ({step_ms - gemm_ms:.2f} ms)"
        )
        print(f"  tokens of sequence 0, first steps: {[t[0] for t in tokens[:8]]}")
        if args.pieces:
            with torch.inference_mode():
                changed_pieces(model, batch)
        if not args.no_profile:
            ctx2 = args.ctx + args.warmup + args.steps
            cats = profile_split(runner, ids, ctx2, args.steps, vocab)
            wall = cats.pop("_wall_profiled")
            print(f"  torch.profiler split (step under profiler: {wall:.2f} ms):")
            for name, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
                print(f"    {name:32s} {ms:7.2f} ms  {100 * ms / wall:5.1f}%")


if __name__ == "__main__":
    main()
