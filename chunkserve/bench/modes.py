"""The bench's three modes — one run, --compare, --capacity — plus the optional HF baseline.

Each mode returns an Outcome: the JSON document, the tables to print and the reports to
plot. Servers the bench starts itself run one at a time and are always stopped.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from chunkserve.bench import arrivals as arrivals_mod
from chunkserve.bench.report import pooled_report, ratios
from chunkserve.bench.session import RunOptions, run_once
from chunkserve.bench.table import comparison_table, run_table
from chunkserve.bench.workloads import BenchRequest

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything a mode needs, built once from the command line."""

    requests: list[BenchRequest]
    arrivals: list[float]
    opts: RunOptions
    percentiles: list[float]
    slos: dict[str, float]
    server_args: str  # common flags of the servers the bench starts
    address: str | None  # a running server instead
    admin_address: str | None
    log_dir: Path | None
    seed: int
    burstiness: float


@dataclass
class Outcome:
    doc: dict
    tables: list[str] = field(default_factory=list)
    plots: list[tuple[str, dict]] = field(default_factory=list)


@contextlib.contextmanager
def target(plan: Plan) -> Iterator[tuple[str, str | None]]:
    """(address, admin address) of the server to measure: the given one, or one started here."""
    if plan.address:
        yield plan.address, plan.admin_address
        return
    from chunkserve.bench.servers import launch
    from chunkserve.bench.session import server_target

    log.warning("starting a server: %s", plan.server_args or "(default flags)")
    server, admin = launch(_log_dir(plan) / "server", plan.server_args)
    try:
        yield server_target(server, plan.opts.backend), admin
    finally:
        server.stop()


def _log_dir(plan: Plan) -> Path:
    if plan.log_dir is None:
        plan.log_dir = Path(tempfile.mkdtemp(prefix="chunkserve-bench-"))
    return plan.log_dir


def single(plan: Plan) -> Outcome:
    with target(plan) as (address, admin):
        run = run_once(address, plan.requests, plan.arrivals, plan.opts, admin)
    report = pooled_report([run], plan.percentiles, plan.slos)
    return Outcome(dict(report), [run_table(report, plan.percentiles)], [("chunkserve", report)])


def compare(plan: Plan, variants: Sequence[str], rounds: int) -> Outcome:
    from chunkserve.bench.compare import configs_from, run_compare

    configs = configs_from(plan.server_args, variants)
    runs = run_compare(configs, rounds, plan.requests, plan.arrivals, plan.opts, _log_dir(plan))
    reports = {c.name: pooled_report(runs[c.name], plan.percentiles, plan.slos) for c in configs}
    for c in configs:
        reports[c.name] = {"server_args": list(c.args), **reports[c.name]}
    base = configs[0].name
    doc = {
        "configs": reports,
        "rounds": rounds,
        "ratios": {f"{c.name}/{base}": ratios(reports[base], reports[c.name]) for c in configs[1:]},
    }
    tables = [
        run_table(reports[c.name], plan.percentiles, f"config {c.name}: {c.command_line or '(defaults)'}")
        for c in configs
    ]
    tables.append(
        comparison_table(
            [(c.name, reports[c.name]) for c in configs],
            title=f"{len(configs)} configurations x {rounds} rounds, pooled",
        )
    )
    return Outcome(doc, tables, [(c.name, reports[c.name]) for c in configs])


def capacity(
    plan: Plan, slo_p99_tbt_ms: float, max_median_queue_ms: float, start_rate: float, max_probes: int
) -> Outcome:
    from chunkserve.bench.capacity import calibrate_prefill, make_probe, search_capacity

    def arrivals_for(rate: float) -> list[float]:
        return arrivals_mod.arrival_times(len(plan.requests), rate, plan.burstiness, plan.seed)

    with target(plan) as (address, admin):
        if admin is None:
            log.warning(
                "no admin address: the prefix cache is not emptied between probes, which send the "
                "same prompts (pass --admin-address)"
            )
        warm = replace(plan.opts, progress=False)
        check = run_once(address, plan.requests[:1], [0.0], warm, admin)  # warm-up; is the trace there?
        probe_trace = bool(check.first_scheduled)
        prefill = None if probe_trace else calibrate_prefill(address, plan.requests, plan.opts)
        probe = make_probe(
            address,
            admin,
            plan.requests,
            arrivals_for,
            plan.opts,
            plan.percentiles,
            plan.slos,
            slo_p99_tbt_ms,
            max_median_queue_ms,
            prefill,
        )
        best, probes = search_capacity(probe, start_rate, max_probes)
    how = (
        "measured: first step that computed the request (step trace) - send"
        if probe_trace
        else "estimated: TTFT - the prompt's lone prefill time (calibrated, linear in length); errs high"
    )
    above = min((p.rate for p in probes if not p.feasible and (best is None or p.rate > best)), default=None)
    doc = {
        "capacity": {
            "request_rate": best,
            "first_infeasible_rate": above,
            "slo_p99_tbt_ms": slo_p99_tbt_ms,
            "max_median_queue_ms": max_median_queue_ms,
            "queue_delay": how,
            "prefill_calibration_s": list(zip(prefill.lengths, prefill.times)) if prefill else None,
            "probes": [
                {
                    "request_rate": p.rate,
                    "p99_tbt_ms": p.p99_tbt_ms,
                    "median_queue_ms": p.median_queue_ms,
                    "feasible": p.feasible,
                    "report": p.report,
                }
                for p in probes
            ],
        }
    }
    lines = [
        " capacity search ".center(72, "="),
        f"{'rate (req/s)':>14}{'P99 TBT ms':>14}{'queue ms (*)':>18}{'completed':>12}{'verdict':>14}",
    ]
    for p in sorted(probes, key=lambda p: p.rate):
        lines.append(
            f"{p.rate:14.3f}{p.p99_tbt_ms:14.1f}{p.median_queue_ms:18.1f}{p.report['completed']:12d}"
            f"{'ok' if p.feasible else 'over SLO':>14}"
        )
    verdict = f"{best:.3f} req/s" if best is not None else "none (the lowest probed rate already fails)"
    verdict += f", over the SLOs at {above:.3f}" if above is not None else ", no probed rate failed"
    lines += [
        f"capacity: {verdict}  (P99 TBT <= {slo_p99_tbt_ms} ms, queue <= {max_median_queue_ms} ms)",
        f"(*) median scheduling delay of the worst request class; {how}",
        "=" * 72,
    ]
    return Outcome(doc, ["\n".join(lines)])


def add_hf_baseline(outcome: Outcome, plan: Plan, model_folder: Path, dtype: str, device: str, batch_size: int) -> None:
    """Runs HF generate on the same workload; adds its report and engine/HF ratios."""
    from chunkserve.bench.hf_baseline import run_hf_baseline

    run = run_hf_baseline(
        model_folder, dtype, plan.requests, plan.arrivals, batch_size, plan.opts.progress, plan.opts.num_warmups, device
    )
    hf = pooled_report([run], plan.percentiles, plan.slos)
    outcome.doc["hf_baseline"] = hf
    engines = list(outcome.doc["configs"].items()) if "configs" in outcome.doc else [("chunkserve", outcome.doc)]
    outcome.doc["ratios_vs_hf"] = {f"{name}/HF": ratios(hf, rep) for name, rep in engines}
    outcome.tables.append(run_table(hf, plan.percentiles, f"HF generate, static batches of {batch_size}"))
    outcome.tables.append(comparison_table([("HF", hf)] + engines, title="engine vs HF generate, same workload"))
    outcome.plots.append(("HF", hf))
