"""Output-token throughput of chunkserve vs Hugging Face `generate`, measured in one run.

    .venv/bin/python benchmarks/throughput.py [--dtype bfloat16] [--concurrency 1 8 32]

chunkserve: a real two-process server (started here) on the default model; C concurrent
gRPC streams of 128-token prompts, 128 new tokens each (ignore_eos), timed from the first
send to the last token. Baseline: transformers `generate` with static batching (batch = C,
same prompts, greedy, exactly 128 new tokens) on the same weights and dtype, after the
server has stopped so the two never share the cores. Prints a table of tok/s and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEXT = (ROOT / "README.md").read_text()


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Distinct prompts of exactly `length` tokens cut from real text."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    step = max(1, (len(ids) - length) // max(1, count))
    return [ids[i * step : i * step + length] for i in range(count)]


async def serve_round(address: str, batch: list[list[int]], new_tokens: int) -> float:
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(p: list[int]) -> int:
            n = 0
            req = build_request(p, temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            async for msg in stub.Generate(req):
                n += len(msg.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        elapsed = time.perf_counter() - start
    if sum(counts) != len(batch) * new_tokens:
        raise RuntimeError(f"expected {len(batch) * new_tokens} tokens, got {sum(counts)}")
    return sum(counts) / elapsed


def hf_round(model, batch: list[list[int]], new_tokens: int) -> float:
    import copy

    import torch

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample = None, False
    ids = torch.tensor(batch)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, generation_config=config, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
        )
    elapsed = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError("HF generated the wrong number of tokens")
    return len(batch) * new_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chunkserve.launch import start_server
    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    path = resolve_model("default", Path(default_cache_dir()))
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = {c: prompts(tokenizer, c, args.prompt_len) for c in args.concurrency}
    budget = str(args.max_num_batched_tokens)
    server = start_server(
        Path(tempfile.mkdtemp()),
        ["--model", str(path), "--dtype", args.dtype, "--max-num-batched-tokens", budget],
        ["--max-num-batched-tokens", budget, "--max-num-seqs", str(max(args.concurrency))],
    )
    ours: dict[int, float] = {}
    try:
        asyncio.run(serve_round(server.address, batches[args.concurrency[0]][:1], 8))  # warm-up
        for c in args.concurrency:
            ours[c] = asyncio.run(serve_round(server.address, batches[c], args.new_tokens))
            print(f"chunkserve  c={c:3d}: {ours[c]:8.1f} output tok/s", flush=True)
    finally:
        server.stop()

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf_round(model, batches[args.concurrency[0]][:1], 8)  # warm-up
    theirs: dict[int, float] = {}
    for c in args.concurrency:
        theirs[c] = hf_round(model, batches[c], args.new_tokens)
        print(f"HF generate b={c:3d}: {theirs[c]:8.1f} output tok/s", flush=True)

    print(
        f"\n{args.dtype}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print("| concurrency | chunkserve tok/s | HF generate tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for c in args.concurrency:
        print(f"| {c} | {ours[c]:.1f} | {theirs[c]:.1f} | {ours[c] / theirs[c]:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "chunkserve": ours, "hf_generate": theirs}, indent=2))


if __name__ == "__main__":
    main()
