"""Executor speed per weight mode against this machine's floor (issue 18), in one run.

Measures, in this order and in one process:
- the floor: read bandwidth (sum over a 1 GiB float32 tensor in huge pages, best of 5) and the float32 GEMM
  peak (2048^3, the faster of `torch.mm` and oneDNN on a packed weight, best of 5 each, before
  and after the modes: the higher);
- Hugging Face transformers `generate` on the same float32 weights, batch 1, ms per token;
- per mode (`float32`; `float32-nopad` = `--no-cpu-gemm-row-padding`; `float32-noprepack` =
  `--no-cpu-gemm-prepack`; `int4` = `--quantization int4`; `-aten` appended (float32, int4):
  `--cpu-kernels torch`, decode attention and K/V writes on aten ops instead of the
  native CPU kernels; `bfloat16` / `float16` = that
  `--dtype` on CPU; each with the linear plan measured at load as a first start measures it
  (`--cpu-linear-plan remeasure`: every load measures, none reads a kept plan), or with
  `-table` appended, `--cpu-linear-plan table`; the plan and its measuring time are printed): the default model loaded exactly as the
  server loads it (`executor_svc.worker.load`), B greedy sequences prefilled to CTX tokens, then
  the median wall time of a whole decode step `ModelRunner.execute(plan)` (validation, metadata,
  forward, logits, sampling, reply proto) at each batch size, and a 512-token prefill chunk;
- the weight bytes a batch-1 decode step reads in each mode, and so the memory floor of that
  step (bytes / read bandwidth) and the step as a multiple of it. The bandwidth for the floor
  is sampled between the batch-1 steps themselves (one 1 GiB sum after each round of steps;
  the median counts): this VM's bandwidth moved 35-73 GB/s between runs minutes apart, so a
  figure read once at the start could put a step at 1.4x or 2.1x "its floor" by when it ran.

    timeout 1800 .venv/bin/python benchmarks/executor_modes.py [--batch 1 8 32] [--modes float32 int4 bfloat16]

Modes run in the order given, then again reversed (A B B A; `--repeat N` runs that N
times), and the figures are medians of all passes, so drift on a shared machine falls on both
alike; or, with `--interleave`, every mode is loaded at once and their decode steps (and three
512-token prefills) take turns, step by step: on a VM whose speed moves 2x within minutes,
the only comparison whose ratios hold. Greedy tokens of each mode's
batch-1 run are printed as agreement with float32's (same prompt ids, same positions).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc import memory
from executor_svc.config import ExecutorConfig, default_cache_dir
from executor_svc.models.layers import packed_linear, prepack_weight
from executor_svc.worker import load


def read_bandwidth_gbs() -> float:
    x = memory.empty(256 * 1024 * 1024, torch.float32).fill_(1.0)  # 1 GiB
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def gemm_peak_gflops(n: int = 2048) -> float:
    """The faster of torch.mm (MKL) and oneDNN on a packed weight (the executor's
    `packed_linear`) for n^3: on an AMD CPU MKL's GEMM stays below what oneDNN reaches,
    and a prefill through the packed copies ran above the MKL-only figure."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    if torch.backends.mkldnn.is_available():
        packed = prepack_weight(b)
        best = min(best, *(_timed(lambda: packed_linear(a, packed)) for _ in range(5)))
    return 2 * n**3 / best / 1e9


class BandwidthSampler:
    """Read bandwidth sampled between decode steps (GB/s of one sum over a 1 GiB float32
    tensor), so the floor a step is compared with is the machine's at the time it ran."""

    def __init__(self) -> None:
        self.x = memory.empty(256 * 1024 * 1024, torch.float32).fill_(1.0)
        self.samples: dict[int, list[float]] = {}

    def sample(self, batch: int) -> None:
        self.samples.setdefault(batch, []).append(self.x.numel() * 4 / _timed(lambda: self.x.sum()) / 1e9)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def hf_decode_ms(ctx: int, new_tokens: int = 33) -> float:
    """Hugging Face `generate` on the same float32 weights, batch 1: ms per decoded token, from
    (time of max_new_tokens=N) - (time of 1), over N - 1 tokens, median of 3."""
    from transformers import AutoModelForCausalLM

    from executor_svc.model_loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default", default_cache_dir()), dtype=torch.float32)
    ids = torch.tensor([[(7 * i) % 49000 + 10 for i in range(ctx)]])

    def gen(n: int) -> float:
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw))

    with torch.inference_mode():
        gen(2)
        return statistics.median((gen(new_tokens) - gen(1)) / (new_tokens - 1) * 1000 for _ in range(3))


BASE_MODES = (
    "float32",
    "float32-nopad",
    "float32-noprepack",
    "float32-aten",
    "int4",
    "int4-aten",
    "bfloat16",
    "float16",
)
MODES = BASE_MODES + tuple(m + "-table" for m in BASE_MODES)


def build(mode: str, threads: int, plan: str = "remeasure"):
    """The default model loaded as the server loads it in `mode` (MODES). A "-table" mode uses
    the tables; otherwise `plan` is --cpu-linear-plan ("remeasure": a plan measured now;
    "measure": the one a server on this machine keeps)."""
    table = mode.endswith("-table")
    mode = mode.removesuffix("-table")
    aten = mode.endswith("-aten")
    mode = mode.removesuffix("-aten")
    return load(
        ExecutorConfig(
            model="default",
            dtype=mode if mode in ("bfloat16", "float16") else "float32",
            cpu_gemm_row_padding=mode != "float32-nopad",
            cpu_gemm_prepack=mode != "float32-noprepack",
            cpu_linear_plan="table" if table else plan,
            device="cpu",
            kv_cache_memory_gib=1.0,
            swap_space=0.0,
            max_num_batched_tokens=2048,
            cache_dir=default_cache_dir(),
            num_threads=threads,
            quantization="int4" if mode == "int4" else "none",
            cpu_kernels="torch" if aten else "auto",
        )
    ).runner


def decode_bytes(model) -> int:
    """Weight bytes one batch-1 decode step reads with the kernels its plan gives one row, the
    embedding row aside (the default model's head is the embedding's weight, read whole)."""
    total = 0
    for lin in [*model.decoder_linears(), model.lm_head]:
        q = lin.reduced
        reduced = lin.plan(1) in ("reduced", "half-onednn")
        if reduced and hasattr(q, "packed"):  # int4
            total += q.packed.numel() * q.packed.element_size()
            total += q.scales_and_zeros.numel() * q.scales_and_zeros.element_size()
        elif reduced:
            total += q.weight.numel() * q.weight.element_size()
        else:
            total += lin.weight.numel() * lin.weight.element_size()
    return total


def run_mode(runner, batches: list[int], ctx: int, steps: int, sampler: BandwidthSampler | None = None) -> dict:
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    out: dict = {"decode_ms": {}, "tokens": None}
    for batch in batches:
        ids = _prefill(runner, batch, ctx, steps, greedy)
        times, tokens = [], []
        for k in range(steps + 3):
            t = time.perf_counter()
            resp = runner.execute(_decode_plan(ids, ctx, k))
            if k >= 3:
                times.append((time.perf_counter() - t) * 1000)
                if sampler is not None:
                    sampler.sample(batch)
            tokens.append(resp.sampled[0].token_id)
        out["decode_ms"][batch] = statistics.median(times)
        if batch == 1:
            out["tokens"] = tokens
    out["prefill_512_ms"] = _prefill_512_ms(runner, greedy)
    return out


def _decode_plan(ids: list[int], ctx: int, k: int):
    seqs = [epb.ScheduledSequence(seq_id=s, num_computed_tokens=ctx + k, num_new_tokens=1, sample=True) for s in ids]
    return epb.StepRequest(step_id=1000 + k, seqs=seqs)


def _prefill_512_ms(runner, greedy) -> float:
    """One 512-token prefill chunk from an empty cache, ms."""
    runner.reset()
    plan = epb.StepRequest(step_id=1)
    plan.new_seqs.add(seq_id=1, sampling=greedy)
    plan.seqs.add(
        seq_id=1,
        num_computed_tokens=0,
        num_new_tokens=512,
        token_ids=[(7 * i) % 49000 + 10 for i in range(512)],
        block_ids=list(range(512 // runner.block_size + 1)),
        sample=True,
    )
    t = time.perf_counter()
    runner.execute(plan)
    return (time.perf_counter() - t) * 1000


def _prefill(runner, batch: int, ctx: int, steps: int, greedy) -> list[int]:
    """B sequences prefilled to `ctx` tokens, one step each; returns their ids."""
    runner.reset()
    nb = -(-(ctx + steps + 8) // runner.block_size)
    ids = list(range(1, batch + 1))
    for k, sid in enumerate(ids):
        plan = epb.StepRequest(step_id=k)
        plan.new_seqs.add(seq_id=sid, sampling=greedy)
        prompt = [(sid * 7 + i) % 49000 + 10 for i in range(ctx)]
        plan.seqs.add(
            seq_id=sid,
            num_computed_tokens=0,
            num_new_tokens=ctx,
            token_ids=prompt,
            block_ids=list(range(k * nb, (k + 1) * nb)),
            sample=True,
        )
        runner.execute(plan)
    return ids


def run_interleaved(
    runners: dict, batches: list[int], ctx: int, steps: int, sampler: BandwidthSampler | None = None
) -> dict[str, dict]:
    """`run_mode` for all modes at once, their steps taking turns (mode order rotated each
    step): a burst of load on a shared machine falls on every mode alike, which passes
    minutes apart cannot promise (step times of one mode moved 2x between passes)."""
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    modes = list(runners)
    out = {m: {"decode_ms": {}, "tokens": None} for m in modes}
    for batch in batches:
        ids = {m: _prefill(runners[m], batch, ctx, steps, greedy) for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}
        tokens: dict[str, list[int]] = {m: [] for m in modes}
        for k in range(steps + 3):
            for m in modes[k % len(modes) :] + modes[: k % len(modes)]:
                t = time.perf_counter()
                resp = runners[m].execute(_decode_plan(ids[m], ctx, k))
                if k >= 3:
                    times[m].append((time.perf_counter() - t) * 1000)
                tokens[m].append(resp.sampled[0].token_id)
            if k >= 3 and sampler is not None:
                sampler.sample(batch)
        for m in modes:
            out[m]["decode_ms"][batch] = statistics.median(times[m])
            if batch == 1:
                out[m]["tokens"] = tokens[m]
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(3):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            prefill[m].append(_prefill_512_ms(runners[m], greedy))
    for m in modes:
        out[m]["prefill_512_ms"] = statistics.median(prefill[m])
    return out


def _plan_text(model) -> str:
    return f" (plan: linears {model.model.plan}; head {model.lm_head.plan})"


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["float32", "int4"], choices=MODES)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="load every mode at once and time their steps in turn (one pass; memory: all modes' weights)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run the A..Z, Z..A block this many times (2 passes each)")
    args = ap.parse_args()
    if 1 not in args.batch:  # found failing at the end of a run without it
        ap.error("--batch needs 1: the floor ratio and the top-1 agreement are batch-1 figures")
    return args


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    bw, peak = read_bandwidth_gbs(), gemm_peak_gflops()
    print(f"read bandwidth {bw:.1f} GB/s, float32 GEMM peak {peak:.0f} GFLOP/s ({args.threads} threads)", flush=True)
    hf_ms = hf_decode_ms(args.ctx)
    print(f"HF transformers generate, float32, batch 1: {hf_ms:.1f} ms per decoded token", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    weight_bytes: dict[str, int] = {}
    sampler = BandwidthSampler()
    if args.interleave:
        runners = {m: build(m, args.threads) for m in args.modes}
        for mode, runner in runners.items():
            weight_bytes[mode] = decode_bytes(runner.model)
            linear_params = sum(m.weight.numel() for m in runner.model.decoder_linears())
            print(f"{mode}: loaded{_plan_text(runner.model)}", flush=True)
        with torch.inference_mode():
            for mode, r in run_interleaved(runners, args.batch, args.ctx, args.steps, sampler).items():
                results[mode].append(r)
        del runners
    for mode in [] if args.interleave else (args.modes + args.modes[::-1]) * args.repeat:
        runner = build(mode, args.threads)
        weight_bytes[mode] = decode_bytes(runner.model)
        linear_params = sum(m.weight.numel() for m in runner.model.decoder_linears())
        with torch.inference_mode():
            results[mode].append(run_mode(runner, args.batch, args.ctx, args.steps, sampler))
        r = results[mode][-1]
        text = ", ".join(f"B={b} {ms:.1f} ms" for b, ms in r["decode_ms"].items())
        print(f"{mode}: {text}{_plan_text(runner.model)}", flush=True)
        del runner
    again = gemm_peak_gflops()  # a burst of load at the start must not set the peak low
    if again > peak:
        print(f"float32 GEMM peak measured again after the modes: {again:.0f} GFLOP/s (the higher one counts)")
        peak = again
    during = sampler.samples.get(1)
    if during:  # the floor at the time the batch-1 steps ran
        q = statistics.quantiles(during, n=4)
        print(
            f"read bandwidth between the batch-1 steps: median {statistics.median(during):.1f} GB/s "
            f"(quartiles {q[0]:.1f}-{q[2]:.1f}, {len(during)} samples; {bw:.1f} at the start): the floor's"
        )
        bw = statistics.median(during)
    base = args.modes[0]
    how = "all modes loaded, steps taking turns" if args.interleave else f"median of {2 * args.repeat} passes"
    print(f"\n{how}; decode steps at context {args.ctx}")
    head = f"{'mode':18}" + "".join(f"{'B=' + str(b) + ' ms':>11}" for b in args.batch)
    print(head + f"{'floor ms':>10}{'B=1/floor':>11}{'prefill 512':>13}{'  top-1 = ' + base}")
    for mode, runs in results.items():
        ms = {b: statistics.median(r["decode_ms"][b] for r in runs) for b in args.batch}
        floor = weight_bytes[mode] / (bw * 1e9) * 1000
        prefill = statistics.median(r["prefill_512_ms"] for r in runs)
        agree = statistics.mean(a == b for a, b in zip(runs[0]["tokens"], results[base][0]["tokens"]))
        row = f"{mode:18}" + "".join(f"{ms[b]:11.1f}" for b in args.batch)
        print(row + f"{floor:10.1f}{ms[1] / floor:11.2f}{prefill:13.0f}{agree:17.2f}")
    for mode, runs in results.items():
        one = statistics.median(r["decode_ms"][1] for r in runs) if 1 in args.batch else float("nan")
        print(f"{mode}: batch-1 decode step {one:.1f} ms = {hf_ms / one:.2f}x HF generate's speed ({hf_ms:.1f} ms)")
    for mode, runs in results.items():
        if mode != base:
            ratios = [
                statistics.median(r["decode_ms"][b] for r in results[base])
                / statistics.median(r["decode_ms"][b] for r in runs)
                for b in args.batch
            ]
            print(f"{mode} speed-up over {base}: " + ", ".join(f"B={b} {x:.2f}x" for b, x in zip(args.batch, ratios)))
    flops = 2 * linear_params * 512  # the decoder's linears; the head runs on one row
    for mode, runs in results.items():
        ms = statistics.median(r["prefill_512_ms"] for r in runs)
        print(
            f"{mode}: 512-token prefill at {flops / (ms / 1000) / 1e9:.0f} GFLOP/s = {flops / (ms / 1000) / 1e9 / peak:.0%} of the float32 GEMM peak"
        )


if __name__ == "__main__":
    main()
