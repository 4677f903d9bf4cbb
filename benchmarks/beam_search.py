"""What beam search costs: one request's whole answer with `use_beam_search` (n beams) against
the same request greedy, through the OpenAI API.

    .venv/bin/python benchmarks/beam_search.py [--trials 3] [--widths 2 4] [--max-tokens 32] [--prompt-len 256]

A real two-process server (started here, with its HTTP front) on the default model, float32,
default flags (prefix caching on); one request at a time, each with a new prompt (no cache hit
from an earlier trial), ignore_eos so every answer has max_tokens tokens; rounds alternate
greedy and each width. Prints per trial, then the median seconds of each and its ratio to
greedy from this run, and the prompt tokens the server computed per beam search (from the
Prometheus counters: prompt tokens of the step requests less their prefix-cache hits), which
says how much of each step's re-sent beams the cache served. Beam search is built from
one-token requests per beam per step (scheduler_svc/beam_search.py), so each of its steps is
a round trip through the scheduler with W short prefills, where a greedy token is one decode.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def counter(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()

    import httpx
    from tokenizers import Tokenizer

    from chunkserve.launch import bench_model, start_server

    path = bench_model("default")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode((ROOT / "README.md").read_text()).ids
    kinds = [1, *args.widths]  # 1: greedy
    need = args.prompt_len * (len(kinds) * args.trials + 1)
    while len(ids) < need:
        ids = ids + ids[::-1]
    prompts = iter(ids[i : i + args.prompt_len] for i in range(0, need, args.prompt_len))
    server = start_server(Path(tempfile.mkdtemp()), ["--model", str(path), "--dtype", "float32"], [])
    try:
        url = server.http_url + "/completions"

        def run(width: int) -> tuple[float, float]:
            body = {"prompt": next(prompts), "max_tokens": args.max_tokens, "ignore_eos": True}
            body |= {"temperature": 0} if width == 1 else {"use_beam_search": True, "n": width}
            before = counter(server.metrics_url, "chunkserve_prompt_tokens_total")
            hits = counter(server.metrics_url, "chunkserve_prefix_cache_hits_total")
            start = time.perf_counter()
            answer = httpx.post(url, json=body, timeout=1800)
            seconds = time.perf_counter() - start
            if answer.status_code != 200 or len(answer.json()["choices"]) != width:
                raise RuntimeError(answer.text)
            computed = counter(server.metrics_url, "chunkserve_prompt_tokens_total") - before
            computed -= counter(server.metrics_url, "chunkserve_prefix_cache_hits_total") - hits
            return seconds, computed

        run(2)  # warm-up
        times: dict[int, list[float]] = {k: [] for k in kinds}
        computed: dict[int, list[float]] = {k: [] for k in kinds}
        for t in range(args.trials):
            for width in kinds if t % 2 == 0 else kinds[::-1]:
                s, c = run(width)
                times[width].append(s)
                computed[width].append(c)
                name = "greedy" if width == 1 else f"beams={width}"
                print(f"{name:8s}: {s:.2f} s, {c:.0f} prompt tokens computed", flush=True)
        base = statistics.median(times[1])
        print(f"\n{args.prompt_len}-token prompts, {args.max_tokens} tokens, medians of {args.trials}")
        for width in kinds:
            name = "greedy" if width == 1 else f"beams={width}"
            m = statistics.median(times[width])
            print(f"{name:8s} {m:7.2f} s  {m / base:5.2f}x greedy  {statistics.median(computed[width]):7.0f} computed")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
