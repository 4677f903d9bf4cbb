"""`chunkserve tune`: a grid of scheduler settings replayed on a request log, and the best one.

Each setting is one replay (replay.py) of the same request log under the cost model fitted
from a step trace (cost.py): a recorded one (--trace) or one that a short calibration run
against a live server records (--calibrate, calibrate.py). Printed: the fit's error, a table
of predicted latencies per request class, throughput and preemptions per setting, the
settings that meet the SLO, and the one with the best throughput among them as
`chunkserve serve` flags; --plot draws the latency trade-off (plot.py).

    chunkserve tune --trace steps.jsonl --slo itl_p99_ms=200 short.ttft_p99_ms=1000
    chunkserve tune --trace steps.jsonl --requests bench.json --plot tune.png
    chunkserve tune --calibrate --address 127.0.0.1:50051 --save-trace calib.jsonl
    chunkserve tune --calibrate --address 127.0.0.1:50051 --requests bench.json --slo itl_p99_ms=200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from chunkserve.tune.cost import fit_with_error, load_trace, quantile
from chunkserve.tune.replay import ReplayResult, load_requests, replay
from scheduler_svc.config import SchedulerConfig

DEFAULT_ADMIN_PORT = 50052  # scheduler_svc.config.SchedulerConfig.admin_port (as chunkserve/admin_cli.py)

DEFAULT_BUDGETS = "128,256,512,1024,2048,4096,8192"
METRICS = ("ttft", "itl", "e2e")
# Settings whose predicted throughput is within this fraction of the best count as equally
# good; among them the lowest P99 ITL, then P99 TTFT, wins (below saturation throughput is
# flat and latency is what differs).
THROUGHPUT_TIE = 0.005


@dataclass(frozen=True, slots=True)
class Setting:
    budget: int
    max_num_partial_prefills: int = 4
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    num_blocks: int | None = None
    target_itl_ms: float | None = None  # the auto budget (budget = its upper bound)

    def flags(self) -> str:
        out = [
            f"--max-num-batched-tokens {self.budget}",
            f"--max-num-partial-prefills {self.max_num_partial_prefills}",
            f"--max-long-partial-prefills {self.max_long_partial_prefills}",
            f"--long-prefill-token-threshold {self.long_prefill_token_threshold}",
            f"--scheduling-policy {self.policy}",
        ]
        if self.target_itl_ms is not None:
            out.append(f"--target-itl-ms {self.target_itl_ms:g}")
        if self.num_blocks is not None:
            out.append(f"--num-gpu-blocks-override {self.num_blocks}")
        return " ".join(out)

    def label(self) -> str:
        s = f"B={self.budget}" + (f" auto<={self.target_itl_ms:g}ms" if self.target_itl_ms is not None else "")
        s += f" pp={self.max_num_partial_prefills}/{self.max_long_partial_prefills}"
        s += f" thr={self.long_prefill_token_threshold or 'auto'} {self.policy}"
        return s + (f" kv={self.num_blocks}" if self.num_blocks is not None else "")


def summarize(result: ReplayResult) -> dict:
    """Predicted figures (ms; throughput in output tokens/s) overall ('all') and per class."""
    done = [r for r in result.requests if r.token_times]
    classes = ["all"] + sorted({r.spec.cls for r in done} - {"all"}, key=lambda c: (c != "short", c != "long", c))
    out: dict = {"classes": {}}
    for cls in classes:
        group = [r for r in done if cls == "all" or r.spec.cls == cls]
        series = {
            "ttft": [r.ttft for r in group],
            "itl": [g for r in group for g in r.itls],
            "e2e": [r.e2e for r in group],
        }
        figures: dict[str, float] = {"n": len(group)}
        for m in METRICS:
            for p in (50, 99):
                v = quantile(series[m], p / 100)
                figures[f"{m}_p{p}_ms"] = v * 1e3 if v == v else 0.0  # nan (no ITL) -> 0
        out["classes"][cls] = figures
    tokens = sum(len(r.token_times) for r in done)
    out["output_throughput"] = tokens / result.duration if result.duration > 0 else 0.0
    out["preemptions"] = result.num_preemptions
    out["steps"] = len(result.steps)
    out["cached_tokens"] = result.num_cached_tokens
    return out


def average(summaries: Sequence[dict]) -> dict:
    """The mean of each figure over replays of one setting with different noise seeds (one
    replay's P99 depends on which steps drew the slow ratios)."""
    if len(summaries) == 1:
        return summaries[0]
    n = len(summaries)
    out: dict = {"classes": {}}
    for cls, figures in summaries[0]["classes"].items():
        out["classes"][cls] = {k: sum(s["classes"][cls][k] for s in summaries) / n for k in figures}
    for key in ("output_throughput", "preemptions", "steps", "cached_tokens"):
        out[key] = sum(s[key] for s in summaries) / n
    return out


def parse_slo(items: Sequence[str]) -> dict[str, float]:
    """['ttft_p99_ms=2000', 'short.itl_p99_ms=500'] -> {key: limit}; a key without a class
    applies to all requests."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name = key.split(".")[-1]
        metric, _, rest = name.partition("_")
        if not sep or metric not in METRICS or rest not in ("p50_ms", "p99_ms"):
            raise ValueError(f"--slo {item!r}: expected [CLASS.]{{ttft,itl,e2e}}_{{p50,p99}}_ms=MILLISECONDS")
        slo[key] = float(value)
    return slo


def meets(summary: dict, slo: dict[str, float]) -> bool:
    for key, limit in slo.items():
        cls, _, name = key.rpartition(".")
        figures = summary["classes"].get(cls or "all")
        if figures is not None and figures[name] > limit:
            return False
    return True


def best(rows: Sequence[tuple[Setting, dict]], slo: dict[str, float]) -> tuple[Setting, dict] | None:
    """The feasible setting with the best throughput (ties: lowest P99 ITL, then P99 TTFT)."""
    feasible = [(s, m) for s, m in rows if meets(m, slo)]
    if not feasible:
        return None
    top = max(m["output_throughput"] for _, m in feasible)
    near = [(s, m) for s, m in feasible if m["output_throughput"] >= top * (1 - THROUGHPUT_TIE)]
    return min(near, key=lambda sm: (sm[1]["classes"]["all"]["itl_p99_ms"], sm[1]["classes"]["all"]["ttft_p99_ms"]))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _targets(text: str) -> list[float | None]:
    """--target-itl-ms values: ms, or none (a fixed budget)."""
    return [None if x.strip().lower() in ("none", "off") else float(x) for x in text.split(",") if x.strip()]


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="predict latencies for a grid of scheduler settings by replaying a request log",
        description="Replay a request log through the real scheduler with a simulated clock (a step-time model "
        "fitted from a step trace, or from a short calibration run it drives itself) for a grid of settings; print "
        "predicted latencies and the best flags.",
    )
    p.add_argument(
        "--trace",
        help="a step trace (`chunkserve serve --step-trace-file`, or `--save-trace` of a calibration), JSON lines: "
        "the cost model is fitted on it (unless --calibrate), and it is the request log unless --requests",
    )
    p.add_argument(
        "--requests",
        help="the request log to replay: a `chunkserve bench --result-json` report or a step trace (default: --trace)",
    )
    c = p.add_argument_group("calibration (--calibrate)")
    c.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the cost model on a short designed run against a running server (--address): prompts, decode "
        "counts and contexts spread so every term of the model is measured",
    )
    c.add_argument("--address", help="host:port of the running server's gRPC API (as for `chunkserve bench`)")
    c.add_argument(
        "--admin-address",
        help="host:port of its Admin service, where the step trace is watched (default: --address's host, port "
        f"{DEFAULT_ADMIN_PORT})",
    )
    c.add_argument(
        "--step-trace-file",
        help="instead of watching the Admin service: the server's own --step-trace-file (same host); the lines "
        "it writes during the calibration are used",
    )
    c.add_argument("--save-trace", help="write the calibration's step trace here (JSON lines, for a later --trace)")
    c.add_argument(
        "--calibration-output-len",
        type=int,
        default=32,
        help="output tokens of the decoding requests (default 32; more: a longer, steadier calibration)",
    )
    c.add_argument("--calibration-timeout", type=float, default=120.0, help="give up after this long without a token")
    p.add_argument(
        "--budgets", default=DEFAULT_BUDGETS, help=f"--max-num-batched-tokens values (default {DEFAULT_BUDGETS})"
    )
    p.add_argument("--max-num-partial-prefills", default="4", help="comma-separated values (default 4)")
    p.add_argument("--max-long-partial-prefills", default="1", help="comma-separated values (default 1)")
    p.add_argument(
        "--long-prefill-token-threshold", default="0", help="comma-separated values (0 = 4%% of max_model_len)"
    )
    p.add_argument("--policy", default="fcfs", help="comma-separated scheduling policies (default fcfs)")
    p.add_argument(
        "--target-itl-ms",
        default="none",
        help="comma-separated targets of the auto token budget (the server's --target-itl-ms; each --budgets value "
        "is then its upper bound); none = a fixed budget (default none; e.g. none,150,300 compares both)",
    )
    p.add_argument("--num-blocks", help="comma-separated KV pool sizes in blocks (default: the bench's server_info)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: server_info, else 16)")
    p.add_argument("--max-model-len", type=int, help="default: server_info, else the longest request")
    p.add_argument("--max-num-seqs", type=int, help="default: server_info, else 128")
    p.add_argument("--target", choices=("step", "executor"), default="step", help="fit stepNs (default) or executorNs")
    p.add_argument(
        "--noise",
        choices=("none", "resample"),
        default="resample",
        help="resample (default): each step's time is the model's times a measured/predicted ratio of the trace, "
        "drawn with --seed, so tail latencies include the spread the trace showed; none: the model alone",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --noise resample (default 0)")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="with --noise resample: replays per setting (seeds --seed, --seed+1, ...), figures averaged (default 5)",
    )
    p.add_argument("--slo", nargs="*", default=[], help="e.g. ttft_p99_ms=2000 itl_p99_ms=500 short.ttft_p99_ms=1000")
    p.add_argument("--json", dest="json_out", help="write every setting's predicted figures here")
    p.add_argument(
        "--plot",
        help="write a PNG here: predicted P99 ITL vs short-request P99 TTFT per setting, the SLO box and the "
        "recommendation (needs matplotlib, the `bench` extra)",
    )


def _table(rows: Sequence[tuple[Setting, dict, float]]) -> str:
    head = (
        "setting | class | n | TTFT P50 / P99 ms | ITL P50 / P99 ms | E2E P50 / P99 ms | out tok/s | preempt "
        "| cached tok | replay s"
    )
    lines = [head, "-" * len(head)]
    for s, m, secs in rows:
        for cls, f in m["classes"].items():
            lines.append(
                f"{s.label()} | {cls} | {f['n']:g} | {f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} | "
                f"{f['itl_p50_ms']:.0f} / {f['itl_p99_ms']:.0f} | {f['e2e_p50_ms']:.0f} / {f['e2e_p99_ms']:.0f} | "
                f"{m['output_throughput']:.2f} | {m['preemptions']:g} | {m.get('cached_tokens', 0):g} | {secs:.2f}"
            )
    return "\n".join(lines)


def admin_address_for(address: str) -> str:
    """The Admin service next to a gRPC address: same host, the default admin port."""
    host = address.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{DEFAULT_ADMIN_PORT}"


def _check(args: argparse.Namespace) -> str | None:
    """Flag combinations that cannot work, as one line (None when fine)."""
    if not args.calibrate and not args.trace:
        return "give a step trace (--trace FILE) or measure one (--calibrate --address HOST:PORT)"
    if args.calibrate and not args.address:
        return "--calibrate needs --address HOST:PORT of a running server"
    if not args.calibrate and (args.address or args.save_trace or args.step_trace_file):
        return "--address, --step-trace-file and --save-trace go with --calibrate"
    if args.address and args.address.startswith(("http://", "https://")):
        return "--calibrate drives the gRPC API: --address HOST:PORT, not an http:// URL"
    for flag in ("budgets", "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold"):
        try:
            _ints(getattr(args, flag))
        except ValueError:
            return f"--{flag.replace('_', '-')} takes comma-separated integers, got {getattr(args, flag)!r}"
    try:
        if any(t is not None and not t > 0 for t in _targets(args.target_itl_ms)):
            raise ValueError
    except ValueError:
        return f"--target-itl-ms takes comma-separated positive ms or none, got {args.target_itl_ms!r}"
    if args.plot:
        from chunkserve.tune.plot import matplotlib_missing

        return matplotlib_missing()
    return None


def _run_calibration(args: argparse.Namespace, out) -> str:
    """Runs the calibration; returns the path of its step trace (saved, or a temp file)."""
    import grpc

    from chunkserve.tune.calibrate import calibrate, save_lines

    admin = args.admin_address or admin_address_for(args.address)
    log = lambda line: print(line, file=out, flush=True)  # noqa: E731
    try:
        cal = calibrate(
            args.address,
            admin,
            args.step_trace_file,
            args.calibration_output_len,
            args.seed,
            args.calibration_timeout,
            log,
        )
    except grpc.RpcError as exc:
        from chunkserve.client import rpc_error_line

        raise ValueError(rpc_error_line(exc, args.address, "chunkserve.v1.Generation")) from None
    if cal.failed:
        print(f"warning: {cal.failed} of {cal.num_requests} calibration requests failed", file=out)
    print(
        f"calibration: {cal.num_requests} requests in {len(cal.waves)} waves, {len(cal.lines)} steps traced, "
        f"{cal.seconds:.1f} s",
        file=out,
    )
    if args.save_trace:
        path = args.save_trace
    else:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="chunkserve-calibration-", suffix=".jsonl")
        os.close(fd)
    save_lines(cal.lines, path)
    if args.save_trace:
        print(f"step trace saved: {path} (later: chunkserve tune --trace {path} --requests ...)", file=out)
    return path


def run_tune(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    if problem := _check(args):
        print(f"chunkserve tune: {problem}", file=sys.stderr)
        return 2
    try:
        slo = parse_slo(args.slo)
        cost_trace = _run_calibration(args, out) if args.calibrate else args.trace
        steps = load_trace(cost_trace, args.target)
        model, med, p90, n_test = fit_with_error(steps)
    except (OSError, ValueError) as exc:
        print(f"chunkserve tune: {exc}", file=sys.stderr)
        return 2
    source = "calibration" if args.calibrate else cost_trace
    print(f"cost model ({len(steps)} steps of {source}, target {args.target}): {model.describe()}", file=out)
    print(f"fit error on {n_test} held-out steps: median {med:.1%}, P90 {p90:.1%}", file=out)
    log_path = args.requests or args.trace
    if log_path is None:  # a calibration alone: the model is the result
        print("no request log (--requests or --trace): nothing to replay", file=out)
        return 0
    try:
        specs, info = load_requests(log_path)
    except (OSError, ValueError) as exc:
        print(f"chunkserve tune: {exc}", file=sys.stderr)
        return 2
    print(f"request log: {len(specs)} requests over {max((s.arrival for s in specs), default=0):.1f} s", file=out)
    groups = {s.prefix_group for s in specs if s.prefix_group is not None}
    if groups:
        shared = sum(s.prefix_group is not None for s in specs)
        print(f"shared prefixes: {len(groups)} groups, {shared} requests", file=out)
    block_size = args.block_size or int(info.get("block_size") or 16)
    max_model_len = args.max_model_len or info.get("max_model_len") or None
    max_num_seqs = args.max_num_seqs or int(info.get("max_num_seqs") or 128)
    default_blocks = info.get("num_device_blocks") or (
        sum(-(-(s.prompt_len + s.output_len) // block_size) for s in specs) + 1
    )
    kv = _ints(args.num_blocks) if args.num_blocks else [None]
    grid = itertools.product(
        _ints(args.budgets),
        _ints(args.max_num_partial_prefills),
        _ints(args.max_long_partial_prefills),
        _ints(args.long_prefill_token_threshold),
        [p.strip() for p in args.policy.split(",") if p.strip()],
        kv,
        _targets(args.target_itl_ms),
    )
    rows: list[tuple[Setting, dict, float]] = []
    for budget, pp, lp, thr, policy, blocks, target in grid:
        setting = Setting(budget, pp, lp, thr, policy, blocks, target)
        try:
            config = replace(
                SchedulerConfig(),
                max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs,
                max_num_partial_prefills=pp,
                max_long_partial_prefills=lp,
                long_prefill_token_threshold=thr,
                scheduling_policy=policy,
                target_itl_ms=target,
            )
            started = time.perf_counter()
            summaries = []
            for k in range(args.repeats if args.noise == "resample" else 1):
                cost = model.noisy(args.seed + k) if args.noise == "resample" else model.predict
                result = replay(specs, config, cost, blocks or int(default_blocks), block_size, max_model_len)
                summaries.append(summarize(result))
        except (ValueError, RuntimeError) as exc:
            print(f"skipped {setting.label()}: {exc}", file=out)
            continue
        rows.append((setting, average(summaries), time.perf_counter() - started))
    print(_table(rows), file=out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{"setting": s.flags(), **m} for s, m, _ in rows], f, indent=1)
    pairs = [(s, m) for s, m, _ in rows]
    if slo:
        feasible = [s.label() for s, m in pairs if meets(m, slo)]
        print(f"meet the SLO ({' '.join(args.slo)}): {', '.join(feasible) or 'none'}", file=out)
    choice = best(pairs, slo)
    if args.plot and pairs:
        from chunkserve.tune.plot import plot_tradeoff

        print(f"plot: {plot_tradeoff(pairs, slo, choice[0] if choice else None, args.plot, meets)}", file=out)
    if choice is None:
        print("no setting meets the SLO: relax it, or widen the grid", file=out)
        return 1
    print(f"recommended: chunkserve serve {choice[0].flags()}", file=out)
    return 0
