"""Speculative decoding end to end (issue 34): batch-1 output tok/s with and without drafts on
input-grounded requests and random prompts, and 32 streams of random prompts, through real
servers.

Two servers on the default model are started with the same flags, one plain and one with
`--speculative-config` (one at a time serves; the other is idle). Every request goes to both,
alternately (plain, spec, then spec, plain the next round), greedy, `--max-tokens` tokens:

- per workload, the decode rate of each (tokens after the first / time from the first token to
  the last: prefill is the same work on both), the ratio spec / plain, and the draft tokens
  and accepted drafts of the spec server over that workload (its /metrics counters), as the
  acceptance rate (accepted / drafted) and the mean tokens per verify entry (1 + accepted /
  drafts);
- every request's token ids on both servers, and whether they are equal (the contract: greedy
  output does not depend on speculation);
- `--streams` concurrent streams of random prompts: the summed decode rate, spec / plain.

The workloads are benchmarks/spec_proposers.py's prompts (the model writes its own output):
edit a README excerpt (rename a word, reply with the whole document), edit a code file,
summarise a document, eight tool-calling chats, and random token ids (nothing to look up).

    .venv/bin/python benchmarks/spec_decode.py [--quantization int4] [--spec '{"method": "suffix"}']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SPEC_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for name in SPEC_NAMES:
        m = re.search(rf"^chunkserve_spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def generate(address: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(token ids, decode tok/s after the first token) of one greedy request."""
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tokens, first, last = [], None, None
        async for msg in stub.Generate(build_request(prompt, temperature=0.0, max_tokens=max_tokens)):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += list(msg.token_ids)
        rate = (len(tokens) - 1) / (last - first) if first and last and last > first else float("nan")
        return tokens, rate


async def streams_rate(address: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Summed decode tok/s of concurrent greedy streams (ignore_eos: every stream runs max_tokens)."""
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> float:
            n, first, last = 0, None, None
            req = build_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for msg in stub.Generate(req):
                if msg.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(msg.token_ids)
            return (n - 1) / (last - first)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def compare_workload(name: str, prompts: list[list[int]], servers: dict, args: argparse.Namespace) -> None:
    """One workload on both servers, alternating over the rounds; prints its table row, and the
    first differing tokens if the outputs differ."""
    spec = servers["spec"]
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    outputs: dict[str, list[list[int]]] = {"plain": [], "spec": []}
    before = spec_counters(spec.metrics_url)
    for rnd in range(args.rounds):
        order = ("plain", "spec") if rnd % 2 == 0 else ("spec", "plain")
        for prompt in prompts:
            for which in order:
                tokens, rate = asyncio.run(generate(servers[which].address, prompt, args.max_tokens))
                rates[which].append(rate)
                if rnd == 0:
                    outputs[which].append(tokens)
    after = spec_counters(spec.metrics_url)
    d = {k: after[k] - before[k] for k in SPEC_NAMES}
    p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
    accept = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    per_verify = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 1.0
    equal = outputs["plain"] == outputs["spec"]
    print(
        f"{name:<26} {p:>11.1f} {s:>10.1f} {s / p:>6.2f} {accept:>7.2f} {per_verify:>10.2f} {str(equal):>6}", flush=True
    )
    if not equal:
        for a, b in zip(outputs["plain"], outputs["spec"]):
            if a != b:
                i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  first difference at token {i}: plain {a[i : i + 5]} spec {b[i : i + 5]}", flush=True)
                break


def main() -> None:
    from spec_proposers import load_tokenizer, workloads

    from chunkserve.launch import start_server
    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--spec",
        default='{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    )
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--doc-tokens", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--workloads", nargs="*", default=None, help="names (prefixes) of the workloads to run")
    args = ap.parse_args()

    model = resolve_model("default", Path(default_cache_dir()))
    tok = load_tokenizer(str(model))
    work = {
        name: [prompt for prompt, _ in reqs]
        for name, reqs in workloads(tok, args.doc_tokens).items()
        if args.workloads is None or any(name.startswith(w) for w in args.workloads)
    }
    executor = ["--model", str(model), "--quantization", args.quantization]
    tmp = Path(tempfile.mkdtemp())
    plain = start_server(tmp, executor, ["--max-num-seqs", "64"])
    spec = start_server(tmp, executor, ["--max-num-seqs", "64", "--speculative-config", args.spec])
    servers = {"plain": plain, "spec": spec}
    print(f"model {model.name}, quantization {args.quantization}, spec {args.spec}", flush=True)
    try:
        for s in servers.values():  # warm-up: one short request each
            asyncio.run(generate(s.address, tok.encode("Hello"), 8))
        print(
            f"{'workload':<26} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accept':>7} "
            f"{'tok/verify':>10} {'equal':>6}",
            flush=True,
        )
        for name, prompts in work.items():
            compare_workload(name, prompts, servers, args)
        rng = random.Random(1)
        prompts = [[rng.randrange(tok.vocab_size) for _ in range(64)] for _ in range(args.streams)]
        r = {}
        for which in ("plain", "spec", "spec", "plain"):
            r.setdefault(which, []).append(
                asyncio.run(streams_rate(servers[which].address, prompts, args.stream_tokens))
            )
        p, s = statistics.mean(r["plain"]), statistics.mean(r["spec"])
        print(f"{args.streams} streams, random prompts: plain {p:.1f} tok/s, spec {s:.1f} tok/s, ratio {s / p:.2f}")
        print("spec server /metrics:", json.dumps(spec_counters(spec.metrics_url)))
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
