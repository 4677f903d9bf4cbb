"""Cache-aware routing against round-robin and least-loaded, and what the router adds.

Two replicas of the tiny random-weight model (chunkserve.launch.write_tiny_model: a real
server whose steps take milliseconds), each with a KV pool too small for every shared prefix
(--num-gpu-blocks-override), behind `chunkserve router` (a process, as deployed). Workload:
`--groups` groups of users, each group a shared prefix of 1-2K tokens (token ids, seeded) and
each request that prefix plus its own suffix, arriving as a Poisson process; every policy gets
the same arrivals, and every replica's prefix cache is reset before each policy's run. Reported
per policy: prefill tokens computed (prompt tokens less the cached ones, from each request's
usage), the cache hit rate, and P50/P99 time to first token (client side); then ratios against
round-robin.

Router overhead: one replica served directly and through the router, short requests (one
output token) one at a time, alternating direct/router; the median latency difference is what
the router adds per request.

This machine is a 2-core CPU shared with other work and the model is tiny: the absolute times
are this machine's, the ratios are the result (benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/router.py                      # defaults as recorded
    .venv/bin/python benchmarks/router.py --requests 64 --rate 4 --skip-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from chunkserve.launch import Server, bench_model, free_port, start_server
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from chunkserve_contracts.v1 import replica_pb2 as rpb
from chunkserve_contracts.v1 import replica_pb2_grpc as rpb_grpc

BLOCK = 16


@dataclass
class Result:
    ttft: float
    prompt_tokens: int
    cached_tokens: int


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[float], int]:
    """The prompts (group prefix + own suffix), their arrival times, and the tokens of all the
    prefixes together; seeded."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 120) for _ in range(rng.randint(1024, 2048))] for _ in range(args.groups)]
    prompts, arrivals, t = [], [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        suffix = [rng.randrange(3, 120) for _ in range(args.suffix_len)]
        prompts.append(prefixes[rng.randrange(args.groups)] + suffix)
        arrivals.append(t)
    return prompts, arrivals, sum(map(len, prefixes))


async def one(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> Result:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    first = None
    cached = 0
    async for msg in stub.Generate(request, timeout=600):
        if first is None and msg.token_ids:
            first = time.perf_counter() - start
        if msg.finished:
            cached = msg.usage.cached_tokens
    return Result(first if first is not None else float("nan"), len(prompt), cached)


async def run_policy(address: str, prompts: list[list[int]], arrivals: list[float], max_tokens: int) -> list[Result]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def at(i: int) -> Result:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            return await one(stub, prompts[i], max_tokens)

        return await asyncio.gather(*(at(i) for i in range(len(prompts))))


def start_router(servers: list[Server], policy: str, log_dir: Path) -> tuple[subprocess.Popen, int, int]:
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "chunkserve.cli", "router", "--port", str(port), "--admin-port", str(admin)]
    cmd += ["--http-port", "0", "--metrics-port", "0", "--policy", policy]
    for s in servers:
        cmd += ["--replica", f"127.0.0.1:{s.port},admin={s.admin_port}"]
    proc = subprocess.Popen(cmd, stdout=open(log_dir / f"router-{policy}.log", "w"), stderr=subprocess.STDOUT)
    stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
    deadline = time.time() + 60
    while True:
        try:
            listed = stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas
            if len(listed) == len(servers) and all(r.healthy for r in listed):
                return proc, port, admin
        except grpc.RpcError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"router did not start:\n{(log_dir / f'router-{policy}.log').read_text()[-3000:]}")
        time.sleep(0.2)


def reset_caches(servers: list[Server]) -> None:
    for s in servers:
        s.assert_idle_and_no_leaks(timeout=120)
        admin = pb_grpc.AdminStub(grpc.insecure_channel(s.admin_address))
        admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=10)


def summary(results: list[Result]) -> dict[str, float]:
    ttfts = sorted(r.ttft for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {
        "prefill": prompt - cached,
        "hit": cached / prompt,
        "p50": statistics.median(ttfts),
        "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


async def overhead(direct: str, routed: str, n: int) -> tuple[float, float]:
    """Median end-to-end latency of a 1-token request, direct and through the router, alternating."""
    prompt = list(range(3, 35))
    lat: dict[str, list[float]] = {direct: [], routed: []}
    async with grpc.aio.insecure_channel(direct) as a, grpc.aio.insecure_channel(routed) as b:
        stubs = {direct: pb_grpc.GenerationStub(a), routed: pb_grpc.GenerationStub(b)}
        for i in range(n):
            for address in (direct, routed) if i % 2 == 0 else (routed, direct):
                start = time.perf_counter()
                await one(stubs[address], prompt, 1)
                lat[address].append(time.perf_counter() - start)
    return statistics.median(lat[direct][5:]), statistics.median(lat[routed][5:])  # first ones warm up


async def throughput(address: str, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` concurrent greedy requests of `tokens` tokens each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(one(stub, [3 + i % 90] * 32, tokens) for i in range(streams)))
        return streams * tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--policies", default="cache_aware,round_robin,least_loaded")
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the throughput comparison")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model = bench_model("tiny-bytes")  # no default model needed; prompts are token ids
    log_dir = Path(tempfile.mkdtemp(prefix="router-bench-"))
    executor = ["--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK), "--num-threads", "1"]
    executor += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    servers = [start_server(log_dir, executor, []) for _ in range(2)]
    prompts, arrivals, prefix_tokens = workload(args)
    print(
        f"{args.requests} requests over {args.groups} groups at {args.rate}/s, Poisson; {args.kv_blocks} KV blocks "
        f"({args.kv_blocks * BLOCK} tokens) per replica; the {args.groups} prefixes total {prefix_tokens} tokens"
    )
    rows = {}
    try:
        for policy in [p for p in args.policies.split(",") if p]:  # "" = the overhead part only
            reset_caches(servers)
            proc, port, _ = start_router(servers, policy, log_dir)
            try:
                results = asyncio.run(run_policy(f"127.0.0.1:{port}", prompts, arrivals, args.max_tokens))
            finally:
                proc.terminate()
                proc.wait(15)
            rows[policy] = s = summary(results)
            print(
                f"{policy:>13}: prefill tokens {s['prefill']:>8}, hit rate {s['hit']:.2f}, "
                f"TTFT P50 {s['p50'] * 1e3:7.0f} ms, P99 {s['p99'] * 1e3:7.0f} ms"
            )
        if "round_robin" in rows:
            rr = rows["round_robin"]
            for policy, s in rows.items():
                print(
                    f"{policy:>13} / round_robin: prefill {s['prefill'] / rr['prefill']:.2f}x, "
                    f"P99 TTFT {s['p99'] / rr['p99']:.2f}x, P50 TTFT {s['p50'] / rr['p50']:.2f}x"
                )
        if not args.skip_overhead:
            reset_caches(servers)
            proc, port, _ = start_router(servers[:1], "cache_aware", log_dir)
            try:
                d, r = asyncio.run(overhead(servers[0].address, f"127.0.0.1:{port}", args.overhead_requests))
                rates: dict[str, list[float]] = {"direct": [], "router": []}
                for k in range(4):  # ABBA
                    for name in ("direct", "router") if k % 2 == 0 else ("router", "direct"):
                        address = servers[0].address if name == "direct" else f"127.0.0.1:{port}"
                        rates[name].append(asyncio.run(throughput(address, args.streams, args.stream_tokens)))
            finally:
                proc.terminate()
                proc.wait(15)
            print(
                f"router overhead, 1-token requests one at a time: direct {d * 1e3:.2f} ms, through the router "
                f"{r * 1e3:.2f} ms median, +{(r - d) * 1e3:.2f} ms"
            )
            td, tr = statistics.median(rates["direct"]), statistics.median(rates["router"])
            print(
                f"{args.streams} streams x {args.stream_tokens} tokens: direct {td:.0f} tok/s, through the router "
                f"{tr:.0f} tok/s (median of 4, ABBA): {tr / td:.3f}x"
            )
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
