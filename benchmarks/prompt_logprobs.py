"""What prompt logprobs cost: a 2K-token prompt's time to its one token with and without them.

    .venv/bin/python benchmarks/prompt_logprobs.py [--trials 4] [--prompt-len 2048]

A real two-process server (started here) on the default model, float32, the default token
budget; one request at a time, each a new prompt (no prefix-cache hit either way), max_tokens
1, alternating plain / `prompt_logprobs=1` (every prompt row then goes through the LM head,
128 rows at a time, and its log-softmax and top-1 come back). Median seconds per request of
each and the ratio, from this run. What it buys: lm-evaluation-harness style scoring (echo +
logprobs) of the whole prompt in that one request.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from chunkserve.client import Completion, build_request
    from chunkserve.launch import bench_model, start_server

    path = bench_model("default")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode((ROOT / "README.md").read_text()).ids
    while len(ids) < args.prompt_len * (2 * args.trials + 1):
        ids = ids + ids[::-1]
    prompts = [ids[i * args.prompt_len : (i + 1) * args.prompt_len] for i in range(2 * args.trials + 1)]
    server = start_server(Path(tempfile.mkdtemp()), ["--model", str(path), "--dtype", "float32"], [])
    try:
        stub = server.stub()

        def run(prompt: list[int], scored: bool) -> float:
            extra = {"prompt_logprobs": 1} if scored else {}
            done, start = Completion(), time.perf_counter()
            for msg in stub.Generate(build_request(prompt, temperature=0.0, max_tokens=1, **extra), timeout=600):
                done.add(msg)
            if scored and len(done.prompt_logprobs) != len(prompt) - 1:
                raise RuntimeError(f"{len(done.prompt_logprobs)} prompt logprobs for {len(prompt)} tokens")
            return time.perf_counter() - start

        run(prompts[-1], True)  # warm-up
        plain, scored = [], []
        for t in range(args.trials):
            for kind in (False, True) if t % 2 == 0 else (True, False):
                s = run(prompts[2 * t + kind], kind)
                (scored if kind else plain).append(s)
                print(f"{'prompt_logprobs' if kind else 'plain          '}: {s:.2f} s", flush=True)
        p, q = statistics.median(plain), statistics.median(scored)
        print(f"median: plain {p:.2f} s, with prompt logprobs {q:.2f} s, ratio {q / p:.2f}x", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
