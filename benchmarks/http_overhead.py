"""What the OpenAI-compatible HTTP API costs per token, against gRPC, on one server.

Starts one server and sends the same workload (N concurrent greedy streams, fixed prompt and
output lengths, ignore_eos) through `chunkserve bench`'s runner over gRPC (`Generate`) and
over HTTP (`POST /v1/completions`, server-sent events, `return_token_ids`), in the order
A B B A ... so drift falls on both alike. Both fronts run in the scheduler process, on its
one event loop, so the cost that matters is that process's CPU time per output token (read
from /proc; it includes the engine's own work, equal for both) and what clients see: mean
TPOT, median ITL and output throughput. Prints each figure per backend and HTTP/gRPC ratios.

    .venv/bin/python benchmarks/http_overhead.py --model tiny      # steps of ~ms: overhead visible
    .venv/bin/python benchmarks/http_overhead.py --model default   # what it means for a real model

The client (this process) runs on the same cores as the server, as a load generator on the
same host would; its own cost is not counted in the server CPU figure but does compete.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from chunkserve.bench.metrics import compute_metrics
from chunkserve.bench.session import RunOptions, run_once, server_target
from chunkserve.bench.workloads import WorkloadSpec, build_workload, corpus_ids
from chunkserve.launch import bench_model, start_server


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), default, or a model folder")
    p.add_argument("--streams", type=int, default=32, help="concurrent requests per run")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds of A,B (alternating order)")
    args = p.parse_args()

    model = bench_model(args.model)
    spec = WorkloadSpec("fixed", args.streams, (args.output_len, args.output_len), args.input_len)
    requests = build_workload(spec, corpus_ids(model), seed=0)
    server = start_server(Path(tempfile.mkdtemp()), ["--model", str(model), "--dtype", "float32"], [])
    opts = {b: RunOptions(num_warmups=2, progress=False, backend=b) for b in ("grpc", "openai")}
    figures: dict[str, dict[str, list[float]]] = {b: {"cpu": [], "tpot": [], "itl": [], "tput": []} for b in opts}
    try:
        for r in range(args.rounds):
            for backend in ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc"):
                cpu0 = _cpu_s(server.scheduler.pid)
                run = run_once(server_target(server, backend), requests, [0.0] * len(requests), opts[backend])
                cpu = _cpu_s(server.scheduler.pid) - cpu0
                m = compute_metrics(run.result.records, run.result.duration, [50], {})
                failed = [rec.error for rec in run.result.records if not rec.ok]
                if failed:
                    raise SystemExit(f"{backend}: {len(failed)} requests failed, e.g. {failed[0]}")
                tokens = sum(rec.output_tokens for rec in run.result.records)
                # CPU includes the 2 warm-ups' few tokens; per token of the measured run.
                f = figures[backend]
                f["cpu"].append(1000 * cpu / tokens)
                f["tpot"].append(m["mean_tpot_ms"])
                f["itl"].append(m["median_itl_ms"])
                f["tput"].append(m["output_throughput"])
                print(
                    f"round {r + 1} {backend:6}: scheduler CPU {f['cpu'][-1]:.3f} ms/token, mean TPOT "
                    f"{f['tpot'][-1]:.2f} ms, median ITL {f['itl'][-1]:.2f} ms, {f['tput'][-1]:.0f} tok/s",
                    flush=True,
                )
    finally:
        server.stop()
    med = {b: {k: statistics.median(v) for k, v in f.items()} for b, f in figures.items()}
    print(
        f"\n{args.streams} streams x {args.input_len} in + {args.output_len} out, model {args.model}, "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'':28}{'gRPC':>10}{'HTTP':>10}{'HTTP/gRPC':>11}")
    names = (
        ("cpu", "scheduler CPU ms/token"),
        ("tpot", "mean TPOT ms"),
        ("itl", "median ITL ms"),
        ("tput", "output tok/s"),
    )
    for key, label in names:
        g, h = med["grpc"][key], med["openai"][key]
        print(f"{label:28}{g:10.3f}{h:10.3f}{h / g:11.3f}")


if __name__ == "__main__":
    main()
