"""The native decode attention against an earlier version of itself, in one process.

`torch.ops.chunkserve.paged_decode_attention` as built from the working tree, against the same
op built from a git revision's cpu_attention.cpp and headers (chunkserve_kernels/csrc, kernels/csrc
before 3150927; renamed `chunkserve_base`, so both load side by side): on the default model's shape (9 query / 3 KV heads of 64, blocks of
16, shuffled block tables) at each context length, for one decoding sequence, a verify run of
1 + k rows (one sequence and its drafts: one block table, consecutive context lengths ending
at the context) and 32 separate sequences. Each timing is a layer stack's attention (30 layers,
fewer where that would pass 512 MB of cache; each layer's cache its own tensor, as in a step)
after a 128 MB read that evicts them; the two builds take turns, medians of the rounds, in
microseconds per layer. With --hot, one layer's cache timed again and again without the
evicting read (in L2/L3: the arithmetic, not the memory). Also checks the two agree within
float32 rounding.

    .venv/bin/python benchmarks/decode_attention.py [--base HEAD] [--ctx 512 1300] [--threads 1] [--hot]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from chunkserve_kernels import cpu_native

LAYERS, BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 16, 3, 9, 64
CACHE_BUDGET = 512 * 1024 * 1024  # bytes of cache per timed stack at most


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def base_sources(repo: Path, rev: str) -> dict[str, str]:
    """cpu_attention.cpp and every header beside it at `rev`, by name: the folder is
    chunkserve_kernels/csrc, or kernels/csrc in a revision from before the rename (3150927)."""
    for folder in ("chunkserve_kernels/csrc", "kernels/csrc"):
        paths = _git(repo, "ls-tree", "--name-only", rev, f"{folder}/").split()
        names = [Path(p).name for p in paths if p.endswith(("/cpu_attention.cpp", ".h"))]
        if "cpu_attention.cpp" in names:
            return {name: _git(repo, "show", f"{rev}:{folder}/{name}") for name in names}
    raise SystemExit(f"{rev} has no chunkserve_kernels/csrc/cpu_attention.cpp nor kernels/csrc/cpu_attention.cpp")


def load_base(rev: str) -> None:
    """Builds (or reuses) the attention op of `rev` as torch.ops.chunkserve_base.*."""
    repo = Path(__file__).resolve().parent.parent
    texts = {name: text.replace("chunkserve", "chunkserve_base") for name, text in base_sources(repo, rev).items()}
    key = hashlib.sha256("".join(texts.values()).encode() + " ".join(cpu_native.CFLAGS).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"chunkserve_base_{key}"
    folder.mkdir(exist_ok=True)
    for name, text in texts.items():
        if not (folder / name).exists() or (folder / name).read_text() != text:
            (folder / name).write_text(text)
    from torch.utils import cpp_extension

    cpu_native._with_ninja_on_path()
    cpp_extension.load(
        name=f"chunkserve_base_{key}",
        sources=[str(folder / "cpu_attention.cpp")],
        extra_cflags=list(cpu_native.CFLAGS),
        extra_ldflags=list(cpu_native.LDFLAGS),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


def case(name: str, ctx: int, seqs: int, rows: int, gen: torch.Generator) -> dict:
    """Inputs for `seqs` sequences of `rows` rows each (a verify run when rows > 1), the last
    row of each at context `ctx`, for as many layers as the cache budget allows."""
    blocks = -(-ctx // BLOCK)
    layer_bytes = 2 * 2 * seqs * blocks * BLOCK * KV_HEADS * HEAD_DIM * 4
    layers = max(1, min(LAYERS, CACHE_BUDGET // layer_bytes))
    caches = [torch.randn(2, 2 * seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(layers)]
    tables = torch.randperm(2 * seqs * blocks, generator=gen)[: seqs * blocks].to(torch.int32).view(seqs, blocks)
    table = tables.repeat_interleave(rows, dim=0)
    lens = (torch.arange(ctx - rows + 1, ctx + 1, dtype=torch.int32)).repeat(seqs)
    q = torch.randn(seqs * rows, Q_HEADS, HEAD_DIM, generator=gen)
    return {"name": name, "ctx": ctx, "caches": caches, "table": table, "lens": lens, "q": q}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose cpu_attention.cpp is the baseline")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1300])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--hot", action="store_true", help="one layer's cache, not evicted between calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    why = cpu_native.load()
    if why is not None:
        raise SystemExit(f"the native CPU kernels did not build or load: {why}")
    load_base(args.base)
    ops = {"base": torch.ops.chunkserve_base.paged_decode_attention, "new": torch.ops.chunkserve.paged_decode_attention}
    evict = torch.ones(32 * 1024 * 1024)
    gen = torch.Generator().manual_seed(0)
    where = "hot (one layer, no eviction)" if args.hot else "after an evicting read"
    print(f"load: {os.getloadavg()}; {args.threads} thread(s); base {args.base}; {where}; us per layer, medians")
    print(f"{'case':>22}{'ctx':>6}{'layers':>7}{'base':>10}{'new':>10}{'new/base':>9}  max diff")
    for ctx in args.ctx:
        shapes = [("1 row", 1, 1), ("verify 1+3", 1, 4), ("verify 1+8", 1, 9), ("32 sequences", 32, 1)]
        for name, seqs, rows in shapes:
            c = case(name, ctx, seqs, rows, gen)
            if args.hot:
                c["caches"] = c["caches"][:1] * 5
            times: dict[str, list[float]] = {k: [] for k in ops}
            order = list(ops)
            for r in range(args.rounds):
                for k in order if r % 2 == 0 else order[::-1]:
                    if not args.hot:
                        evict.sum()
                    t = time.thread_time()
                    for cache in c["caches"]:
                        ops[k](c["q"], cache, c["table"], c["lens"], HEAD_DIM**-0.5)
                    times[k].append((time.thread_time() - t) * 1e6 / len(c["caches"]))
            a, b = (ops[k](c["q"], c["caches"][0], c["table"], c["lens"], HEAD_DIM**-0.5) for k in order)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"{name:>22}{ctx:6d}{len(c['caches']):7d}{med['base']:10.1f}{med['new']:10.1f}"
                f"{med['new'] / med['base']:9.2f}  {(a - b).abs().max().item():.1e}"
            )


if __name__ == "__main__":
    main()
