"""The public chunkserve.v1 servicer: protobuf in, domain objects to the engine, protobuf out.

Thin on purpose: validation lives in validation.py, scheduling in the engine. Errors leave
as status codes; a stream that ends for any reason — finished, cancelled, deadline,
disconnect — aborts its request in `finally`, so nothing keeps running for nobody.

Nothing here blocks the event loop on one request: text and chat prompts are tokenized in a
worker thread (the tokenizer releases the GIL), so health checks and other streams keep
being answered while a long prompt is encoded. Requests that cannot be valid are refused
before work proportional to their size: see `add_generation_servicer` and validation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.errors import ServingError, UnavailableError
from scheduler_svc.output import RequestStream, StreamDelta, TokenLogprobs, stream_deltas
from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import (
    Limits,
    bad_words_token_ids,
    check_client_request_id,
    check_known_fields,
    needs_tokenizer,
    sampling_params,
    structured_constraint,
    tokenize_prompt,
)

log = logging.getLogger(__name__)


def delta_to_proto(request_id: str, d: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=d.token_ids,
        text=d.text,
        finished=d.finished,
        logprobs=[_logprobs(lp) for lp in d.logprobs],
        prompt_logprobs=[_logprobs(lp) for lp in d.prompt_logprobs],
        prompt_token_ids=d.prompt_token_ids,
    )
    if d.finished:
        msg.finish_reason = d.finish_reason.value if d.finish_reason else 0
        msg.matched_stop = d.matched_stop or ""
        if d.matched_stop_token_id is not None:
            msg.matched_stop_token_id = d.matched_stop_token_id
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens, cached_tokens=d.cached_tokens
            )
        )
    return msg


def _logprobs(lp: TokenLogprobs) -> pb.Logprobs:
    top = [pb.TokenLogprob(token_id=t, logprob=v, text=s) for t, v, s in lp.top]
    return pb.Logprobs(logprob=lp.logprob, top=top, rank=lp.rank)


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves chunkserve.v1.Generation once the engine is ready (UNAVAILABLE before)."""

    def __init__(self, get_engine: Callable[[], tuple[Engine, Limits, pb.GetInfoResponse] | None]) -> None:
        self._get_engine = get_engine
        # One worker: prompts are encoded one at a time, in arrival order, off the event loop.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkserve-tokenize")

    def max_request_bytes(self) -> int | None:
        """Size of the largest valid GenerateRequest now (None while not serving)."""
        state = self._get_engine()
        return None if state is None else state[1].max_request_bytes

    def ready_state(self) -> tuple[Engine, Limits, pb.GetInfoResponse]:
        """The engine, limits and static info while serving; UnavailableError otherwise."""
        state = self._get_engine()
        if state is None:
            raise UnavailableError("the server is loading or draining")
        if state[0].is_dead:
            raise UnavailableError("the executor is unavailable")
        return state

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the tokenize worker (the HTTP front's /tokenize): off the event loop,
        in arrival order with the prompts being admitted."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def submit(
        self, request: pb.GenerateRequest, prompt: Callable[[Tokenizer, Limits], list[int]] | None = None
    ) -> tuple[Engine, RequestStream]:
        """Validates a request, tokenizes it off the event loop and queues it.

        The one admission path of both public fronts (Generate here, the OpenAI-compatible
        HTTP API in http_api.py builds a GenerateRequest and calls this), so the two refuse
        and admit exactly the same requests, tokenize on the same worker in arrival order,
        and share one engine. Raises ServingError; the caller aborts the returned stream's
        request when it stops reading before the final delta. `prompt` (the HTTP front's
        chat-template options, openai_prompt.PromptSpec.ids) makes a text or chat prompt's ids
        in place of tokenize_prompt, on the same worker.
        """
        engine, [stream] = await self.submit_choices(request, prompt, 1)
        return engine, stream

    async def submit_choices(
        self, request: pb.GenerateRequest, prompt: Callable[[Tokenizer, Limits], list[int]] | None, n: int
    ) -> tuple[Engine, list[RequestStream]]:
        """`submit` for n choices of one prompt (OpenAI's `n`): checked and tokenized once, then
        n requests queued. Choice i samples with seed + i when the request has a seed (vLLM's
        parallel sampling), so seeded choices differ and each is reproducible. A choice the
        engine refuses (a full queue) takes the ones queued before it back."""
        engine, ids, params = await self.prepare(request, prompt, prefetch=True)
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                choice = params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64)
                streams.append(
                    engine.add_request(ids, choice, request.cache_salt or None, request.priority, request.tenant)
                )
        except ServingError:
            for stream in streams:
                engine.abort(stream.request_id)
            raise
        return engine, streams

    async def prepare(
        self,
        request: pb.GenerateRequest,
        prompt: Callable[[Tokenizer, Limits], list[int]] | None = None,
        prefetch: bool = False,
    ) -> tuple[Engine, list[int], SamplingParams]:
        """What `submit` would queue, checked as it checks it: the prompt's token ids and the
        sampling parameters (the HTTP front's /render answers with them). `prefetch`: start the
        request's grammar compiling while the prompt is tokenized. Raises ServingError."""
        engine, limits, _ = self.ready_state()
        check_known_fields(request)
        check_client_request_id(request)
        if prefetch:
            engine.grammars.prefetch(structured_constraint(request.sampling))  # compiles while the prompt is tokenized
        if needs_tokenizer(request):
            ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, prompt or functools.partial(tokenize_prompt, request), engine.tokenizer, limits
            )
        else:  # token ids: bounded by max_model_len, cheap
            ids = tokenize_prompt(request, engine.tokenizer, limits)
        sampling = sampling_params(request, len(ids), limits)
        if request.sampling.bad_words:
            words = bad_words_token_ids(list(request.sampling.bad_words), engine.tokenizer, limits.vocab_size)
            sampling = replace(sampling, bad_words=words)
        return engine, ids, sampling

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            engine, stream = await self.submit(request)
        except ServingError as exc:
            await context.abort(exc.code, str(exc))
            return
        try:
            # The first message goes out on admission, before the request is scheduled, so a
            # client can abort a request still queued or prefilling by its id. The prefix-cache
            # hit is known only once a step admits it: usage.cached_tokens, on the last message.
            yield pb.GenerateResponse(
                request_id=stream.request_id,
                client_request_id=request.client_request_id,  # echoed once, here
                prompt_tokens=stream.num_prompt_tokens,
            )
            async for delta in stream_deltas(stream):
                if delta.error is not None:
                    await context.abort(delta.error.code, str(delta.error))
                yield delta_to_proto(stream.request_id, delta)
        finally:
            if not stream.finished:
                engine.abort(stream.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        state = self._get_engine()
        return pb.AbortResponse(found=state is not None and state[0].abort(request.request_id))

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        try:
            engine, _, static = self.ready_state()
        except ServingError as exc:
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises
        s = engine.scheduler.snapshot()
        info = pb.GetInfoResponse(
            max_num_batched_tokens=s.config.max_num_batched_tokens,
            max_num_seqs=s.config.max_num_seqs,
            enable_chunked_prefill=s.config.enable_chunked_prefill,
            num_free_device_blocks=s.num_free_device_blocks,
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting + s.num_swapped,
        )
        info.MergeFrom(static)  # the model and pool, fixed at start-up
        return info


class Refused:
    """What the guarded deserializer returns instead of raising: the reason."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def guarded_deserializer(message_type: type[Message], max_bytes: Callable[[], int | None]) -> Callable[[bytes], Any]:
    """A gRPC request deserializer that never raises: bytes over `max_bytes()` or not a valid
    `message_type` give a Refused with the reason (Generate's requests here, and each call's
    GenerateRequest inside a Multiplex stream, mux.py, where one bad call must not end the
    stream)."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Refused:
        limit = max_bytes()
        if limit is not None and len(data) > limit:
            return Refused(
                f"the request has {len(data)} bytes; the largest valid {name} has {limit} "
                "(the longest prompt max_model_len allows, plus 320 KiB for the other fields)"
            )
        try:
            return message_type.FromString(data)
        except DecodeError as exc:  # e.g. "String field had bad UTF-8"
            return Refused(f"the request is not a valid {name} ({exc}); string fields must be valid UTF-8")

    return deserialize


async def _refuse(method: str, refused: Refused, context: grpc.aio.ServicerContext) -> None:
    log.warning("refused %s from %s: %s", method, context.peer(), refused.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused.reason)


def _guard_unary(method: str, behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Refused):
            await _refuse(method, request, context)
        return await behaviour(request, context)

    return handler


def _guard_stream(method: str, behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]):
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Refused):
            await _refuse(method, request, context)
        async with contextlib.aclosing(behaviour(request, context)) as stream:
            async for message in stream:
                yield message

    return handler


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Registers chunkserve.v1.Generation, like the generated add_GenerationServicer_to_server
    but with request deserializers that never raise.

    gRPC's own deserializer raises on bytes that are not a valid message (a string field
    with invalid UTF-8 is the common case), and grpc.aio then answers UNKNOWN and logs an
    ERROR traceback per request. Here such a request gets INVALID_ARGUMENT and one WARNING
    line. A GenerateRequest larger than the largest valid one (Limits.max_request_bytes,
    known once the executor's handshake fixed max_model_len) is refused the same way before
    it is parsed; the server's transport limit (app.py) caps messages before that.
    """
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _guard_stream(f"/{service}/Generate", servicer.Generate),
            request_deserializer=guarded_deserializer(pb.GenerateRequest, servicer.max_request_bytes),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            _guard_unary(f"/{service}/Abort", servicer.Abort),
            request_deserializer=guarded_deserializer(pb.AbortRequest, lambda: None),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            _guard_unary(f"/{service}/GetInfo", servicer.GetInfo),
            request_deserializer=guarded_deserializer(pb.GetInfoRequest, lambda: None),
            response_serializer=pb.GetInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
