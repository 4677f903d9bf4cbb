"""`chunkserve tune --calibrate`: a short designed run against a server, for the cost model.

The cost model (scheduler_svc/step_cost.py) is a linear fit of step time on prefill tokens,
decode tokens, decode context and prefill attention. Real traffic often leaves some of them
hardly varied (a chat service's steps all look alike), which a least-squares fit cannot
separate. This run spreads them on purpose, with the bench's runner (chunkserve/bench/runner.py)
sending the requests, in waves one after the other:

    prefill    one request at a time, prompts from 16 tokens to 4 x the token budget and back
               down, 2 tokens out: steps of one chunk of every size, and (past the budget) later chunks that
               attend to what earlier ones computed
    decode     c = 1, 4, 16, 64 requests at once with short prompts: steps of c decodes
    context    c = 1, 8 requests with long prompts: decodes that read a long context
    mixed      8 decoding requests while prompts of 1/2, 1 and 2 budgets arrive: steps that
               carry both (what chunked prefill is about)

Counts are capped by the server's max_num_seqs and KV pool so nothing is preempted, prompts by
its max_model_len. Prompts are random token ids (no prefix-cache hits; the cache is emptied
first when the Admin service is reachable). The step trace is taken from Admin.WatchSteps
(chunkserve/bench/trace.py) or, when that is not reachable, from the server's own
--step-trace-file (the lines it appended during the run; same host).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from chunkserve.bench.admin import reset_prefix_cache
from chunkserve.bench.runner import RunResult, get_info, run_requests
from chunkserve.bench.trace import StepTraceWatcher
from chunkserve.bench.workloads import BenchRequest

FIRST_ID = 100  # random prompt ids start here (clear of the special tokens at the vocabulary's start)


@dataclass(frozen=True, slots=True)
class Wave:
    """Requests sent together (arrival offsets in seconds from the wave's start)."""

    name: str
    requests: list[BenchRequest]
    arrivals: list[float]


@dataclass(frozen=True, slots=True)
class Limits:
    """What the design is sized to (from the server's GetInfo)."""

    budget: int = 512
    max_model_len: int = 2048
    max_num_seqs: int = 128
    kv_tokens: int = 1 << 20
    vocab_size: int = 32000

    @classmethod
    def from_info(cls, info) -> Limits:
        kv = info.num_device_blocks * info.block_size if info.num_device_blocks and info.block_size else 1 << 20
        return cls(
            info.max_num_batched_tokens or 512,
            info.max_model_len or 2048,
            info.max_num_seqs or 128,
            kv,
            info.vocab_size or 32000,
        )


class _Ids:
    """Random prompts; each request's ids are its own, so no two share a cached block. The ids
    differ from run to run too (unless `fixed`), so a second calibration on a server whose
    prefix cache could not be emptied finds nothing of the first one's cached."""

    def __init__(self, vocab_size: int, seed: int, fixed: bool = False) -> None:
        self.rng = random.Random(f"calibrate-{seed}" if fixed else f"calibrate-{seed}-{time.time_ns()}")
        self.top = max(FIRST_ID + 2, min(vocab_size, 50_000))
        self.index = 0

    def request(self, prompt_len: int, output_len: int, cls: str) -> BenchRequest:
        self.index += 1
        ids = tuple(self.rng.randrange(FIRST_ID, self.top) for _ in range(prompt_len))
        return BenchRequest(self.index, ids, output_len, cls)


def design(
    limits: Limits, output_len: int = 32, seed: int = 0, step_seconds: float | None = None, fixed_ids: bool = False
) -> list[Wave]:
    """The calibration waves (see the module docstring). `step_seconds`: a measured decode
    step time, to space the mixed wave's prompts over its decodes (default: all at once)."""
    ids = _Ids(limits.vocab_size, seed, fixed_ids)
    out_len = max(2, output_len)
    room = limits.max_model_len - out_len - 1  # longest prompt the server accepts
    if room < 8:
        raise ValueError(f"max_model_len {limits.max_model_len} leaves no room for a calibration prompt")
    kv = int(limits.kv_tokens * 0.8)  # stay clear of preemption

    def fit_count(c: int, tokens_each: int) -> int:
        return max(1, min(c, limits.max_num_seqs, kv // max(1, tokens_each)))

    waves: list[Wave] = []
    b = limits.budget
    sizes = sorted({min(room, n) for n in (16, 64, b // 4, b // 2, b, 2 * b, 4 * b) if n >= 1})
    for n in sizes + sizes[::-1]:  # up and down again: slow drift of the machine falls on all sizes alike
        waves.append(Wave(f"prefill {n}", [ids.request(n, 2, "prefill")], [0.0]))
    short = min(32, room)
    for want in (1, 4, 16, 64):
        c = fit_count(want, short + out_len)
        waves.append(Wave(f"decode x{c}", [ids.request(short, out_len, "decode") for _ in range(c)], [0.0] * c))
        if c < want:  # capped: a bigger count would be the same wave again
            break
    long_ctx = min(room, max(4 * b, 1024))
    for c in sorted({fit_count(c, long_ctx + out_len) for c in (1, 8)}):
        waves.append(
            Wave(f"context {long_ctx} x{c}", [ids.request(long_ctx, out_len, "context") for _ in range(c)], [0.0] * c)
        )
    c = fit_count(8, short + out_len)
    decoders = [ids.request(short, out_len, "decode") for _ in range(c)]
    prompts = [ids.request(min(room, n), 2, "prefill") for n in (max(1, b // 2), b, 2 * b)]
    gap = (step_seconds or 0.0) * out_len / (len(prompts) + 1)
    arrivals = [0.0] * c + [gap * (k + 1) for k in range(len(prompts))]
    waves.append(Wave(f"mixed x{c}", decoders + prompts, arrivals))
    return waves


def _trace_lines(traces) -> list[str]:
    return [json_format.MessageToJson(t, indent=None) for t in traces]


def _median_itl(result: RunResult) -> float | None:
    gaps = sorted(b - a for r in result.records for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    return gaps[len(gaps) // 2] if gaps else None


@dataclass
class Calibration:
    """A finished calibration: the step trace as JSON lines, and what was sent."""

    lines: list[str]
    waves: list[str]
    num_requests: int
    failed: int
    seconds: float


async def _calibrate(
    address: str,
    admin_address: str | None,
    step_trace_file: str | None,
    output_len: int,
    seed: int,
    timeout: float,
    log,
) -> Calibration:
    info = await get_info(address)
    limits = Limits.from_info(info)
    started = time.perf_counter()
    # Warm up (first forward passes, allocations), then start with an empty prefix cache.
    warm = _Ids(limits.vocab_size, seed + 1)
    probe = await run_requests(
        address,
        [warm.request(min(32, limits.max_model_len // 4), 8, "warm-up")],
        [0.0],
        progress=False,
        stall_timeout=timeout,
    )
    step = _median_itl(probe)
    if admin_address:
        await reset_prefix_cache(admin_address)
    offset = os.path.getsize(step_trace_file) if step_trace_file and os.path.exists(step_trace_file) else 0
    watcher = StepTraceWatcher(None if step_trace_file else admin_address)
    await watcher.start()
    if not step_trace_file and (watcher.error or not admin_address):
        await watcher.stop()
        raise ValueError(
            f"could not watch the step trace at {admin_address or '(no --admin-address)'}: "
            f"{watcher.error or 'no address'}; pass --admin-address HOST:PORT (the server's --admin-port), or start "
            "the server with --step-trace-file PATH and pass the same --step-trace-file PATH here"
        )
    names: list[str] = []
    total = failed = 0
    try:
        for wave in design(limits, output_len, seed, step):
            log(f"calibration: {wave.name} ({len(wave.requests)} requests)")
            result = await run_requests(
                address, wave.requests, wave.arrivals, progress=False, desc=wave.name, stall_timeout=timeout
            )
            names.append(wave.name)
            total += len(result.records)
            failed += sum(not r.ok for r in result.records)
    finally:
        await watcher.stop()
    if step_trace_file:
        await asyncio.sleep(0.2)  # the last step's line
        with open(step_trace_file) as f:
            f.seek(offset)
            lines = [line.strip() for line in f if line.strip()]
    else:
        if watcher.error and "CANCELLED" not in watcher.error:
            raise ValueError(f"the step trace stream ended early: {watcher.error}")
        lines = _trace_lines(watcher.traces)
    return Calibration(lines, names, total, failed, time.perf_counter() - started)


def calibrate(
    address: str,
    admin_address: str | None,
    step_trace_file: str | None = None,
    output_len: int = 32,
    seed: int = 0,
    timeout: float = 120.0,
    log=print,
) -> Calibration:
    """Runs the calibration against `address` (blocking, its own event loop)."""
    return asyncio.run(_calibrate(address, admin_address, step_trace_file, output_len, seed, timeout, log))


def save_lines(lines: list[str], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(line + "\n" for line in lines))
