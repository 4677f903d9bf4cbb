"""What presence / frequency / repetition penalties cost, measured against the same load without.

    .venv/bin/python benchmarks/penalties.py [--streams 32] [--rounds 3] [--parts cost throughput]

(a) cost (in-process, no server): the executor's per-step work for S penalized rows of the
    default model's 49,152-token vocabulary (executor_svc.penalties.apply_penalties with all
    three penalties, each row holding a P-token prompt and 64 output tokens), the whole greedy
    sample() of those rows with and without the penalties (the step's only extra work), and
    the one-off TokenHistory of a P-token prompt (what a NewSequence with a penalty costs), and
    sample() with 16 of vLLM's bad words a row instead (8 of 1-3 tokens, 8 of three whose first
    two end the row's output).
(b) throughput: a real two-process server (started here) on the default model, float32; S
    concurrent gRPC streams of 32-token prompts, exactly --new-tokens greedy tokens each
    (ignore_eos), plain or with all three penalties; rounds alternate, median output tok/s of
    each and the ratio penalized / plain, both from this run; with `--busy N` the same rounds
    again while N pure-Python processes spin (a shared machine), each condition's own ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.25}


def cost(streams: int, prompt_len: int, vocab: int = 49152, repeats: int = 50) -> dict:
    import torch

    from executor_svc.penalties import Penalties, TokenHistory, apply_penalties
    from executor_svc.sampler import SamplingSpec, sample

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(streams, vocab, generator=gen)
    spec = Penalties(PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"], PENALTIES["repetition_penalty"])
    rows = {}
    for r in range(streams):
        prompt = torch.randint(vocab, (prompt_len,), generator=gen).tolist()
        output = torch.randint(vocab, (64,), generator=gen).tolist()
        rows[r] = (spec, TokenHistory(prompt, output), [])
    apply_penalties(logits.clone(), rows)  # warm-up

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3, statistics.median(times) * 1e3

    step = best(lambda: apply_penalties(logits.clone(), rows))  # the clone: as the sampler's
    greedy = [SamplingSpec(temperature=0)] * streams
    with_penalties = [SamplingSpec(temperature=0, penalties=spec)] * streams
    histories = {r: (rows[r][1], []) for r in rows}
    plain_sample = best(lambda: sample(logits, greedy, list(range(streams))))
    penalized_sample = best(lambda: sample(logits, with_penalties, list(range(streams)), histories=histories))
    # vLLM's bad_words: 16 words a row, 8 of 1-3 tokens (k, k + 1, ...) and 8 of three tokens
    # whose first two end the row's output, so that they ban.
    worded = []
    for r in range(streams):
        tail = rows[r][1].ordered
        words = tuple(
            tuple(tail[-(1 + k % 2) :]) + (k,) if k % 2 else tuple(range(k, k + 1 + k % 3)) for k in range(16)
        )
        worded.append(SamplingSpec(temperature=0, bad_words=words))
    bad_words_sample = best(lambda: sample(logits, worded, list(range(streams)), histories=histories))
    prompt = torch.randint(vocab, (prompt_len,), generator=gen).tolist()
    new = best(lambda: TokenHistory(prompt, []))
    print(
        f"cost: {streams} penalized rows x {vocab}: min {step[0]:.2f} ms, median {step[1]:.2f} ms per step", flush=True
    )
    print(f"cost: TokenHistory of a {prompt_len}-token prompt: min {new[0]:.3f} ms, median {new[1]:.3f} ms", flush=True)
    print(
        f"cost: greedy sample() of {streams} rows: plain min {plain_sample[0]:.2f} / median {plain_sample[1]:.2f} ms, "
        f"penalized min {penalized_sample[0]:.2f} / median {penalized_sample[1]:.2f} ms, "
        f"16 bad words a row min {bad_words_sample[0]:.2f} / median {bad_words_sample[1]:.2f} ms",
        flush=True,
    )
    return {
        "step_ms": step,
        "new_sequence_ms": new,
        "sample_ms": plain_sample,
        "penalized_sample_ms": penalized_sample,
        "bad_words_sample_ms": bad_words_sample,
    }


async def _round(stub, prompts: list[list[int]], new_tokens: int, penalized: bool) -> float:
    from chunkserve.client import build_request

    extra = PENALTIES if penalized else {}
    reqs = [build_request(p, temperature=0.0, max_tokens=new_tokens, ignore_eos=True, **extra) for p in prompts]

    async def one(req) -> int:
        return sum([len(msg.token_ids) async for msg in stub.Generate(req)])

    start = time.perf_counter()
    total = sum(await asyncio.gather(*(one(r) for r in reqs)))
    elapsed = time.perf_counter() - start
    if total != len(prompts) * new_tokens:
        raise RuntimeError(f"expected {len(prompts) * new_tokens} tokens, got {total}")
    return total / elapsed


def _spin() -> None:
    while True:
        pass


def throughput(streams: int, new_tokens: int, rounds: int, busy: int) -> dict:
    import grpc
    from tokenizers import Tokenizer

    from chunkserve.launch import bench_model, start_server
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    path = bench_model("default")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode((ROOT / "README.md").read_text()).ids
    prompts = [ids[i * 40 : i * 40 + 32] for i in range(streams)]
    server = start_server(
        Path(tempfile.mkdtemp()), ["--model", str(path), "--dtype", "float32"], ["--max-num-seqs", str(streams)]
    )

    async def run(condition: str) -> dict:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            await _round(stub, prompts, 8, True)  # warm-up
            plain, penalized = [], []
            for r in range(rounds):
                for kind in (False, True) if r % 2 == 0 else (True, False):
                    tps = await _round(stub, prompts, new_tokens, kind)
                    (penalized if kind else plain).append(tps)
                    name = "penalized" if kind else "plain    "
                    print(f"{condition} throughput {name}: {tps:7.1f} output tok/s", flush=True)
            p, q = statistics.median(plain), statistics.median(penalized)
            print(f"{condition} median: plain {p:.1f}, penalized {q:.1f} tok/s, ratio {q / p:.3f}x", flush=True)
            return {"plain": plain, "penalized": penalized, "ratio": q / p}

    figures = {}
    try:
        figures["idle"] = asyncio.run(run("idle"))
        if busy:
            spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
            for proc in spinners:
                proc.start()
            try:
                figures["busy"] = asyncio.run(run(f"busy({busy})"))
            finally:
                for proc in spinners:
                    proc.kill()
        return figures
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["cost", "throughput"], choices=["cost", "throughput"])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="then again with this many spinning processes")
    ap.add_argument("--prompt-len", type=int, default=2048, help="(a): the prompt of the one-off history")
    args = ap.parse_args()
    if "cost" in args.parts:
        cost(args.streams, args.prompt_len)
    if "throughput" in args.parts:
        throughput(args.streams, args.new_tokens, args.rounds, args.busy)


if __name__ == "__main__":
    main()
