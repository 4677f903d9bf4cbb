"""Soak test: many requests, random cancellations, bad inputs and one executor kill.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--concurrency 32] [--model PATH]

Starts its own executor + scheduler on loopback (a tiny random-weight model with the default
model's tokenizer unless --model is given, so 1000 requests take minutes on 2 cores), sends
--requests requests from --concurrency workers: 20% are cancelled at a random point, 5% are
invalid, and once a third of them have been sent the executor is killed with SIGKILL and
started again (what `chunkserve serve` or compose does). At the end it reports requests
completed, failed by status code, streams that never ended (hung: a 120 s client deadline
expired), and KV blocks still held once the server is idle. Exit code 1 if hung or leaked
is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from chunkserve.client import build_request
from chunkserve.launch import bench_model, start_server
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

BAD = [
    lambda: pb.GenerateRequest(text=""),
    lambda: build_request([1, 2, 10**7]),
    lambda: build_request("hi", temperature=-1.0),
    lambda: build_request("hi", top_p=2.0),
    lambda: build_request("hi", max_tokens=10**7),
]


async def one(stub: pb_grpc.GenerationStub, rng: random.Random, outcome: collections.Counter) -> None:
    if rng.random() < 0.05:
        request, cancel_after = BAD[rng.randrange(len(BAD))](), None
    else:
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(1, 300))]
        request = build_request(
            prompt,
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1000),
            max_tokens=rng.randint(1, 64),
            ignore_eos=True,
        )
        cancel_after = rng.randint(0, 10) if rng.random() < 0.2 else None
    call = stub.Generate(request, timeout=120)
    try:
        n = 0
        async for msg in call:
            n += 1
            if cancel_after is not None and n > cancel_after:
                call.cancel()
                outcome["cancelled"] += 1
                return
            if msg.finished:
                outcome["completed"] += 1
        if cancel_after is not None:  # finished before the cancellation point
            pass
    except asyncio.CancelledError:
        outcome["cancelled"] += 1
    except grpc.RpcError as exc:
        code = exc.code()
        outcome["hung" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"failed:{code.name}"] += 1
        if code == grpc.StatusCode.UNAVAILABLE:
            await asyncio.sleep(1.0)  # back off like a well-behaved client while it restarts


async def soak(server, total: int, concurrency: int, seed: int, kill) -> collections.Counter:
    rng = random.Random(seed)
    outcome: collections.Counter = collections.Counter()
    sent = 0
    killed = False
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def worker() -> None:
            nonlocal sent, killed
            while sent < total:
                sent += 1
                if not killed and sent >= total // 3:
                    killed = True
                    kill()
                await one(stub, rng, outcome)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="model folder (default: tiny random model)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chunkserve-soak-"))
    model = args.model or str(bench_model("tiny"))
    server = start_server(
        work,
        ["--model", model, "--dtype", "float32", "--num-gpu-blocks-override", "256", "--block-size", "16"],
        ["--max-num-batched-tokens", "512"],
    )
    argv = server.executor.args

    def kill() -> None:
        os.kill(server.executor.pid, signal.SIGKILL)
        server.executor.wait()
        server.executor = subprocess.Popen(
            argv, stdout=open(work / "executor2.log", "w"), stderr=subprocess.STDOUT, env=server.executor_env
        )  # same token: the scheduler must accept it

    start = time.time()
    try:
        outcome = asyncio.run(soak(server, args.requests, args.concurrency, args.seed, kill))
        deadline = time.time() + 120  # the restarted executor may still be loading
        while True:
            try:
                info = server.info()
                if not info.num_requests_running and not info.num_requests_waiting:
                    break
            except grpc.RpcError:
                if time.time() > deadline:
                    raise
            if time.time() > deadline:
                break
            time.sleep(0.2)
        leaked = info.num_device_blocks - info.num_free_device_blocks
    finally:
        server.stop()
    print(f"{args.requests} requests in {time.time() - start:.0f} s, concurrency {args.concurrency}, one executor kill")
    for key in sorted(outcome):
        print(f"  {key:32s} {outcome[key]}")
    print(f"  {'hung streams':32s} {outcome.get('hung', 0)}")
    print(f"  {'leaked KV blocks':32s} {leaked}")
    sys.exit(1 if outcome.get("hung", 0) or leaked else 0)


if __name__ == "__main__":
    main()
