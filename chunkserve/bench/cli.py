"""`chunkserve bench`: flags, and the entry point that runs a mode and writes the report.

    chunkserve bench --address 127.0.0.1:50051 --workload mixed --num-prompts 40 --request-rate 0.5
    chunkserve bench --server-args "--max-num-batched-tokens 256" \\
        --compare "--enable-chunked-prefill" "--no-enable-chunked-prefill" --rounds 2
    chunkserve bench --capacity --slo-p99-tbt-ms 500 --max-median-queue-ms 2000
    chunkserve bench --hf-baseline --hf-batch-size 8 --workload fixed --input-len 128

Without --address the bench starts its own server (--server-args) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
import time
from pathlib import Path

from chunkserve.bench.workloads import WORKLOADS, WorkloadSpec, parse_range

_DESCRIPTION = """Load-test a chunkserve server over gRPC: TTFT, TPOT, ITL, E2EL, throughput, goodput.

examples:
  chunkserve bench --address 127.0.0.1:50051 --workload mixed --num-prompts 40 --request-rate 0.5
  chunkserve bench --server-args "--max-num-batched-tokens 256" \\
      --compare "--enable-chunked-prefill" "--no-enable-chunked-prefill" --rounds 2
  chunkserve bench --capacity --slo-p99-tbt-ms 500 --max-median-queue-ms 2000
  chunkserve bench --hf-baseline --hf-batch-size 8 --workload fixed --input-len 128

Without --address the bench starts its own server (--server-args) and stops it at the end."""

# Flags whose values are server flag strings: `--compare --no-x --y` would look like bench
# flags to argparse, so they are rewritten to `--compare=--no-x` before parsing.
_CONFIG_FLAGS = ("--compare", "--server-args")


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `bench` to the `chunkserve` command's subparsers."""
    p = sub.add_parser(
        "bench",
        help="load-test a server over gRPC and report latency and throughput",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t = p.add_argument_group("target")
    t.add_argument("--address", help="host:port of a running server (default: start one with --server-args)")
    t.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: chunkserve.v1.Generate; openai: POST /v1/completions streamed over HTTP (then --address is "
        "the HTTP API's host:port or http://host:port, e.g. 127.0.0.1:8000)",
    )
    t.add_argument(
        "--admin-address",
        help="host:port of the running server's Admin service: record its step "
        "trace (tokens-per-step plot, measured queue delay) and empty its prefix cache before each run",
    )
    t.add_argument(
        "--step-trace",
        action="store_true",
        help="record the step trace of the servers the bench "
        "starts itself (as --admin-address does for a running server)",
    )
    t.add_argument("--server-args", default="", help="`chunkserve serve` flags of the servers the bench starts")
    t.add_argument(
        "--compare",
        action="append",
        metavar="FLAGS",
        help="two or more configurations (server flags added to --server-args), one quoted "
        "string each, e.g. --compare '--enable-chunked-prefill' '--no-enable-chunked-prefill'",
    )
    t.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="--compare: rounds; the order alternates A,B then B,A so drift falls on all alike",
    )
    t.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: the served model's)")
    t.add_argument("--log-dir", type=Path, help="server logs of started servers (default: a temp folder)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="mixed")
    w.add_argument("--num-prompts", type=int, help="requests (default 100; N x M for shared-prefix)")
    w.add_argument("--input-len", type=int, default=512, help="fixed: prompt tokens")
    w.add_argument("--output-len", default="128", help="output tokens, N or LOW:HIGH (ignore_eos)")
    w.add_argument("--long-fraction", type=float, default=0.3, help="mixed: fraction of long prompts")
    w.add_argument("--long-len", default="2048:4096", help="mixed: long prompt tokens, LOW:HIGH")
    w.add_argument("--short-len", default="16:128", help="mixed: short prompt tokens, LOW:HIGH")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: N system prompts")
    w.add_argument("--users-per-prefix", type=int, default=8, help="shared-prefix: M users each")
    w.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    w.add_argument("--suffix-len", default="16:64", help="shared-prefix: user suffix tokens, LOW:HIGH")
    w.add_argument("--seed", type=int, default=0, help="same seed = same prompts, lengths and arrivals")
    w.add_argument(
        "--reset-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="empty the server's prefix cache before each measured run (needs its admin address: "
        "known for servers the bench starts, --admin-address otherwise)",
    )
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf = all at once)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    a.add_argument("--max-concurrency", type=int, help="most requests in flight")
    a.add_argument("--num-warmups", type=int, default=1, help="uncounted requests sent first")
    a.add_argument("--request-timeout", type=float, help="seconds per request (default: none)")
    a.add_argument(
        "--stall-timeout",
        type=float,
        default=600.0,
        help="give up when nothing was sent or streamed for this long with requests in flight",
    )
    r = p.add_argument_group("report")
    r.add_argument("--percentiles", default="50,95,99", help="comma-separated, e.g. 50,90,99,99.9")
    r.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:100 e2el:5000")
    r.add_argument("--result-json", type=Path, help="write the full report here")
    r.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    c = p.add_argument_group("capacity search (Sarathi-Serve)")
    c.add_argument("--capacity", action="store_true", help="find the highest rate within the SLOs")
    c.add_argument("--slo-p99-tbt-ms", type=float, help="P99 time-between-tokens SLO")
    c.add_argument(
        "--max-median-queue-ms",
        type=float,
        help="bound on the median scheduling delay of each request class (the worst class counts)",
    )
    c.add_argument("--capacity-probes", type=int, default=8, help="most runs of the search")
    h = p.add_argument_group("Hugging Face baseline")
    h.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run HF generate (static batching) on the "
        "model of --server-args (--model, else the default model), after the servers have stopped",
    )
    h.add_argument("--hf-batch-size", type=int, default=8)
    h.add_argument("--hf-dtype", choices=("auto", "float32", "bfloat16"), help="default: the server's --dtype")
    parse = p.parse_known_args
    p.parse_known_args = lambda args=None, namespace=None: parse(_quote_configs(args, p), namespace)  # type: ignore
    return p


def _quote_configs(args: list[str] | None, parser: argparse.ArgumentParser) -> list[str] | None:
    """`--compare X Y` -> `--compare=X --compare=Y`; `--server-args X` -> `--server-args=X`.

    --compare takes every following argument up to the next bench flag, --server-args one.
    """
    if args is None:
        return None
    known = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        i += 1
        if flag not in _CONFIG_FLAGS:
            out.append(flag)
            continue
        limit = 1 if flag == "--server-args" else len(args)
        taken = 0
        while i < len(args) and taken < limit and args[i].split("=", 1)[0] not in known:
            out.append(f"{flag}={args[i]}")
            i += 1
            taken += 1
        if not taken:
            out.append(flag)  # argparse reports the missing value
    return out


def run_bench(args: argparse.Namespace) -> int:
    """Runs the mode the flags ask for; prints tables, writes JSON and plots; exit code."""
    import grpc

    from chunkserve.bench.runner import StalledError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None  # stop our servers
    try:
        return _run(args)
    except ValueError as exc:
        print(f"chunkserve bench: {exc}", file=sys.stderr)
        return 2
    except StalledError as exc:
        print(f"chunkserve bench: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:  # e.g. no server at --address: one line, not a traceback
        from chunkserve.client import rpc_error_line

        line = rpc_error_line(exc, args.address or "the server", "chunkserve.v1.Generation")
        print(f"chunkserve bench: {line}", file=sys.stderr)
        return 1
    except Exception as exc:  # the HTTP backend's connection errors, as one line too
        if not type(exc).__module__.startswith("httpx"):
            raise
        print(f"chunkserve bench: {args.address or 'the server'}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # servers the bench started are stopped on the way out
        print("chunkserve bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from chunkserve.bench import modes
    from chunkserve.bench.arrivals import arrival_times
    from chunkserve.bench.metrics import parse_slos
    from chunkserve.bench.session import RunOptions

    started = time.time()
    _check(args)
    requests, tokenizer_dir, model_dir = _workload(args)
    plan = modes.Plan(
        requests,
        arrival_times(len(requests), args.request_rate, args.burstiness, args.seed),
        RunOptions(
            args.max_concurrency,
            args.num_warmups,
            args.request_timeout,
            not args.disable_tqdm,
            args.stall_timeout,
            trace=args.step_trace or bool(args.admin_address),
            reset_prefix_cache=args.reset_prefix_cache,
            backend=args.backend,
        ),
        _percentiles(args.percentiles),
        parse_slos(args.goodput),
        args.server_args,
        _target_address(args),
        args.admin_address,
        args.log_dir,
        args.seed,
        args.burstiness,
    )
    if args.capacity:
        start = args.request_rate if math.isfinite(args.request_rate) else 1.0
        outcome = modes.capacity(plan, args.slo_p99_tbt_ms, args.max_median_queue_ms, start, args.capacity_probes)
    elif args.compare:
        outcome = modes.compare(plan, args.compare, args.rounds)
    else:
        outcome = modes.single(plan)
    if args.hf_baseline:
        from chunkserve.bench.servers import flag_value, split_server_args

        executor_argv = split_server_args(args.server_args)[0]
        dtype = args.hf_dtype or flag_value(executor_argv, "--dtype") or "auto"
        device = flag_value(executor_argv, "--device") or "auto"
        modes.add_hf_baseline(outcome, plan, model_dir, dtype, device, args.hf_batch_size)
    outcome.doc = {"bench": _settings(args, plan, tokenizer_dir, started), **outcome.doc}
    print("\n\n".join(outcome.tables))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(_finite(outcome.doc), indent=1, default=str, allow_nan=False))
        print(f"report: {args.result_json}")
    if args.plot_dir and outcome.plots:
        from chunkserve.bench.plots import write_plots

        for path in write_plots(outcome.plots, args.plot_dir):
            print(f"plot: {path}")
    return 0


def _check(args: argparse.Namespace) -> None:
    """Flag combinations that cannot work, refused before anything starts."""
    if args.compare and args.address:
        raise ValueError("--compare starts its own servers: drop --address")
    if args.backend == "grpc" and args.address and args.address.startswith(("http://", "https://")):
        raise ValueError(f"--address {args.address} is an HTTP URL: add --backend openai (gRPC takes host:port)")
    if args.admin_address and not args.address:
        raise ValueError("--admin-address goes with --address (for servers the bench starts, use --step-trace)")
    if args.capacity and (args.slo_p99_tbt_ms is None or args.max_median_queue_ms is None):
        raise ValueError("--capacity needs --slo-p99-tbt-ms and --max-median-queue-ms")
    if args.capacity and (args.compare or args.hf_baseline):
        raise ValueError("--capacity searches one server: drop --compare / --hf-baseline")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")


def _target_address(args: argparse.Namespace) -> str | None:
    """--address as the runner takes it: `host:port` for gRPC, `http://host:port` for openai."""
    if args.address is None or args.backend == "grpc":
        return args.address
    if args.address.startswith(("http://", "https://")):
        return args.address.rstrip("/").removesuffix("/v1")
    return f"http://{args.address}"


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--percentiles: expected numbers like 50,95,99, got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--percentiles must be in (0, 100], got {text!r}")
    return values


def _workload(args: argparse.Namespace):
    from chunkserve.bench.servers import model_folder
    from chunkserve.bench.workloads import build_workload, corpus_ids

    spec = WorkloadSpec(
        args.workload,
        args.num_prompts,
        parse_range(args.output_len),
        args.input_len,
        args.long_fraction,
        parse_range(args.long_len),
        parse_range(args.short_len),
        args.num_prefixes,
        args.users_per_prefix,
        args.prefix_len,
        parse_range(args.suffix_len),
    )
    needs_model = args.hf_baseline or not args.tokenizer
    model_dir = model_folder(args.server_args) if needs_model else None
    tokenizer_dir = args.tokenizer or model_dir
    return build_workload(spec, corpus_ids(tokenizer_dir), args.seed), tokenizer_dir, model_dir


def _settings(args: argparse.Namespace, plan, tokenizer_dir: Path, started: float) -> dict:
    keep = (
        "workload",
        "num_prompts",
        "input_len",
        "output_len",
        "long_fraction",
        "long_len",
        "short_len",
        "num_prefixes",
        "users_per_prefix",
        "prefix_len",
        "suffix_len",
        "seed",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "num_warmups",
        "server_args",
        "compare",
        "rounds",
        "address",
        "admin_address",
        "step_trace",
        "capacity",
        "hf_baseline",
        "hf_batch_size",
    )
    out = {k: getattr(args, k) for k in keep}
    out.update(
        date=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        backend="chunkserve" if args.backend == "grpc" else "openai",  # vLLM's key: the API measured
        num_requests=len(plan.requests),
        percentiles=plan.percentiles,
        goodput_slos=plan.slos,
        tokenizer=str(tokenizer_dir),
        command=" ".join(sys.argv),
    )
    return out


def _finite(value: object) -> object:
    """inf/nan -> "inf"/"nan" (strict JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
