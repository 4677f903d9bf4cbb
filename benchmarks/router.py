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
the router adds per request. Then tokens/s of 32 concurrent streams, direct and through the
router. With --baseline-router-src (another checkout, e.g. `git worktree add /tmp/old <commit>`)
that checkout's router is measured beside this one in the same run, interleaved, so a change
to the router is judged by before/after ratios against the same direct baseline. With
--compare-transports a second router of this tree runs with `--replica-transport call` (one
Generate call per request to the replica) beside the default one (`mux`: one multiplexed stream
per replica, messages batched per step), measured the same way.

With --front http every request goes through the OpenAI API instead (/v1/completions, streamed,
the prompt as text: the byte tokenizer makes each character one token), so that a PyPI gateway
can be measured on the same arrivals: --vllm-router-policies runs `vllm-router` (the Rust
binary of the dev extra) in front of the same replicas with each policy named, its `kv_aware`
fed by the replicas' vLLM-format KV events (--kv-events-config). --replicas sets how many.

This machine is a 2-core CPU shared with other work and the model is tiny: the absolute times
are this machine's, the ratios are the result (benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/router.py                      # defaults as recorded
    .venv/bin/python benchmarks/router.py --requests 64 --rate 4 --skip-overhead
    .venv/bin/python benchmarks/router.py --policies "" --baseline-router-src /tmp/old   # overhead, before/after
    .venv/bin/python benchmarks/router.py --policies "" --compare-transports            # mux vs per-call legs
    .venv/bin/python benchmarks/router.py --front http --vllm-router-policies cache_aware,kv_aware --skip-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

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


async def one(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int, timeout: float = 600) -> Result:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    first = None
    cached = 0
    async for msg in stub.Generate(request, timeout=timeout):
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


def as_text(prompt: list[int]) -> str:
    """A token-id prompt as text the byte tokenizer turns into as many tokens: each id mapped
    onto a printable ASCII character (33-126), so a gateway that routes by text or tokenizes
    for itself sees the same prefixes."""
    return "".join(chr(33 + (t - 3) % 94) for t in prompt)


async def one_http(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    """One streamed /v1/completions request; TTFT at the first chunk carrying text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, usage = None, None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"{url}: HTTP {reply.status_code}: {(await reply.aread())[:500]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if usage is None:
        raise SystemExit(f"{url}: a stream without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Result(first if first is not None else float("nan"), usage["prompt_tokens"], cached)


async def run_policy_http(
    url: str, model: str, prompts: list[str], arrivals: list[float], max_tokens: int
) -> list[Result]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        start = time.perf_counter()

        async def at(i: int) -> Result:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            return await one_http(client, url, model, prompts[i], max_tokens)

        return await asyncio.gather(*(at(i) for i in range(len(prompts))))


def decision_reasons(metrics_port: int) -> str:
    """The router's decisions by reason and by replica (its /metrics), e.g. "cache 230, ttft 20;
    per replica 130 126"."""
    reasons: dict[str, float] = {}
    replicas: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines():
        if line.startswith("chunkserve_router_requests_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            n = float(line.rsplit(" ", 1)[1])
            reasons[reason] = reasons.get(reason, 0) + n
            replicas[replica] = replicas.get(replica, 0) + n
    by_reason = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return by_reason + "; per replica " + " ".join(f"{replicas[k]:.0f}" for k in sorted(replicas))


def kv_events_args() -> tuple[list[str], str, str]:
    """A replica's --kv-events-config (vLLM's ZMQ PUB) and its publisher and replay endpoints."""
    pub, replay = free_port(), free_port()
    kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return ["--kv-events-config", json.dumps(kv)], f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def vllm_router_binary() -> str:
    found = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
    if not found:
        raise SystemExit("--vllm-router-policies: no vllm-router executable (pip install vllm-router)")
    return found


def start_vllm_router(
    servers: list[Server], events: list[tuple[str, str]], policy: str, model_dir: Path, log_dir: Path
) -> tuple[subprocess.Popen, str]:
    """vllm-router in front of `servers`' HTTP APIs with `policy`; kv_aware reads `events`
    (each server's publisher and replay endpoints) and tokenizes with `model_dir`'s tokenizer."""
    port = free_port()
    workers = [f"http://127.0.0.1:{s.http_port}" for s in servers]
    cmd = [vllm_router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *workers]
    if policy == "kv_aware":
        for worker, (pub, replay) in zip(workers, events):
            cmd += ["--kv-event-source", f"{worker}={pub}", "--kv-event-replay-source", f"{worker}={replay}"]
        cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model_dir)]
    log = log_dir / f"vllm-router-{policy}-{port}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, log)
    return proc, url


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until GET url answers 200; exits with the process's log when it dies or never does."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"{url} did not answer:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def start_router(
    servers: list[Server],
    policy: str,
    log_dir: Path,
    src: str | None = None,
    transport: str | None = None,
    http_port: int = 0,
    tokenizer: Path | None = None,
) -> tuple[subprocess.Popen, int, int]:
    """`chunkserve router` in front of `servers`; `src`: run another checkout's router;
    `transport`: its --replica-transport (None: its default); `http_port`: its OpenAI API (0: off).
    `policy` may carry router options after a "+": "cache_aware+--balance-abs-threshold=8"."""
    policy, *options = policy.split("+")
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "chunkserve.cli", "router", "--port", str(port), "--admin-port", str(admin)]
    metrics = free_port()
    cmd += ["--http-port", str(http_port), "--metrics-port", str(metrics), "--policy", policy]
    cmd += ["--replica-transport", transport] if transport else []
    cmd += options
    cmd += ["--tokenizer", str(tokenizer)] if tokenizer else []  # text prompts hashed as the replicas do
    for s in servers:
        cmd += ["--replica", f"127.0.0.1:{s.port},admin={s.admin_port}" + (f",http={s.http_port}" if http_port else "")]
    env = {**os.environ, "PYTHONPATH": src} if src else None
    log_path = log_dir / f"router-{policy}-{port}.log"
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=src, env=env)
    proc.log_path = log_path  # type: ignore[attr-defined]
    stub = rpb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{admin}"))
    deadline = time.time() + 60
    while True:
        try:
            listed = stub.ListReplicas(rpb.ListReplicasRequest(), timeout=5).replicas
            if len(listed) == len(servers) and all(r.healthy for r in listed):
                proc.metrics_port = metrics  # type: ignore[attr-defined]
                return proc, port, admin
        except grpc.RpcError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"router did not start:\n{(log_dir / f'router-{policy}-{port}.log').read_text()[-3000:]}")
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


async def overhead(addresses: dict[str, str], n: int) -> dict[str, float]:
    """Median end-to-end latency of a 1-token request at each address, one request at a time,
    every round visiting all addresses in a rotating order."""
    prompt = list(range(3, 35))
    names = list(addresses)
    lat: dict[str, list[float]] = {name: [] for name in names}
    channels = {name: grpc.aio.insecure_channel(address) for name, address in addresses.items()}
    try:
        stubs = {name: pb_grpc.GenerationStub(channel) for name, channel in channels.items()}
        for i in range(n):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                await one(stubs[name], prompt, 1)
                lat[name].append(time.perf_counter() - start)
    finally:
        for channel in channels.values():
            await channel.close()
    return {name: statistics.median(values[5:]) for name, values in lat.items()}  # the first ones warm up


async def serve_null_proxy(port: int, target: str) -> None:
    """The floor of any Python gRPC proxy: Generate relayed as bytes to `target`, nothing else
    (no routing, no id rewrite, no bookkeeping). Run as a process by --null-proxy."""

    async def generate(data: bytes, context: grpc.aio.ServicerContext):
        call = relay(data, timeout=context.time_remaining())
        while (chunk := await call.read()) is not grpc.aio.EOF:
            yield chunk

    channel = grpc.aio.insecure_channel(target)
    relay = channel.unary_stream("/chunkserve.v1.Generation/Generate")
    handler = grpc.unary_stream_rpc_method_handler(generate)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("chunkserve.v1.Generation", {"Generate": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def start_null_proxy(server: Server) -> tuple[subprocess.Popen, int, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-null-proxy", str(port), server.address])

    async def reached() -> None:  # a call reaches the replica through it
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await one(pb_grpc.GenerationStub(channel), [3, 4], 1, timeout=5)

    deadline = time.time() + 30
    while True:
        try:
            asyncio.run(reached())
            return proc, port, 0
        except grpc.RpcError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise SystemExit("the null proxy did not start") from None
            time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(address: str, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` concurrent greedy requests of `tokens` tokens each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(one(stub, [3 + i % 90] * 32, tokens) for i in range(streams)))
        return streams * tokens / (time.perf_counter() - start)


def router_overhead(args: argparse.Namespace, server: Server, log_dir: Path) -> None:
    """One replica served directly, through this tree's router and, with --baseline-router-src,
    through the router of another checkout (the code before a change): latency of 1-token
    requests and tokens/s of --streams streams, all measured in this one run, interleaved,
    plus each router's CPU time per request and per streamed token."""
    routers: dict[str, tuple[subprocess.Popen, int, int]] = {}
    try:
        routers["router"] = start_router([server], "cache_aware", log_dir)
        if args.compare_transports:
            routers["call"] = start_router([server], "cache_aware", log_dir, transport="call")
        if args.baseline_router_src:
            routers["baseline"] = start_router([server], "cache_aware", log_dir, src=args.baseline_router_src)
        if args.null_proxy:
            routers["null"] = start_null_proxy(server)
        addresses = {"direct": server.address, **{name: f"127.0.0.1:{port}" for name, (_, port, _) in routers.items()}}
        before = {name: cpu_seconds(proc.pid) for name, (proc, _, _) in routers.items()}
        lat = asyncio.run(overhead(addresses, args.overhead_requests))
        per_request = {name: cpu_seconds(proc.pid) - before[name] for name, (proc, _, _) in routers.items()}
        names = list(addresses)
        rates: dict[str, list[float]] = {name: [] for name in names}
        streamed = dict.fromkeys(routers, 0.0)
        for k in range(args.throughput_rounds):  # every order in turn: A B C, C A B, ... (reversed on odd rounds)
            order = names[k % len(names) :] + names[: k % len(names)]
            for name in order if k % 2 == 0 else order[::-1]:
                pid = routers[name][0].pid if name in routers else None
                start = cpu_seconds(pid) if pid else 0.0
                rates[name].append(asyncio.run(throughput(addresses[name], args.streams, args.stream_tokens)))
                if pid:
                    streamed[name] += cpu_seconds(pid) - start
    finally:
        for proc, _, _ in routers.values():
            proc.terminate()
            proc.wait(15)
    tokens = args.throughput_rounds * args.streams * args.stream_tokens
    print(
        f"1-token requests one at a time, medians of {args.overhead_requests - 5}: direct {lat['direct'] * 1e3:.2f} ms"
    )
    for name in routers:
        print(
            f"  {name:>8}: {lat[name] * 1e3:.2f} ms, +{(lat[name] - lat['direct']) * 1e3:.2f} ms over direct; router CPU "
            f"{per_request[name] / args.overhead_requests * 1e3:.2f} ms per request"
        )
    direct = statistics.median(rates["direct"])
    print(
        f"{args.streams} streams x {args.stream_tokens} tokens, median of {args.throughput_rounds}: "
        f"direct {direct:.0f} tok/s"
    )
    for name in routers:
        rate = statistics.median(rates[name])
        print(
            f"  {name:>8}: {rate:.0f} tok/s, {rate / direct:.3f}x of direct; router CPU "
            f"{streamed[name] / tokens * 1e6:.0f} us per streamed token"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per replica (16 tokens each)")
    p.add_argument(
        "--policies",
        default="cache_aware,round_robin,least_loaded",
        help="chunkserve router's; options after a '+', e.g. cache_aware+--balance-abs-threshold=8",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--front", choices=("grpc", "http"), default="grpc", help="the API the load goes through (http: streamed text)"
    )
    p.add_argument(
        "--vllm-router-policies",
        default="",
        help="vllm-router policies to measure on the same arrivals, e.g. cache_aware,kv_aware,round_robin (--front http)",
    )
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the throughput comparison")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--throughput-rounds", type=int, default=4, help="rounds of the tokens/s comparison")
    p.add_argument(
        "--baseline-router-src",
        help="a checkout of the code before a change (git worktree add /tmp/old <commit>): its router is measured "
        "beside this tree's in the overhead part, in the same run",
    )
    p.add_argument(
        "--null-proxy",
        action="store_true",
        help="also measure a proxy that only relays Generate's bytes (the floor of a Python gRPC proxy)",
    )
    p.add_argument(
        "--compare-transports",
        action="store_true",
        help="also measure this tree's router with --replica-transport call (`router` is the default, mux)",
    )
    p.add_argument("--serve-null-proxy", nargs=2, metavar=("PORT", "TARGET"), help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.serve_null_proxy:
        import uvloop

        uvloop.run(serve_null_proxy(int(args.serve_null_proxy[0]), args.serve_null_proxy[1]))
        return

    model = bench_model("tiny-bytes")  # no default model needed: byte tokens (as text with --front http)
    log_dir = Path(tempfile.mkdtemp(prefix="router-bench-"))
    executor = ["--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK), "--num-threads", "1"]
    executor += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    gateway = [p for p in args.vllm_router_policies.split(",") if p]
    if gateway and args.front != "http":
        raise SystemExit("--vllm-router-policies needs --front http (vllm-router serves the OpenAI API)")
    servers, events = [], []
    for _ in range(args.replicas):
        kv, pub, replay = kv_events_args() if "kv_aware" in gateway else ([], "", "")
        servers.append(start_server(log_dir, executor, kv))
        events.append((pub, replay))
    prompts, arrivals, prefix_tokens = workload(args)
    print(
        f"{args.requests} requests over {args.groups} groups at {args.rate}/s, Poisson; {args.replicas} replicas of "
        f"{args.kv_blocks} KV blocks ({args.kv_blocks * BLOCK} tokens) each; the {args.groups} prefixes total "
        f"{prefix_tokens} tokens; through the {'OpenAI HTTP' if args.front == 'http' else 'gRPC'} API"
    )
    runs = [("chunkserve", p) for p in args.policies.split(",") if p]  # "" = the overhead part only
    runs += [("vllm-router", p) for p in gateway]
    rows = {}
    try:
        for router, policy in runs:
            reset_caches(servers)
            name = policy if router == "chunkserve" else f"vllm-router:{policy}"
            rows[name] = s = summary(
                run_one_policy(args, router, policy, servers, events, model, log_dir, prompts, arrivals)
            )
            print(
                f"{name:>22}: prefill tokens {s['prefill']:>8}, hit rate {s['hit']:.2f}, "
                f"TTFT P50 {s['p50'] * 1e3:7.0f} ms, P99 {s['p99'] * 1e3:7.0f} ms"
            )
        print_ratios(rows)
        if not args.skip_overhead:
            reset_caches(servers)
            router_overhead(args, servers[0], log_dir)
    finally:
        for s in servers:
            s.stop()


def print_ratios(rows: dict[str, dict[str, float]]) -> None:
    """Each run's prefill and TTFT against round-robin's (chunkserve's), when it ran."""
    if "round_robin" not in rows:
        return
    rr = rows["round_robin"]
    for name, s in rows.items():
        print(
            f"{name:>22} / round_robin: prefill {s['prefill'] / rr['prefill']:.2f}x, "
            f"P99 TTFT {s['p99'] / rr['p99']:.2f}x, P50 TTFT {s['p50'] / rr['p50']:.2f}x"
        )


def run_one_policy(
    args: argparse.Namespace,
    router: str,
    policy: str,
    servers: list[Server],
    events: list[tuple[str, str]],
    model: Path,
    log_dir: Path,
    prompts: list[list[int]],
    arrivals: list[float],
) -> list[Result]:
    """The workload through one router (`chunkserve` or `vllm-router`) running `policy`, started
    for this run and stopped after it."""
    if router == "vllm-router":
        proc, url = start_vllm_router(servers, events, policy, model, log_dir)
    else:
        http_port = free_port() if args.front == "http" else 0
        proc, port, _ = start_router(servers, policy, log_dir, http_port=http_port, tokenizer=model)
        url = f"http://127.0.0.1:{http_port}"
        if args.front == "http":
            wait_http(url + "/v1/models", proc, proc.log_path)  # type: ignore[attr-defined]
    try:
        if args.front == "grpc":
            results = asyncio.run(run_policy(f"127.0.0.1:{port}", prompts, arrivals, args.max_tokens))
        else:
            served = httpx.get(f"http://127.0.0.1:{servers[0].http_port}/v1/models", timeout=10).json()["data"][0]["id"]
            texts = [as_text(p) for p in prompts]
            results = asyncio.run(run_policy_http(url, served, texts, arrivals, args.max_tokens))
        if router == "chunkserve":
            print(f"{'':>24}decisions: {decision_reasons(proc.metrics_port)}")  # type: ignore[attr-defined]
        slowest = sorted(range(len(results)), key=lambda i: -results[i].ttft)[:4]
        print(
            f"{'':>24}slowest (ms, at s, cached/prompt tokens): "
            + "; ".join(
                f"{results[i].ttft * 1e3:.0f} at {arrivals[i]:.1f} {results[i].cached_tokens}/{results[i].prompt_tokens}"
                for i in slowest
            )
        )
        return results
    finally:
        proc.terminate()
        proc.wait(15)


if __name__ == "__main__":
    main()
