"""The public chunkserve.v1 servicer: protobuf in, domain objects to the engine, protobuf out.

Thin on purpose: validation lives in validation.py, scheduling in the engine. Errors leave
as status codes; a stream that ends for any reason — finished, cancelled, deadline,
disconnect — aborts its request in `finally`, so nothing keeps running for nobody.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

import grpc

from chunkserve.v1 import chunkserve_pb2 as pb
from chunkserve.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.engine import Engine, RequestStream, StreamDelta
from scheduler_svc.errors import ServingError, UnavailableError
from scheduler_svc.validation import Limits, sampling_params, tokenize_prompt

log = logging.getLogger(__name__)


def merge(into: StreamDelta, delta: StreamDelta) -> StreamDelta:
    """Folds a later delta into an earlier one (a slow reader gets fewer, larger messages)."""
    into.token_ids += delta.token_ids
    into.text += delta.text
    into.logprobs += delta.logprobs
    if delta.finished or delta.error is not None:
        tokens, text, logprobs = into.token_ids, into.text, into.logprobs
        into = delta
        into.token_ids, into.text, into.logprobs = tokens, text, logprobs
    return into


def delta_to_proto(request_id: str, client_id: str, d: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, token_ids=d.token_ids, text=d.text,
                              finished=d.finished, client_request_id=client_id)
    for lp in d.logprobs:
        msg.logprobs.append(pb.Logprobs(logprob=lp.logprob, top=[
            pb.TokenLogprob(token_id=t, logprob=v, text=s) for t, v, s in lp.top]))
    if d.finished:
        msg.finish_reason = d.finish_reason.value if d.finish_reason else 0
        msg.matched_stop = d.matched_stop or ""
        if d.matched_stop_token_id is not None:
            msg.matched_stop_token_id = d.matched_stop_token_id
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                                    cached_tokens=d.cached_tokens))
    return msg


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves chunkserve.v1.Generation once the engine is ready (UNAVAILABLE before)."""

    def __init__(self, get_engine: Callable[[], tuple[Engine, Limits, pb.GetInfoResponse] | None]) -> None:
        self._get_engine = get_engine

    def _ready(self) -> tuple[Engine, Limits, pb.GetInfoResponse]:
        state = self._get_engine()
        if state is None:
            raise UnavailableError("the server is loading or draining")
        if state[0].is_dead:
            raise UnavailableError("the executor is unavailable")
        return state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            engine, limits, _ = self._ready()
            prompt = tokenize_prompt(request, engine.tokenizer, limits)
            params = sampling_params(request, len(prompt), limits)
            stream = engine.add_request(prompt, params, request.cache_salt or None,
                                        request.priority, request.tenant)
        except ServingError as exc:
            await context.abort(exc.code, str(exc))
            return
        try:
            async for delta in _deltas(stream):
                if delta.error is not None:
                    await context.abort(delta.error.code, str(delta.error))
                yield delta_to_proto(stream.request_id, request.client_request_id, delta)
        finally:
            if not stream.finished:
                engine.abort(stream.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        state = self._get_engine()
        return pb.AbortResponse(found=state is not None and state[0].abort(request.request_id))

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        try:
            engine, _, static = self._ready()
        except ServingError as exc:
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises
        info = pb.GetInfoResponse()
        info.CopyFrom(static)
        sched = engine.scheduler
        info.max_num_batched_tokens = sched.config.max_num_batched_tokens
        info.max_num_seqs = sched.config.max_num_seqs
        info.enable_chunked_prefill = sched.config.enable_chunked_prefill
        info.num_free_device_blocks = sched.pool.num_free_blocks
        info.num_requests_running = len(sched.running)
        info.num_requests_waiting = len(sched.waiting) + len(sched.swapped)
        return info


async def _deltas(stream: RequestStream) -> AsyncIterator[StreamDelta]:
    """Yields merged deltas until the final one."""
    while True:
        delta = await stream.queue.get()
        while not stream.queue.empty() and not (delta.finished or delta.error):
            delta = merge(delta, stream.queue.get_nowait())
        yield delta
        if delta.finished or delta.error is not None:
            return
