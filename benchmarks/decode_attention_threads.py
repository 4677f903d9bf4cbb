"""The native decode attention of one sequence on one thread or on all (issue 18, item 1).

`torch.ops.chunkserve.paged_decode_attention` runs a step's (sequence, KV head) units on the
calling thread up to `serial_max_rows` key rows (sequences x KV heads x context), else over
torch's threads. This times the default model's shape (30 layers, 9 query / 3 KV heads of 64,
blocks of 16) for one decoding sequence at each context length: the 30 layers' attention, each
layer's cache its own tensor, after a 128 MB read that evicts them (as a step's weight reads
do), with the old threshold (4096, the aten path's) and the new default (256) taking turns, 10
rounds, medians; and checks both give the same result bitwise.

    .venv/bin/python benchmarks/decode_attention_threads.py [--ctx 32 128 1024 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from chunkserve_kernels import cpu_native

LAYERS, BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 16, 3, 9, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    why = cpu_native.load()
    if why is not None:
        raise SystemExit(f"the native CPU kernels did not build or load: {why}")
    op = torch.ops.chunkserve.paged_decode_attention
    evict = torch.ones(32 * 1024 * 1024)
    settings = {"serial <= 4096 rows": 4096, "serial <= 256 rows": 256}
    print(f"{args.threads} threads; ms for {LAYERS} layers' decode attention of one sequence")
    print(f"{'context':>8}{'rows':>7}" + "".join(f"{k:>22}" for k in settings) + f"{'ratio':>8}  bitwise")
    gen = torch.Generator().manual_seed(0)
    for ctx in args.ctx:
        blocks = -(-ctx // BLOCK)
        caches = [torch.randn(2, 4 * blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        table = torch.randperm(4 * blocks, generator=gen)[:blocks].to(torch.int32)[None]
        lens = torch.tensor([ctx], dtype=torch.int32)
        q = torch.randn(1, Q_HEADS, HEAD_DIM, generator=gen)
        times: dict[str, list[float]] = {k: [] for k in settings}
        names = list(settings)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                evict.sum()
                t = time.perf_counter()
                for cache in caches:
                    op(q, cache, table, lens, HEAD_DIM**-0.5, settings[name])
                times[name].append((time.perf_counter() - t) * 1000)
        same = all(
            torch.equal(op(q, c, table, lens, 0.125, 4096), op(q, c, table, lens, 0.125, 256)) for c in caches[:3]
        )
        med = [statistics.median(times[k]) for k in names]
        print(f"{ctx:8d}{ctx * KV_HEADS:7d}" + "".join(f"{m:22.3f}" for m in med) + f"{med[1] / med[0]:8.2f}  {same}")


if __name__ == "__main__":
    main()
