"""One measured run against one server: check, warm up, empty the prefix cache, trace, send.

This is the unit every mode repeats: a plain run does it once, --compare once per
configuration and round, --capacity once per probed rate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from chunkserve.bench.admin import reset_prefix_cache
from chunkserve.bench.runner import RunResult, get_info, run_requests
from chunkserve.bench.trace import StepTraceWatcher
from chunkserve.bench.workloads import BenchRequest

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    """How requests are sent (the workload itself is fixed by the caller)."""

    max_concurrency: int | None = None
    num_warmups: int = 1
    timeout: float | None = None
    progress: bool = True
    stall_timeout: float = 600.0
    trace: bool = False  # subscribe to the step trace (needs an admin address)
    reset_prefix_cache: bool = True  # before each measured run (needs an admin address)
    backend: str = "grpc"  # or "openai": the HTTP API of the servers the bench starts


def server_target(server, backend: str) -> str:
    """The address the runner sends to for a started server: its gRPC `host:port`, or its
    OpenAI-compatible HTTP API as `http://host:port`."""
    return f"http://127.0.0.1:{server.http_port}" if backend == "openai" else server.address


@dataclass
class Run:
    """A finished run: the request records, the step trace, and the server's description."""

    result: RunResult
    server_info: dict
    steps: list[dict] = field(default_factory=list)
    trace_error: str = ""
    first_scheduled: dict[str, float] = field(default_factory=dict)  # request id -> seconds from start


def check_workload(requests: Sequence[BenchRequest], info) -> None:
    """Warns about requests the server will refuse (they still run and count as failed)."""
    too_long = sum(len(r.prompt_ids) + r.output_len > info.max_model_len for r in requests)
    if too_long:
        log.warning(
            "%d of %d requests exceed the server's max_model_len %d (prompt + output): they will "
            "fail with INVALID_ARGUMENT",
            too_long,
            len(requests),
            info.max_model_len,
        )
    top = max((max(r.prompt_ids) for r in requests if r.prompt_ids), default=0)
    if info.vocab_size and top >= info.vocab_size:
        log.warning(
            "token id %d >= the server's vocab_size %d: is --tokenizer the served model's?", top, info.vocab_size
        )


def _info_dict(info) -> dict:
    keys = (
        "model_name",
        "max_model_len",
        "vocab_size",
        "dtype",
        "block_size",
        "num_device_blocks",
        "max_num_batched_tokens",
        "max_num_seqs",
        "enable_chunked_prefill",
        "attention_backend",
        "version",
    )
    return {k: getattr(info, k) for k in keys}


def warmup_requests(requests: Sequence[BenchRequest], n: int) -> list[BenchRequest]:
    """Like the first n requests, uncounted: same lengths, reversed ids (so they seed no prefix
    cache entry a measured request could hit), at most 8 output tokens."""
    return [
        replace(r, index=-1 - i, prompt_ids=r.prompt_ids[::-1], output_len=min(r.output_len, 8), prefix_group=None)
        for i, r in enumerate(requests[:n])
    ]


async def _run(
    address: str,
    admin_address: str | None,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    opts: RunOptions,
    desc: str,
) -> Run:
    info = await get_info(address)
    check_workload(requests, info)
    if opts.num_warmups:
        warm = warmup_requests(requests, opts.num_warmups)
        await run_requests(
            address, warm, [0.0] * len(warm), timeout=opts.timeout, progress=False, stall_timeout=opts.stall_timeout
        )
    if admin_address and opts.reset_prefix_cache:
        await reset_prefix_cache(admin_address)
    watcher = StepTraceWatcher(admin_address if opts.trace else None)
    await watcher.start()
    try:
        result = await run_requests(
            address,
            requests,
            arrivals,
            max_concurrency=opts.max_concurrency,
            timeout=opts.timeout,
            progress=opts.progress,
            desc=desc,
            stall_timeout=opts.stall_timeout,
        )
    finally:
        await watcher.stop()
    if watcher.error:
        log.warning("step trace unavailable (%s): no tokens-per-step plot", watcher.error)
    return Run(
        result,
        _info_dict(info),
        watcher.steps(result.start_wall),
        watcher.error,
        watcher.first_scheduled(result.start_wall),
    )


def run_once(
    address: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    opts: RunOptions,
    admin_address: str | None = None,
    desc: str = "requests",
) -> Run:
    """Runs the workload once against `address` (blocking; its own event loop)."""
    return asyncio.run(_run(address, admin_address, requests, arrivals, opts, desc))
