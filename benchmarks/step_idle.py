"""Executor idle time between steps: plain (--no-async-scheduling), the default,
--async-output-processing, --async-scheduling (issue 17, item 5).

Idle time after step N = (when the executor began step N+1) - (when it began step N) - (its
own time for step N), from the step trace: what the executor waits for the scheduler between
two steps (the result's way back, applying it, streaming its tokens,
metrics and trace, planning the next step, the plan's way there). Async output processing moves
the streaming, metrics and trace of step N behind the sending of step N+1; async scheduling
also plans and sends step N+1 before step N's result is back, so the executor finds its next
plan waiting. The executor reports when it began each step on its own clock
(`executorStartUnixNs` in the trace), so the gap between one step's end and the next one's
start is measured there, with or without overlap; "idle share" is idle / (idle + executor)
over the pairs counted (not the gaps where no request was running or waiting).

Starts one server per setting with a step-trace file each and sends the same workload (N
concurrent greedy streams, fixed lengths, ignore_eos) through `chunkserve bench`'s gRPC runner,
rounds in the order A B C C B A ..., then prints per setting the median and P90 idle ms per
step, the mean, idle as a share of idle + executor time, the executor's median step ms, output tok/s
and median ITL, with each setting's ratio to the plain one.

    .venv/bin/python benchmarks/step_idle.py --model tiny      # ~ms steps: what a GPU with a small model sees
    .venv/bin/python benchmarks/step_idle.py --model default --streams 8 --output-len 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from chunkserve.bench.metrics import compute_metrics
from chunkserve.bench.session import RunOptions, run_once, server_target
from chunkserve.bench.workloads import WorkloadSpec, build_workload, corpus_ids
from chunkserve.launch import bench_model, start_server

# "default" is neither flag: on a CPU executor only steps of at most 2 sequences overlap
# (scheduler_svc/config.py, overlap_limit), so it is "off" at 32 streams and "async-sched" at 1.
SETTINGS = {
    "off": ["--no-async-scheduling"],
    "default": [],
    "async-output": ["--async-output-processing"],
    "async-sched": ["--async-scheduling"],
}


def idle_ms(trace_lines: list[str]) -> tuple[list[float], float, list[float]]:
    """(idle ms per consecutive step pair, wall ms from first to last step, executor ms per step).

    Idle between steps N and N+1 = N+1's start - (N's start + N's executor time), both on the
    executor's clock (`executorStartUnixNs`); in a trace without it, N+1's planning time - N's
    - N's executor time (right only without async scheduling, where N+1 is planned after N's
    result). A pair is left out where nothing ran or waited after N (the gap is the clients'),
    or where the ids are not consecutive (a restart)."""
    steps = sorted((json.loads(line) for line in trace_lines if line.strip()), key=lambda s: int(s.get("stepId", 0)))
    idle, executor = [], []
    for a, b in zip(steps, steps[1:]):
        if int(b.get("stepId", 0)) != int(a.get("stepId", 0)) + 1:
            continue
        if not int(a.get("numRunning", 0)) and not int(a.get("numWaiting", 0)):  # JSON omits zeros
            continue
        ex = int(a.get("executorNs", 0)) / 1e6
        if "executorStartUnixNs" in a and "executorStartUnixNs" in b:
            idle.append((int(b["executorStartUnixNs"]) - int(a["executorStartUnixNs"])) / 1e6 - ex)
        else:
            idle.append((b["timestamp"] - a["timestamp"]) * 1000 - ex)
        executor.append(ex)
    wall = (steps[-1]["timestamp"] - steps[0]["timestamp"]) * 1000 if len(steps) > 1 else 0.0
    return idle, wall, executor


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="tiny", help="tiny (default), tiny-bytes (no default model needed), default, or a folder"
    )
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds of A,B (alternating order)")
    p.add_argument("--dtype", default="auto", help="the executor's --dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="which to run")
    return p.parse_args()


def main() -> None:
    args = _parse_args()
    settings = {name: SETTINGS[name] for name in args.settings}

    model = bench_model(args.model)
    spec = WorkloadSpec("fixed", args.streams, (args.output_len, args.output_len), args.input_len)
    requests = build_workload(spec, corpus_ids(model), seed=0)
    work = Path(tempfile.mkdtemp())
    traces = {name: work / f"trace-{name}.jsonl" for name in settings}
    for name in settings:
        (work / name).mkdir()
    # The servers run side by side: on a GPU each would otherwise size its KV cache from the
    # memory the ones before it left (--gpu-memory-utilization is of the whole card), so every
    # one gets a fixed cache, twice what the streams can hold at once.
    blocks = 2 * args.streams * -(-(args.input_len + args.output_len) // 16) + 64
    servers = {
        name: start_server(
            work / name,
            ["--model", str(model), "--dtype", args.dtype, "--num-gpu-blocks-override", str(blocks)],
            ["--step-trace-file", str(traces[name]), *flags],
        )
        for name, flags in settings.items()
    }
    opts = RunOptions(num_warmups=2, progress=False, backend="grpc")
    figures: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in ("med", "p90", "mean", "share", "ex", "tput", "itl")} for n in settings
    }
    try:
        for r in range(args.rounds):
            for name in list(settings) if r % 2 == 0 else list(settings)[::-1]:
                start = traces[name].stat().st_size if traces[name].exists() else 0
                run = run_once(server_target(servers[name], "grpc"), requests, [0.0] * len(requests), opts)
                failed = [rec.error for rec in run.result.records if not rec.ok]
                if failed:
                    raise SystemExit(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
                with traces[name].open() as f:
                    f.seek(start)
                    idle, wall, ex = idle_ms(f.readlines())
                m = compute_metrics(run.result.records, run.result.duration, [50], {})
                fig = figures[name]
                fig["med"].append(statistics.median(idle))
                fig["p90"].append(statistics.quantiles(idle, n=10)[-1])
                fig["mean"].append(statistics.fmean(idle))
                fig["share"].append(sum(idle) / (sum(idle) + sum(ex)))
                fig["ex"].append(statistics.median(ex))
                fig["tput"].append(m["output_throughput"])
                fig["itl"].append(m["median_itl_ms"])
                print(
                    f"round {r + 1} {name:12}: idle median {fig['med'][-1]:.3f} ms, P90 {fig['p90'][-1]:.3f} ms, "
                    f"{fig['share'][-1]:.1%} of the time; executor median {fig['ex'][-1]:.2f} ms; "
                    f"{fig['tput'][-1]:.0f} tok/s, median ITL {fig['itl'][-1]:.2f} ms",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    _print_table(args, settings, figures)


def _print_table(args: argparse.Namespace, settings: dict, figures: dict[str, dict[str, list[float]]]) -> None:
    """Per setting the medians over rounds, and each one's ratio to the first setting's."""
    base = next(iter(settings))
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
    print(
        f"\n{args.streams} streams x {args.input_len} in + {args.output_len} out, model {args.model}, "
        f"medians of {args.rounds} rounds"
    )
    others = [n for n in settings if n != base]
    print(f"{'':30}" + "".join(f"{n:>13}" for n in settings) + "".join(f"{n + '/' + base:>20}" for n in others))
    names = (
        ("med", "idle per step, median ms"),
        ("p90", "idle per step, P90 ms"),
        ("mean", "idle per step, mean ms"),
        ("share", "idle / (idle + executor)"),
        ("ex", "executor per step, median ms"),
        ("tput", "output tok/s"),
        ("itl", "median ITL ms"),
    )
    for key, label in names:
        a = med[base][key]
        row = "".join(f"{med[n][key]:13.3f}" for n in settings)
        row += "".join(f"{med[n][key] / a if a else float('nan'):20.3f}" for n in others)
        print(f"{label:30}{row}")


if __name__ == "__main__":
    main()
