"""Step time of the executor alone, TP=1 vs TP=N (tensor parallelism), and the share of a
step rank 0 spends inside collectives (waiting for the other ranks included).

Runs the same recorded plans — one prefill step of --batch prompts of --prompt tokens, then
--decode decode steps of the whole batch — through `python -m executor_svc.replay` once per
group size, with the CPU cores split between the ranks (--threads per rank = --cores / N),
and prints one line per size. Without --model it uses chunkserve.launch's tiny random model
shape (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 49152).

    python benchmarks/tp_step_time.py --tp 1 2 --cores 2

On GPUs (NCCL, one GPU per rank: cuda:LOCAL_RANK), with a random-weight model of
Llama-3-8B's shapes written once to --model-dir (~16 GB of bf16 safetensors, no download),
as benchmarks/GPU.md says:

    python benchmarks/tp_step_time.py --device cuda --shape llama3-8b --model-dir /tmp/llama3-8b-random \
        --tp 1 2 4 8 --batch 32 --prompt 512 --decode 64

On CUDA the share of a step spent in collectives is not reported: NCCL calls return once
the work is queued, so the host time inside them is not the communication time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chunkserve_contracts.executor.v1 import executor_pb2 as epb  # noqa: E402
from executor_svc.replay import write_messages  # noqa: E402

BLOCK = 16
# Llama-3-8B (benchmarks/gpu_bench.py has the same; tests/test_tp_step_time.py checks both).
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
SHAPES = {"llama3-8b": LLAMA3_8B}


def tensor_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (Hugging Face names) of an untied Llama of `shape`."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        out |= {
            layer + "self_attn.q_proj.weight": (h, h),
            layer + "self_attn.k_proj.weight": (kv, h),
            layer + "self_attn.v_proj.weight": (kv, h),
            layer + "self_attn.o_proj.weight": (h, h),
            layer + "mlp.gate_proj.weight": (inter, h),
            layer + "mlp.up_proj.weight": (inter, h),
            layer + "mlp.down_proj.weight": (h, inter),
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
        }
    return out | {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}


def write_random_llama(path: Path, shape: dict, dtype: str = "bfloat16") -> Path:
    """A random-weight Llama of `shape` (norms 1, other weights N(0, 0.02)) as a model folder,
    one safetensors file per layer, so the whole model is never in memory at once. Kept: a
    folder that already has the same config.json is used as it is."""
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path = Path(path)
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text()) == config:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    gen = torch.Generator().manual_seed(0)
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, size in tensor_shapes(shape).items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "other"
        groups.setdefault(key, {})[name] = size
    for key, tensors in groups.items():
        data = {}
        for name, size in tensors.items():
            t = torch.empty(size, dtype=getattr(torch, dtype))
            data[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=gen)
        save_file(data, str(path / f"model-{key}.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))  # last: a complete folder
    return path


def round_plans(
    first_seq: int, batch: int, prompt: int, decode: int, vocab: int, stride: int, step0: int
) -> list[epb.StepRequest]:
    """One prefill step of `batch` prompts, then `decode` decode steps of the whole batch;
    sequence i has seq_id first_seq + i and blocks i * stride onwards."""
    greedy = epb.SamplingParams(temperature=0.0, top_p=1.0, num_logprobs=-1)
    ids = range(first_seq, first_seq + batch)
    tables = {s: list(range(i * stride, i * stride + -(-prompt // BLOCK))) for i, s in enumerate(ids)}
    out = [
        epb.StepRequest(
            step_id=step0,
            new_seqs=[epb.NewSequence(seq_id=s, sampling=greedy) for s in ids],
            seqs=[
                epb.ScheduledSequence(
                    seq_id=s,
                    num_new_tokens=prompt,
                    token_ids=[(7 * i + j) % vocab for j in range(prompt)],
                    block_ids=tables[s],
                    sample=True,
                )
                for i, s in enumerate(ids)
            ],
        )
    ]
    for k in range(decode):
        pos = prompt + k
        seqs = []
        for i, s in enumerate(ids):
            fresh = [i * stride + pos // BLOCK] if pos % BLOCK == 0 else []
            seqs.append(
                epb.ScheduledSequence(seq_id=s, num_computed_tokens=pos, num_new_tokens=1, block_ids=fresh, sample=True)
            )
        out.append(epb.StepRequest(step_id=step0 + k + 1, seqs=seqs))
    return out


def plans(batch: int, prompt: int, decode: int, vocab: int, warmup: int = 0, stride: int = 64) -> list[epb.StepRequest]:
    """`warmup` short rounds (a prefill and up to 2 decodes; kernel compilation, allocator
    growth) on other sequence ids and the same blocks, each finished by the next round's
    first step, then the measured round: sequences 0..batch-1."""
    out: list[epb.StepRequest] = []
    previous: list[int] = []
    for r in range(warmup + 1):
        measured = r == warmup
        first = 0 if measured else 10_000 * (r + 1)
        steps = round_plans(first, batch, prompt, decode if measured else min(decode, 2), vocab, stride, len(out))
        steps[0].finished_seq_ids.extend(previous)
        previous = list(range(first, first + batch))
        out += steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: a random model of --shape, written to --model-dir)")
    p.add_argument(
        "--shape",
        choices=["tiny", *SHAPES],
        default="tiny",
        help="without --model: tiny = chunkserve.launch's tiny random model (default); llama3-8b = "
        "Llama-3-8B's shapes, random bf16 weights (~16 GB on disk)",
    )
    p.add_argument("--model-dir", type=Path, help="where the random model is written and kept (default: a temp folder)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL, one GPU per rank")
    p.add_argument("--dtype", help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cores", type=int, default=2, help="CPU threads in all, split between the ranks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument(
        "--warmup", type=int, help="unmeasured short rounds before the measured one (default: 0 on cpu, 1 on cuda)"
    )
    args = p.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    warmup = args.warmup if args.warmup is not None else (0 if args.device == "cpu" else 1)
    stride = max(64, -(-(args.prompt + args.decode) // BLOCK))  # blocks per sequence
    sizes = args.tp
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if not gpus:
            sys.exit("--device cuda: no CUDA device visible")
        if any(tp > gpus for tp in sizes):
            print(f"{gpus} GPU(s) visible: skipping TP={[tp for tp in sizes if tp > gpus]} (one GPU per rank)")
            sizes = [tp for tp in sizes if tp <= gpus]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model:
            model = Path(args.model)
        elif args.shape == "tiny":
            from chunkserve.launch import write_tiny_model

            model = write_tiny_model(args.model_dir or tmp / "model", tmp)
        else:
            started = time.perf_counter()
            model = write_random_llama(args.model_dir or tmp / "model", SHAPES[args.shape])
            print(f"random {args.shape} model in {model} ({time.perf_counter() - started:.0f} s)")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        all_plans = plans(args.batch, args.prompt, args.decode, vocab, warmup, stride)
        skip = len(all_plans) - (args.decode + 1)  # the warmup rounds' steps
        write_messages(tmp / "plans.bin", all_plans)
        print(
            f"model {model}, batch {args.batch}, prompt {args.prompt}, {args.decode} decode steps, "
            f"{args.device} {dtype}"
            + (f", {args.cores} cores" if args.device == "cpu" else f", {warmup} warmup round(s)")
        )
        for tp in sizes:
            cmd = [sys.executable, "-m", "executor_svc.replay", "--plans", str(tmp / "plans.bin")]
            cmd += ["--out", str(tmp / "out.bin"), "--comm-out", str(tmp / "comm.json"), "--model", str(model)]
            cmd += ["--device", args.device, "--dtype", dtype, "--num-gpu-blocks-override", str(stride * args.batch)]
            cmd += ["--attention-backend", args.attention_backend]
            cmd += ["--max-num-batched-tokens", str(max(2048, args.batch * args.prompt))]
            cmd += ["--tensor-parallel-size", str(tp), "--num-threads", str(max(1, args.cores // tp))]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"TP={tp}: the replay failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            steps = json.loads((tmp / "comm.json").read_text())[skip:]
            wall = [w / 1e6 for w, _ in steps[1:]]
            share = [c / w for w, c in steps[1:]]
            if args.device == "cpu":
                comm = f" (comm {steps[0][1] / steps[0][0]:.0%})"
                comm_decode = f", comm share of a decode step median {statistics.median(share):.0%}"
            else:  # NCCL is asynchronous: host time inside its calls is not communication time
                comm = comm_decode = ""
            median = statistics.median(wall)
            print(
                f"TP={tp}: prefill step {steps[0][0] / 1e6:.1f} ms{comm}, "
                f"decode step median {median:.2f} ms (p90 {sorted(wall)[int(0.9 * len(wall))]:.2f}, "
                f"{args.batch / median * 1e3:.0f} tok/s){comm_decode}"
            )


if __name__ == "__main__":
    main()
