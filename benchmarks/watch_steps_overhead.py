"""What Admin.WatchSteps subscribers cost the step loop.

Starts a server on the given model, then generates 4 x 200 tokens (--tokens; greedy, ignore_eos)
with 0, 1 and 4 subscribers streaming the step trace, in the order 0 1 4 4 1 0 so drift
falls on all alike, and prints milliseconds per step (every step carries the 4 decodes)
and how many traces the subscribers received. The subscribers run in this process, on the
same cores as the server, as a dashboard on the same host would.

    .venv/bin/python benchmarks/watch_steps_overhead.py --model tiny      # shows the overhead best
    .venv/bin/python benchmarks/watch_steps_overhead.py --model default   # what it means for a real model

`tiny` is the 2-layer random-weight Llama the tests use (hidden size 64), written to a temp
folder with the default model's tokenizer (chunkserve.launch.bench_model): its steps take
milliseconds, so a per-step cost of the trace is visible rather than lost in the noise of a
real model's step.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import grpc

from chunkserve.client import build_request
from chunkserve.launch import bench_model, start_server
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

STREAMS = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), default, or a model folder")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream in each run")
    args = p.parse_args()
    model = str(bench_model(args.model))  # tiny: a temp folder, removed at exit
    server = start_server(Path(tempfile.mkdtemp()), ["--model", model, "--dtype", "float32"], [])
    try:
        stub = server.stub()

        def generate() -> float:
            """ms per step of STREAMS concurrent greedy streams."""
            t = time.perf_counter()
            calls = [
                stub.Generate(build_request([5 + i, 6, 7], temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
                for i in range(STREAMS)
            ]
            n = sum(len(r.token_ids) for c in calls for r in c)
            return (time.perf_counter() - t) * 1000 / (n / STREAMS)

        def watch(stop: threading.Event, received: list[int]) -> None:
            stream = pb_grpc.AdminStub(grpc.insecure_channel(server.admin_address)).WatchSteps(pb.WatchStepsRequest())
            try:
                for _ in stream:
                    received[0] += 1
                    if stop.is_set():
                        break
            except grpc.RpcError:
                pass
            stream.cancel()

        generate()  # warm-up
        for subscribers in (0, 1, 4, 4, 1, 0):
            stop, received = threading.Event(), [0]
            threads = [threading.Thread(target=watch, args=(stop, received), daemon=True) for _ in range(subscribers)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # subscribed before the first step
            ms = generate()
            stop.set()
            print(f"{subscribers} subscribers: {ms:.2f} ms/step, {received[0]} traces received", flush=True)
            time.sleep(0.5)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
