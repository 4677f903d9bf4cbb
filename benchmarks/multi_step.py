"""Multi-step decoding (--num-scheduler-steps): what it gains at batch 1 and at 32 streams, and
what it costs a request that arrives while a stream decodes, against the same server without it.

Why: a plan of k decode steps pays the scheduler and the gRPC hop once for k tokens (on a
2-core CPU ~1.9 ms of CPU a token at batch 1, on the cores the step's threads use), but a
request that arrives during the k steps waits for them. Both sides are measured here, in
turns, on servers that differ only in the flag (float32 default model, default flags
otherwise), each round every server once, the first one moving each round:

- batch 1: decode tok/s of one greedy request of `--max-tokens` (after its first token);
- `--streams` concurrent greedy requests (ignore_eos): their summed decode tok/s;
- arrivals: while one stream decodes, `--arrivals` short requests (32-token prompts, one
  token each) are sent one after another, each after a random pause of 0-50 ms (the same
  pauses for every server): the median and worst time to their token.

and prints the medians over rounds, each server's as a ratio to the first one's, and how many
tokens a message of the batch-1 stream carried (1 where each step's tokens stream as it ends,
`--multi-step-stream-outputs`, the default; about k with a `b` after k, e.g. `8b`, a server
with `--no-multi-step-stream-outputs`, whose plans answer once).

    .venv/bin/python benchmarks/multi_step.py [--steps 1 4 8 8b] [--rounds 3] [--streams 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_decode import generate, streams_rate  # noqa: E402

PROMPT = [(i * 53) % 30000 + 200 for i in range(128)]


async def arrival_waits(address: str, arrivals: int, seed: int) -> list[float]:
    """Seconds from sending each short request to its token, while one stream decodes."""
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = asyncio.Event()

        async def background() -> None:
            async for msg in stub.Generate(build_request(PROMPT, temperature=0.0, max_tokens=4000, ignore_eos=True)):
                if msg.token_ids:
                    started.set()

        bg = asyncio.ensure_future(background())
        await started.wait()
        waits = []
        for i in range(arrivals):
            await asyncio.sleep(rng.uniform(0, 0.05))
            prompt = [(i * 977 + j * 31) % 30000 + 300 for j in range(32)]  # no prefix shared with another
            t = time.perf_counter()
            async for msg in stub.Generate(build_request(prompt, temperature=0.0, max_tokens=1)):
                if msg.token_ids:
                    waits.append(time.perf_counter() - t)
        bg.cancel()
        try:
            await bg
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        return waits


async def batch1(address: str, max_tokens: int) -> tuple[float, float]:
    """(decode tok/s after the first token, tokens a message) of one greedy request."""
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        sizes, first, last = [], None, None
        async for msg in pb_grpc.GenerationStub(channel).Generate(
            build_request(PROMPT, temperature=0.0, max_tokens=max_tokens)
        ):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                sizes.append(len(msg.token_ids))
        return (sum(sizes) - 1) / (last - first), (sum(sizes) - 1) / max(1, len(sizes) - 1)


def server_flags(steps: str) -> list[str]:
    """--steps value (k, or k then `b`: the plan's tokens in one answer) -> scheduler flags."""
    k = int(steps.removesuffix("b"))
    if k < 1:
        raise SystemExit(f"--steps: {steps!r} is not a step count")
    return ["--num-scheduler-steps", str(k)] + (["--no-multi-step-stream-outputs"] if steps.endswith("b") else [])


def main() -> None:
    from chunkserve.launch import start_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", nargs="+", default=["1", "4", "8"], help="--num-scheduler-steps per server (kb: without streaming)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens of the batch-1 request")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens of each of the --streams requests")
    ap.add_argument("--arrivals", type=int, default=12)
    args = ap.parse_args()
    flags = [server_flags(k) for k in args.steps]

    servers = []
    try:
        for server_args in flags:
            servers.append(
                start_server(Path(tempfile.mkdtemp()), ["--model", "default", "--dtype", "float32"], server_args)
            )
            asyncio.run(generate(servers[-1].address, PROMPT, 8))  # warm both processes
        rows = {k: [] for k in args.steps}
        prompts = [[(s * 131 + j * 7) % 30000 + 100 for j in range(64)] for s in range(args.streams)]
        for rnd in range(args.rounds):
            order = list(range(len(servers)))
            for i in order[rnd % len(order) :] + order[: rnd % len(order)]:
                k, address = args.steps[i], servers[i].address
                one, per_message = asyncio.run(batch1(address, args.max_tokens))
                many = asyncio.run(streams_rate(address, prompts, args.stream_tokens))
                waits = asyncio.run(arrival_waits(address, args.arrivals, seed=rnd))
                rows[k].append((one, many, statistics.median(waits), max(waits), per_message))
                print(
                    f"round {rnd + 1} steps {k}: batch 1 {one:.1f} tok/s ({per_message:.1f} tokens a message), "
                    f"{args.streams} streams {many:.0f} tok/s, "
                    f"arrivals' token after {1000 * statistics.median(waits):.0f} ms median, "
                    f"{1000 * max(waits):.0f} ms worst",
                    flush=True,
                )
        for server in servers:  # cancelled streams and finished ones alike left nothing behind
            server.assert_idle_and_no_leaks()
    finally:
        for server in servers:
            server.stop()
    base = [statistics.median(r[i] for r in rows[args.steps[0]]) for i in range(4)]
    print(f"\nfloat32 default model, medians of {args.rounds} rounds; ratios to --num-scheduler-steps {args.steps[0]}")
    print(
        f"{'steps':>5} {'batch-1 tok/s':>20} {f'{args.streams} streams tok/s':>22} {'arrival median ms':>22} "
        f"{'worst ms':>18} {'tokens/message':>15}"
    )
    for k in args.steps:
        m = [statistics.median(r[i] for r in rows[k]) for i in range(5)]
        print(
            f"{k:>5} {m[0]:>11.1f} ({m[0] / base[0]:.2f}x) {m[1]:>13.0f} ({m[1] / base[1]:.2f}x) "
            f"{1000 * m[2]:>13.0f} ({m[2] / base[2]:.2f}x) {1000 * m[3]:>9.0f} ({m[3] / base[3]:.2f}x) {m[4]:>15.1f}"
        )


if __name__ == "__main__":
    main()
