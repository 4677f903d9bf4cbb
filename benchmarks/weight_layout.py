"""How the layout of the weights in memory changes a decode step's products (issue 31, item 7).

The default model's 121 linears (30 layers x qkv, o, gate_up, down, plus the 49152 x 576 head;
random float32 weights of the same shapes) applied once to M rows, in one process, the three
layouts taking turns (A B C, then C B A, ...), medians, ms:

- `4k`: each weight its own tensor in 4 KiB pages (advised MADV_NOHUGEPAGE: what the executor
  had before executor_svc/memory.py, on a kernel whose THP mode is "madvise" or "never");
- `huge`: each weight its own tensor, advised into 2 MiB pages (memory.empty); a weight under
  2 MiB stays in small pages (the default model's o_proj, 1.3 MB);
- `buffer`: every weight in one buffer in huge pages, in the order a step reads them
  (models/weights.one_buffer: what the executor loads now).

Each product is the kernel the executor's plan gives M rows on this machine class: the native
few-row product (`torch.ops.chunkserve.gemv`) up to 4 rows, else `F.linear`. The read
bandwidth (a sum over 1 GiB in huge pages, best of 3) is measured before and after, and each
layout's time is also given as a multiple of the floor (538 MB / bandwidth).

    .venv/bin/python benchmarks/weight_layout.py [--rows 1 32] [--rounds 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from chunkserve_kernels import cpu_native
from executor_svc import memory

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M


def shapes(layers: int = LAYERS) -> list[tuple[int, int]]:
    per_layer = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return per_layer * layers + [(VOCAB, HIDDEN)]


def small_pages(shape: tuple[int, int]) -> torch.Tensor:
    """A weight in 4 KiB pages whatever the kernel's THP mode (advised before it is written)."""
    t = memory.empty(shape, torch.float32)  # page-aligned where it is large enough to matter
    if t.data_ptr() % 4096 == 0:
        memory.advise_huge_pages(t, huge=False)
    return t.normal_()


def layouts(shapes: list[tuple[int, int]]) -> dict[str, list[torch.Tensor]]:
    separate_4k = [small_pages(s) for s in shapes]
    separate_huge = [memory.empty(s, torch.float32).normal_() for s in shapes]
    total = sum(a * b for a, b in shapes)
    buffer = memory.empty(total, torch.float32)
    views, offset = [], 0
    for a, b in shapes:  # every size here is a multiple of 16 floats: each view starts on a line
        views.append(buffer[offset : offset + a * b].view(a, b).normal_())
        offset += a * b
    return {"4k": separate_4k, "huge": separate_huge, "buffer": views}


def anon_huge_mb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bandwidth_gbs(x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' linears (and the head)")
    args = ap.parse_args()
    weight_shapes = shapes(args.layers)
    torch.set_num_threads(args.threads)
    cpu_native.load()
    native = cpu_native.loaded()
    sets = layouts(weight_shapes)
    big = memory.empty(1 << 28, torch.float32).fill_(1.0)
    before = bandwidth_gbs(big)
    print(f"{args.threads} threads; native product: {native}; huge pages in this process: {anon_huge_mb():.0f} MB")
    results: dict[tuple[int, str], float] = {}
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
        gemv = native and m <= 4
        times: dict[str, list[float]] = {name: [] for name in sets}
        for r in range(args.rounds):
            for name in sets if r % 2 == 0 else reversed(list(sets)):
                weights = sets[name]
                t = time.perf_counter()
                for w in weights:
                    torch.ops.chunkserve.gemv(xs[w.shape[1]], w, None) if gemv else F.linear(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - t)
        for name in sets:
            results[(m, name)] = statistics.median(times[name]) * 1000
    bandwidth = statistics.median([before, bandwidth_gbs(big)])
    weight_bytes = sum(a * b for a, b in weight_shapes) * 4
    floor = weight_bytes / bandwidth / 1e6
    print(f"read bandwidth {bandwidth:.1f} GB/s -> floor {floor:.1f} ms ({weight_bytes / 1e6:.0f} MB)")
    print(f"{'rows':>5} {'kernel':>8} " + " ".join(f"{n:>16}" for n in sets) + "  huge/4k  buffer/huge")
    for m in args.rows:
        row = [results[(m, n)] for n in sets]
        cells = " ".join(f"{t:7.2f} ({t / floor:.2f}x)" for t in row)
        kernel = "gemv" if native and m <= 4 else "F.linear"
        print(f"{m:>5} {kernel:>8} {cells}  {row[1] / row[0]:7.3f}  {row[2] / row[1]:11.3f}")


if __name__ == "__main__":
    main()
