"""Which linear kernel wins at which row count on this CPU (issue 18, item 2): the table behind
`padded_rows` (executor_svc/models/layers.py) and the 16-bit modes' row limit.

For each row count M, all of the default model's linears (30 layers x qkv, o, gate_up, down,
plus the 49152 x 576 head; random weights of the same shapes) applied once, median of
--reps, ms:
- `plain`: float32 (W @ x^T) with M rows as they are (`--no-cpu-gemm-row-padding`);
- `padded`: float32 through `linear` as the executor runs it (rows padded per `padded_rows`);
- `col-major`: float32, M rows as they are, x column-major (what silu(gate) * up of a
  transposed view gives), the layout `linear` now copies to row-major below 16 rows;
- `bf16`, `fp16`: the 16-bit weight copies (`HalfWeights.matmul`: activations cast in,
  `half_linear`'s kernel for M rows);
- `F.lin16`: bfloat16 through plain `F.linear` (oneDNN on every row count), what
  `half_linear` improves on at one row and from 12 rows;
- `int4`: the decoder linears' int4 copies (`Int4Weights.matmul`), the head's bfloat16 copy;
- `packed`: float32 through oneDNN's packed copies (`packed_linear`, `--cpu-gemm-prepack`);
- `gemv`: float32 through the native few-row product (`native_linear`, chunkserve_kernels/csrc/cpu_linear.cpp;
  the linear plan's "gemv", a candidate up to 4 rows; "-" where the native library does not build).

    .venv/bin/python benchmarks/cpu_gemm_shapes.py [--rows 1 2 3 4 5 6 7 8 12 16 31 32] [--reps 5] [--layers 30]

Run it on an otherwise idle machine; rows where `padded` is not the fastest float32 column, or
where a reduced column's win or loss against `padded` disagrees with models/quant.ROW_RULES for
this CPU's class (printed on top), mean this CPU wants another table (`--no-cpu-gemm-row-padding`,
`--quantized-max-rows`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from chunkserve_contracts.cpu import cpu_info
from chunkserve_kernels import cpu_native
from executor_svc.models.layers import linear, native_linear, packed_linear, padded_rows, prepack_weight
from executor_svc.models.quant import HalfWeights, Int4Weights

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M


def shapes(layers: int = LAYERS) -> list[tuple[int, int]]:
    per_layer = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return per_layer * layers + [(VOCAB, HIDDEN)]


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 31, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--layers", type=int, default=LAYERS, help="decoder layers' linears (fewer: a quick smoke run, not the table)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.02 for n, k in shapes(args.layers)]
    half = {dt: [HalfWeights(w, dt) for w in ws] for dt in (torch.bfloat16, torch.float16)}
    q4 = [Int4Weights(w) for w in ws[:-1]] + [half[torch.bfloat16][-1]]
    wb = [h.weight for h in half[torch.bfloat16]]
    packed = [prepack_weight(w) for w in ws] if torch.backends.mkldnn.is_available() else None
    gemv = cpu_native.load() is None
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native bfloat16: {cpu_info().native_bf16}"
    )
    print(
        f"{'rows':>5}{'padded to':>10}{'plain':>9}{'padded':>9}{'col-major':>11}{'bf16':>9}{'fp16':>9}{'F.lin16':>9}{'int4':>9}{'packed':>9}{'gemv':>9}   ms"
    )
    with torch.inference_mode():
        for m in args.rows:
            xs = [torch.randn(m, k) for _, k in shapes(args.layers)]
            xc = [x.t().contiguous().t() for x in xs]  # same values, column-major
            row = [
                timed(lambda xs=xs: [torch.mm(w, x.t()) for x, w in zip(xs, ws)], args.reps),
                timed(lambda xs=xs: [linear(x, w) for x, w in zip(xs, ws)], args.reps),
                timed(lambda xc=xc: [torch.mm(w, x.t()) for x, w in zip(xc, ws)], args.reps),
            ]
            for hs in half.values():
                row.append(timed(lambda xs=xs, hs=hs: [h.matmul(x) for x, h in zip(xs, hs)], args.reps))

            row.append(timed(lambda xs=xs: [F.linear(x.to(v.dtype), v) for x, v in zip(xs, wb)], args.reps))
            row.append(timed(lambda xs=xs: [q.matmul(x) for x, q in zip(xs, q4)], args.reps))
            nan = float("nan")
            row.append(
                timed(lambda xs=xs: [packed_linear(x, p) for x, p in zip(xs, packed)], args.reps) if packed else nan
            )
            row.append(timed(lambda xs=xs: [native_linear(x, w) for x, w in zip(xs, ws)], args.reps) if gemv else nan)
            print(
                f"{m:5d}{padded_rows(m):10d}"
                + "".join(f"{v:9.1f}" if i != 2 else f"{v:11.1f}" for i, v in enumerate(row))
            )


if __name__ == "__main__":
    main()
