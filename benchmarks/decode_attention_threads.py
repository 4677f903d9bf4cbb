"""The native decode attention of one sequence on one thread or on all (issue 18, item 1).

`torch.ops.chunkserve.paged_decode_attention` runs a step's (sequence, KV head) units on the
calling thread up to `serial_max_rows` key rows (sequences x KV heads x context), else over
torch's threads, and attends a context longer than `split_tokens` in pieces of that many tokens
(merged after). This times the default model's shape (30 layers, 9 query / 3 KV heads of 64,
blocks of 16) for one decoding sequence at each context length: the 30 layers' attention, each
layer's cache its own tensor, after a 128 MB read that evicts them (as a step's weight reads
do), in three settings taking turns, 10 rounds, medians: the first version (one thread up to
4096 rows, no pieces), threads from 256 rows without pieces, and the defaults (threads from 256
rows, pieces of 512 tokens); and checks the first two give the same result bitwise (threads
never change it) and the defaults agree within float32 rounding (the pieces sum in another
order).

    .venv/bin/python benchmarks/decode_attention_threads.py [--ctx 32 128 1024 4096] [--batch 1] [--threads 2]
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
    ap.add_argument("--ctx", type=int, nargs="+", default=[32, 128, 512, 1024, 2048, 4096])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together, each at the same context")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    why = cpu_native.load()
    if why is not None:
        raise SystemExit(f"the native CPU kernels did not build or load: {why}")
    op = torch.ops.chunkserve.paged_decode_attention
    evict = torch.ones(32 * 1024 * 1024)
    whole = 1 << 30  # no pieces
    settings = {"4096 rows, whole": (4096, whole), "256 rows, whole": (256, whole), "256 rows, pieces": (256, 512)}
    print(f"{args.threads} threads; ms for {LAYERS} layers' decode attention of {args.batch} sequence(s)")
    head = "".join(f"{k:>19}" for k in settings)
    print(f"{'context':>8}{'rows':>7}{head}{'2nd/1st':>9}{'3rd/1st':>9}  bitwise  max diff")
    gen = torch.Generator().manual_seed(0)
    for ctx in args.ctx:
        blocks, b = -(-ctx // BLOCK), args.batch
        caches = [torch.randn(2, 2 * b * blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
        table = torch.randperm(2 * b * blocks, generator=gen)[: b * blocks].to(torch.int32).view(b, blocks)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        q = torch.randn(b, Q_HEADS, HEAD_DIM, generator=gen)
        times: dict[str, list[float]] = {k: [] for k in settings}
        names = list(settings)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                evict.sum()
                t = time.perf_counter()
                for cache in caches:
                    op(q, cache, table, lens, HEAD_DIM**-0.5, *settings[name])
                times[name].append((time.perf_counter() - t) * 1000)
        outs = [[op(q, c, table, lens, 0.125, *settings[k]) for c in caches[:3]] for k in names]
        same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        diff = max((a - b).abs().max().item() for a, b in zip(outs[0], outs[2]))
        med = [statistics.median(times[k]) for k in names]
        cells = "".join(f"{m:19.3f}" for m in med)
        print(
            f"{ctx:8d}{b * ctx * KV_HEADS:7d}{cells}{med[1] / med[0]:9.2f}{med[2] / med[0]:9.2f}  {same!s:7}  {diff:.1e}"
        )


if __name__ == "__main__":
    main()
