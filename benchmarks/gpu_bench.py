"""Decode and prefill speed of our Llama on one GPU, against the hardware's floors.

    python benchmarks/gpu_bench.py                 # Llama-3-8B shapes, random bf16 weights, CUDA
    python benchmarks/gpu_bench.py --tiny          # tiny shapes; runs on CPU (checks the script)

The model is `executor_svc.models.LlamaForCausalLM` built directly with random weights
(no download, no checkpoint): 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336,
vocab 128256. Each attention backend available on the device is measured on the same
weights by swapping the backend of every attention layer.

- decode: one step of B sequences with ~1024 tokens of context each (metadata built on the
  host every step, as the executor does; logits for B rows). The floor is the weights
  read once from HBM (bytes / 4.3 TB/s); the second floor adds the KV cache the step reads.
  For a backend that can be captured (`graph_safe`: triton) the same step again through
  executor_svc/cuda_graphs.py (static buffers filled from the host, one graph replay per
  step, a graph captured per measured batch size): the "graph ms" column, and its ratio.
  With --tiny on CPU that path runs its padded forward eagerly (checks the script only).
- the norms: on CUDA a 16-bit model's residual add + RMSNorm run as one Triton kernel each, as
  in the executor (`LlamaForCausalLM.use_triton_norms`); `--torch-norms` runs torch's ops
  instead, for the A/B (the JSON's "norms" says which).
- prefill: one step of 8 fresh sequences x 2048 tokens; achieved TFLOP/s counts the
  matmuls (2 x non-embedding params per token) plus causal attention, against ~790 TFLOP/s
  (dense bf16 on an H200; the peak a product of 8192^3 reaches, measured).

Prints a table; writes gpu_bench.json under $OUT when that is set (or --json PATH).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chunkserve.launch import TINY_LLAMA  # noqa: E402
from chunkserve_kernels import build_metadata, choose_backend, get_backend, set_forward_context  # noqa: E402
from executor_svc.cuda_graphs import DecodeGraphs  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200, measured device-to-device copy
PEAK_FLOPS = 790e12  # H200 dense bf16, measured 8192^3 product
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
TINY = dict(
    TINY_LLAMA,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    vocab_size=1024,
    max_position_embeddings=4096,
)


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, triton_norms: bool = True):
    import transformers

    from executor_svc.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    model = LlamaForCausalLM(config, "torch", dtype, device).eval()
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if device.type == "cuda" and dtype != torch.float32:  # as the executor's start-up (worker.py)
        model.use_triton_norms(triton_norms)
    return model, config


def set_backend(model, name: str) -> None:
    backend = get_backend(name)
    for layer in model.model.layers:
        layer.self_attn.attn.backend = backend


def timed(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Mean seconds per call after warm-up (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def make_step(model, kv_cache, seqs: list[tuple[int, int]], block_size: int, device: torch.device):
    """A closure running one executor-like step: metadata, forward, logits of each last row."""
    tables, next_block = [], 0
    for before, q in seqs:
        n = math.ceil((before + q) / block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    q_lens, before = [q for _, q in seqs], [b for b, _ in seqs]
    ids = torch.randint(0, model.config.vocab_size, (sum(q_lens),), device=device)
    last = torch.tensor([sum(q_lens[: i + 1]) - 1 for i in range(len(seqs))], device=device)

    @torch.inference_mode()
    def step() -> None:
        meta, positions = build_metadata(q_lens, before, tables, block_size, device)
        with set_forward_context(meta, kv_cache):
            hidden = model(ids, positions)
        model.compute_logits(hidden.index_select(0, last))

    return step, tables


def graph_step(model, graphs: DecodeGraphs, tables: list[list[int]], context: int):
    """The decode step of make_step's `tables` (one new token at position `context` each)
    through DecodeGraphs: buffers filled from host lists, a replay, logits for every row."""
    token_ids = [(7 * i) % model.config.vocab_size for i in range(len(tables))]
    computed = [context] * len(tables)

    @torch.inference_mode()
    def step() -> None:
        model.compute_logits(graphs.run(token_ids, computed, tables))

    return step


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = TINY if args.tiny else LLAMA3_8B
    model, cfg = build_model(shape, dtype, device, not args.torch_norms)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters()) - embed  # lm_head: only sampled rows
    matmul_params -= cfg.vocab_size * cfg.hidden_size
    kv_bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dtype.itemsize
    backends = args.backends or default_backends(device, dtype)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": shape,
        "norms": "triton" if any(getattr(m, "triton", None) for m in model.modules()) else "torch",
        "weight_bytes": weight_bytes,
        "decode": [],
        "prefill": [],
    }
    for name in backends:
        block_size = 256 if name == "flash_attn" else args.block_size
        reason = unusable(name, dtype, block_size, head_dim)
        if reason:
            print(f"skipping backend {name}: {reason}")
            result.setdefault("skipped", {})[name] = reason
            continue
        set_backend(model, name)
        tokens_needed = max(max(args.batches) * (args.context + 1), args.prefill_seqs * args.prefill_len)
        num_blocks = math.ceil(tokens_needed / block_size) + max(args.batches) + args.prefill_seqs
        kv_cache = torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_blocks + 1,  # the last: the CUDA graphs' scratch block
            block_size,
            cfg.num_key_value_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        graphs = None
        if get_backend(name).graph_safe or device.type != "cuda":
            capture = device.type == "cuda"
            graphs = DecodeGraphs(model, kv_cache, model.max_model_len, num_blocks, sorted(args.batches), capture)
        for batch in args.batches:
            step, tables = make_step(model, kv_cache, [(args.context, 1)] * batch, block_size, device)
            seconds = timed(step, args.warmup, args.iters, device)
            graph_seconds = None
            if graphs is not None:
                graph_seconds = timed(graph_step(model, graphs, tables, args.context), args.warmup, args.iters, device)
            if args.profile:
                profile_step(step, f"{name} eager", batch)
                if graphs is not None:
                    profile_step(graph_step(model, graphs, tables, args.context), f"{name} graph", batch)
            floor = weight_bytes / HBM_BYTES_PER_S
            floor_kv = (weight_bytes + batch * (args.context + 1) * kv_bytes_per_token) / HBM_BYTES_PER_S
            result["decode"].append(
                {
                    "backend": name,
                    "block_size": block_size,
                    "batch": batch,
                    "context": args.context,
                    "step_ms": seconds * 1e3,
                    "tokens_per_s": batch / seconds,
                    "floor_ms": floor * 1e3,
                    "floor_with_kv_ms": floor_kv * 1e3,
                    "floor_fraction": floor / seconds,
                    "graph_step_ms": None if graph_seconds is None else graph_seconds * 1e3,
                    "graph_floor_fraction": None if graph_seconds is None else floor / graph_seconds,
                }
            )
        del graphs
        result["prefill"].append(prefill_row(model, kv_cache, args, name, block_size, matmul_params))
        del kv_cache
    return result


def prefill_row(model, kv_cache, args: argparse.Namespace, name: str, block_size: int, matmul_params: int) -> dict:
    """One step of `--prefill-seqs` fresh sequences of `--prefill-len` tokens: its time,
    tokens/s and TFLOP/s (the matmuls' 2 x params per token plus causal attention)."""
    cfg, device = model.config, kv_cache.device
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    seqs = [(0, args.prefill_len)] * args.prefill_seqs
    step, _ = make_step(model, kv_cache, seqs, block_size, device)
    seconds = timed(step, max(1, args.warmup // 2), max(1, args.iters // 2), device)
    tokens = args.prefill_seqs * args.prefill_len
    attn_flops = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * args.prefill_len**2
    flops = 2 * matmul_params * tokens + attn_flops * args.prefill_seqs
    return {
        "backend": name,
        "block_size": block_size,
        "seqs": args.prefill_seqs,
        "len": args.prefill_len,
        "step_ms": seconds * 1e3,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / 1e12,
        "peak_fraction": flops / seconds / PEAK_FLOPS,
    }


def profile_step(fn, name: str, batch: int, steps: int = 3) -> None:
    """--profile: the kernels one decode step runs (through the graphs where captured), by
    device time, and their sum per step: with the step's time it splits the gap to the floor
    into slow kernels and time between them."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total: dict[str, list[float]] = {}
    for e in kernels:
        total.setdefault(e.name[:90], []).append(e.device_time)
    busy = sum(sum(v) for v in total.values()) / steps / 1e3
    print(f"\nprofile {name} batch {batch}: {len(kernels) / steps:.0f} kernels, {busy:.3f} ms of kernel time per step")
    for kname, times in sorted(total.items(), key=lambda kv: -sum(kv[1]))[:14]:
        print(f"  {sum(times) / steps / 1e3:8.3f} ms  {len(times) // steps:5d} x  {kname}")


def unusable(name: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why `name` cannot run here (not installed, or a dtype/size it refuses), else None."""
    if name in ("triton", "flash_attn") and importlib.util.find_spec(name) is None:
        return f"{name} is not installed"
    try:
        backend = get_backend(name)
        backend.check_dtype(dtype)
        backend.check_block_size(block_size)
        backend.check_head_size(head_dim)
    except ValueError as e:
        return str(e)
    return None


def default_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """What `auto` picks at block 16 and 256, plus the torch backend for reference."""
    names = [choose_backend(device, dtype, 16), choose_backend(device, dtype, 256), "torch"]
    return list(dict.fromkeys(names))


def print_table(result: dict, tiny: bool) -> None:
    print(
        f"\n{result['device']}, torch {result['torch']}, {result['dtype']}, "
        f"weights {result['weight_bytes'] / 2**30:.2f} GiB, {result['norms']} norms"
        + ("  (--tiny: floors are H200 figures)" if tiny else "")
    )
    print(
        "\ndecode  backend      block batch ctx   step ms  tok/s      floor ms  +KV ms  of floor"
        "  graph ms  of floor  eager/graph"
    )
    for r in result["decode"]:
        graph = ""
        if r.get("graph_step_ms"):
            g = r["graph_step_ms"]
            graph = f" {g:>9.2f} {r['graph_floor_fraction']:>9.0%} {r['step_ms'] / g:>12.2f}"
        print(
            f"        {r['backend']:<12} {r['block_size']:>5} {r['batch']:>5} {r['context']:>5} "
            f"{r['step_ms']:>8.2f} {r['tokens_per_s']:>9.0f} {r['floor_ms']:>9.3f} {r['floor_with_kv_ms']:>7.3f}"
            f" {r['floor_fraction']:>8.0%}{graph}"
        )
    print("\nprefill backend      block tokens      step ms  tok/s      TFLOP/s  of 790")
    for r in result["prefill"]:
        print(
            f"        {r['backend']:<12} {r['block_size']:>5} {r['seqs']:>2}x{r['len']:<7} {r['step_ms']:>8.1f} "
            f"{r['tokens_per_s']:>9.0f} {r['tflops']:>8.1f} {r['peak_fraction']:>7.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the script, not the GPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backends", nargs="*", default=None, help="default: what auto picks, and torch")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (flash_attn always uses 256)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (1 32 128)")
    p.add_argument("--context", type=int, default=None, help="decode context per sequence (1024)")
    p.add_argument("--prefill-seqs", type=int, default=None)
    p.add_argument("--prefill-len", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="also list each decode step's kernels by device time")
    p.add_argument("--torch-norms", action="store_true", help="16-bit add + RMSNorm on torch's ops, not Triton's")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="default: $OUT/gpu_bench.json when OUT is set")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    small = args.tiny
    args.batches = args.batches or ([1, 4] if small else [1, 32, 128])
    args.context = args.context or (64 if small else 1024)
    args.prefill_seqs = args.prefill_seqs or (2 if small else 8)
    args.prefill_len = args.prefill_len or (64 if small else 2048)
    if small:
        args.warmup, args.iters = 1, 2
    result = run(args)
    print_table(result, args.tiny)
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_bench.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
