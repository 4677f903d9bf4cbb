"""Sends a workload to a running server and records every request's timeline.

Two backends send the same requests. `grpc` (an address `host:port`): one grpc.aio channel,
each request streams `Generation.Generate`. `openai` (an address `http://host:port`): one
HTTP/1.1 client (httpx), each request streams `POST /v1/completions` as server-sent events
with `return_token_ids` (vLLM's extra parameter: every event names the tokens it carries, so
token counts and inter-token gaps are exact, not re-tokenized text) and
`stream_options.include_usage`. One task per request: the task sleeps until the request's
arrival offset, waits for a --max-concurrency slot if there is a limit, then sends the
prompt as token ids, greedy, `max_tokens` = the request's output length and `ignore_eos`,
so output lengths are exact. Times are
`time.perf_counter()` seconds from the start of the run, all taken in this process:

    arrival  scheduled send time (from arrivals.py)
    send     when the call was made (later than arrival only while waiting for a slot)
    chunks   arrival time of every stream message that carried tokens, and how many
    end      when the last message (the one with `finished`) arrived

The server sends one message (gRPC) or event (HTTP) per step that produced output, so a
message normally holds one token; when it holds more (several steps' tokens coalesced in the
stream), the gap before it counts as one inter-token latency, as `vllm bench serve` counts a
chunk. Messages without tokens (a first message, the usage event) are not chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from chunkserve.bench.workloads import BenchRequest
from chunkserve.client import build_request
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in seconds from the start of the run)."""

    index: int
    cls: str
    input_len: int
    expected_output_len: int
    arrival: float
    send: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    request_id: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error_code: str = ""  # gRPC status name when the call failed, else ""
    error: str = ""
    prefix_group: int | None = None  # the workload's shared prefix (BenchRequest), if any
    prefix_len: int = 0

    @property
    def ok(self) -> bool:
        return not self.error_code and self.end is not None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


@dataclass
class RunResult:
    """The records of one run plus the clocks needed to line them up with server traces."""

    records: list[RequestRecord]
    duration: float  # start of the run -> last request finished, seconds
    start_wall: float  # time.time() at the start of the run (offset 0)


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr, or a do-nothing stand-in when disabled or tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:  # the `bench` extra is not installed: run without a bar
        enabled = False
    if not enabled:

        class _Null:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...

        return _Null()
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="req", dynamic_ncols=True)


async def _one(
    stub: pb_grpc.GenerationStub,
    req: BenchRequest,
    rec: RequestRecord,
    t0: float,
    slots: asyncio.Semaphore | None,
    timeout: float | None,
) -> None:
    await asyncio.sleep(max(0.0, t0 + rec.arrival - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    try:
        request = build_request(list(req.prompt_ids), temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        request.client_request_id = str(req.index)
        rec.send = time.perf_counter() - t0
        async for msg in stub.Generate(request, timeout=timeout):
            now = time.perf_counter() - t0
            rec.request_id = msg.request_id
            if msg.token_ids:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(msg.token_ids))
            if msg.finished:
                rec.end = now
                rec.finish_reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_")
                rec.prompt_tokens = msg.usage.prompt_tokens
                rec.cached_tokens = msg.usage.cached_tokens
        if rec.end is None:
            rec.error_code, rec.error = "INCOMPLETE", "the stream ended without a finished message"
    except grpc.aio.AioRpcError as exc:
        rec.error_code, rec.error = exc.code().name, exc.details() or ""
    finally:
        if slots is not None:
            slots.release()


def is_http(address: str) -> bool:
    """An `http(s)://` address is the OpenAI-compatible HTTP API; anything else is gRPC."""
    return address.startswith(("http://", "https://"))


async def _one_openai(
    client,  # httpx.AsyncClient
    base: str,
    req: BenchRequest,
    rec: RequestRecord,
    t0: float,
    slots: asyncio.Semaphore | None,
    timeout: float | None,
) -> None:
    """Like _one, over POST /v1/completions streamed as server-sent events."""
    import httpx

    await asyncio.sleep(max(0.0, t0 + rec.arrival - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    body = {
        "prompt": list(req.prompt_ids),
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    try:
        rec.send = time.perf_counter() - t0
        async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                rec.error_code, rec.error = f"HTTP_{resp.status_code}", text
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                event = json.loads(data)
                if "error" in event:
                    rec.error_code, rec.error = f"HTTP_{event['error'].get('code')}", event["error"].get("message", "")
                    return
                rec.request_id = event.get("id", "").removeprefix("cmpl-")
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"]["prompt_tokens"]
                    rec.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in event.get("choices") or ():
                    if choice.get("token_ids"):
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(len(choice["token_ids"]))
                    if choice.get("finish_reason"):
                        rec.end = now
                        rec.finish_reason = choice["finish_reason"].upper()
        if rec.end is None and not rec.error_code:
            rec.error_code, rec.error = "INCOMPLETE", "the stream ended without a finish_reason"
    except httpx.TimeoutException as exc:
        rec.error_code, rec.error = "DEADLINE_EXCEEDED", str(exc) or type(exc).__name__
    except httpx.HTTPError as exc:
        rec.error_code, rec.error = "UNAVAILABLE", str(exc) or type(exc).__name__
    finally:
        if slots is not None:
            slots.release()


class StalledError(RuntimeError):
    """Requests are in flight but nothing has been sent or received for too long."""


async def _watchdog(records: list[RequestRecord], t0: float, stall_timeout: float) -> None:
    """Raises StalledError when no request was sent or streamed anything for stall_timeout s.

    A hung server would otherwise hang the bench (and every --compare / --capacity run
    after it) forever; a live server fails its own stuck steps well before this.
    """
    while True:
        await asyncio.sleep(min(1.0, stall_timeout / 4))
        if not any(r.send is not None and r.end is None and not r.error_code for r in records):
            continue
        last = max(max(r.send or 0.0, r.chunk_times[-1] if r.chunk_times else 0.0, r.end or 0.0) for r in records)
        if time.perf_counter() - t0 - last > stall_timeout:
            raise StalledError(
                f"no token for {stall_timeout:.0f} s with requests in flight: is the server "
                "stuck? (see its log; --stall-timeout changes the limit)"
            )


async def run_requests(
    address: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    *,
    max_concurrency: int | None = None,
    timeout: float | None = None,
    progress: bool = True,
    desc: str = "requests",
    stall_timeout: float = 600.0,
) -> RunResult:
    """Sends `requests` at their `arrivals` offsets and waits for all of them to finish
    (over HTTP when `address` is an `http://` URL, see the module docstring)."""
    records = [
        RequestRecord(
            r.index, r.cls, len(r.prompt_ids), r.output_len, a, prefix_group=r.prefix_group, prefix_len=r.prefix_len
        )
        for r, a in zip(requests, arrivals)
    ]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(len(records), desc, progress)
    async with contextlib.AsyncExitStack() as stack:
        if is_http(address):
            import httpx

            # No pool limit: --max-concurrency is the only cap, as on the gRPC channel.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            client = await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=None))
            base = address.rstrip("/")
            send = lambda req, rec: _one_openai(client, base, req, rec, t0, slots, timeout)  # noqa: E731
        else:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS))
            stub = pb_grpc.GenerationStub(channel)
            send = lambda req, rec: _one(stub, req, rec, t0, slots, timeout)  # noqa: E731
        start_wall, t0 = time.time(), time.perf_counter()

        async def tracked(req: BenchRequest, rec: RequestRecord) -> None:
            try:
                await send(req, rec)
            finally:
                bar.update(1)

        work = asyncio.ensure_future(asyncio.gather(*(tracked(r, rec) for r, rec in zip(requests, records))))
        watchdog = asyncio.ensure_future(_watchdog(records, t0, stall_timeout))
        try:
            await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancel what is left and let it unwind while the channel is open: a grpc.aio
            # call cancelled as its loop closes leaves the interpreter in a bad state.
            for task in (watchdog, work):
                task.cancel()
            await asyncio.gather(watchdog, work, return_exceptions=True)
            bar.close()
        if not watchdog.cancelled() and watchdog.exception() is not None:
            raise watchdog.exception()  # StalledError
        work.result()
        duration = time.perf_counter() - t0
    return RunResult(records, duration, start_wall)


async def get_info(address: str, timeout: float = 10.0) -> pb.GetInfoResponse:
    """The server's GetInfo (model, limits), to check a workload before sending it.

    Over HTTP only `GET /v1/models` is there: the model name and max_model_len are filled in,
    the rest stays unset (0 / empty)."""
    if is_http(address):
        import httpx

        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(f"{address.rstrip('/')}/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]
        return pb.GetInfoResponse(model_name=model["id"], max_model_len=model.get("max_model_len", 0))
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=timeout)
