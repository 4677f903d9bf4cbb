"""The OpenAI-compatible HTTP API, beside the gRPC one, on the same engine and event loop.

A thin translation layer: a JSON body becomes a chunkserve.v1 GenerateRequest and goes
through `GenerationServicer.submit`, the gRPC front's own admission path (validation,
limits, tokenizing off the loop), so both fronts accept and refuse the same requests and
share one scheduler, KV cache and metrics registry. Errors are OpenAI-style bodies
({"error": {"message", "type", "param", "code"}}) with the status the gRPC code maps to.
Starlette routes and streams; uvicorn serves it as one task on the scheduler's loop, with
signals left to the process (see HttpFront). A stream the client closes aborts its request,
and so does a client that disconnects while waiting for a non-streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chunkserve_contracts import __version__
from chunkserve_contracts.auth import token_matches
from scheduler_svc import beam_search
from scheduler_svc.engine import Engine
from scheduler_svc.errors import ServingError
from scheduler_svc.http_extras import AccessLog, detokenize_ids, http_error, render_response, tokenize_response
from scheduler_svc.openai_choice import Choice, prompt_logprobs_json, usage
from scheduler_svc.openai_fields import HttpError, get
from scheduler_svc.openai_protocol import (
    OpenAIRequest,
    Settings,
    accepted_names,
    build_request,
    error_response,
    tokenize_spec,
)
from scheduler_svc.output import RequestStream, StreamDelta, collect, stream_deltas
from scheduler_svc.servicer import GenerationServicer

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 * 1024 * 1024  # the gRPC front's transport limit (app.MAX_PUBLIC_REQUEST_BYTES)


class HttpFront:
    """The Starlette app and the uvicorn server that runs it on the current event loop."""

    def __init__(
        self,
        servicer: GenerationServicer,
        api_key: str | None,
        settings: Settings | None = None,
        allowed_origins: tuple[str, ...] = (),
        access_log: bool = True,
    ) -> None:
        self.servicer = servicer
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        # Sampling defaults (--generation-config) are the model's: app.py sets them once the
        # executor said which model it loaded, with model_root (the /v1/models `root`).
        self.settings = settings or Settings()
        self.model_root: str | None = None
        middleware = [Middleware(AccessLog)] if access_log else []
        if allowed_origins:  # answers OPTIONS preflights, adds Access-Control-* headers
            middleware.append(
                Middleware(
                    CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
                )
            )
        self.app = Starlette(
            routes=[
                Route("/v1/completions", functools.partial(self._generate, chat=False), methods=["POST"]),
                Route("/v1/chat/completions", functools.partial(self._generate, chat=True), methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions/render", functools.partial(self.render, chat=False), methods=["POST"]),
                Route("/v1/chat/completions/render", functools.partial(self.render, chat=True), methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
            ],
            middleware=middleware,
            exception_handlers={HTTPException: http_error},
        )
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    # ---- routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 while requests can be served, 503 while loading or without an executor."""
        try:
            self.servicer.ready_state()
        except ServingError as exc:
            return Response(str(exc), 503)
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            _, limits, info = self.servicer.ready_state()
        except ServingError as exc:
            return error_response(exc)
        model = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "chunkserve"}
        card = {**model, "root": self.model_root or info.model_name, "parent": None}
        return JSONResponse({"object": "list", "data": [{**card, "max_model_len": limits.max_model_len}]})

    def _model(self, body: dict[str, Any], served: str) -> str:
        """The model the body names (the served name, or its short form), or the served one."""
        model = get(body, "model", (str,), "a string")
        if model is None:
            return served
        if model not in accepted_names(served):
            raise HttpError(f"the model `{model}` does not exist", 404, "not_found_error", "model")
        return model

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt or chat messages (with its chat options) to token ids."""
        try:
            self._authorize(request)
            body = await self._body(request)
            engine, limits, info = self.servicer.ready_state()
            self._model(body, info.model_name)
            chat = "messages" in body
            spec = tokenize_spec(body, chat, self.settings)
            ids = await self.servicer.run_tokenizer(spec.ids, engine.tokenizer, limits)
            strs = bool(get(body, "return_token_strs", (bool,), "a boolean"))
        except ServingError as exc:
            return error_response(exc)
        return JSONResponse(tokenize_response(ids, engine.tokenizer, limits.max_model_len, strs))

    async def render(self, request: Request, chat: bool) -> Response:
        """vLLM's /v1/completions/render and /v1/chat/completions/render: what a generation
        request with this body would run, without running it (the prompt's token ids after the
        chat template, and the sampling parameters), checked exactly as generation checks it.
        vllm-router's cache_aware policy asks for it before each request, to route by tokens."""
        try:
            self._authorize(request)
            body = await self._body(request)
            _, _, info = self.servicer.ready_state()
            self._model(body, info.model_name)
            built = build_request(body, chat, self.settings)
            _, ids, params = await self.servicer.prepare(built.proto, built.prompt.ids)
        except ServingError as exc:
            return error_response(exc, chat)
        request_id = built.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        return JSONResponse(render_response(("chatcmpl-" if chat else "cmpl-") + request_id, ids, params))

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids to text (special tokens included, as vLLM decodes)."""
        try:
            self._authorize(request)
            body = await self._body(request)
            engine, limits, info = self.servicer.ready_state()
            self._model(body, info.model_name)
            ids = detokenize_ids(body, limits.vocab_size)
        except ServingError as exc:
            return error_response(exc)
        return JSONResponse({"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)})

    # ---- generation --------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._expected is not None and not token_matches(request.headers.items(), self._expected):
            raise HttpError("missing or wrong API key (Authorization: Bearer <key>)", 401, "authentication_error")

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object, read no further than MAX_BODY_BYTES."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HttpError(f"the request body is over {MAX_BODY_BYTES} bytes", 413, "invalid_request_error")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError as exc:  # also bad UTF-8
            raise HttpError(f"the body is not valid JSON: {exc}", 400, "invalid_request_error") from None
        if not isinstance(body, dict):
            raise HttpError("the body must be a JSON object", 400, "invalid_request_error")
        return body

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            self._authorize(request)
            body = await self._body(request)
            _, _, info = self.servicer.ready_state()
            model = self._model(body, info.model_name)
            built = build_request(body, chat, self.settings)
            if built.beam is not None:
                return await self._beam_search(request, built, model)
            engine, streams = await self.servicer.submit_choices(built.proto, built.prompt.ids, built.n)
        except ServingError as exc:
            return error_response(exc, chat)
        echo = None
        if built.echo and chat:
            echo = built.chat_echo
        elif built.echo:  # the prompt as sent: a string, or its token ids decoded (as vLLM)
            ids = built.proto.token_ids.ids
            echo = built.proto.text if not ids else engine.tokenizer.decode(ids, skip_special_tokens=False)
        choices = [Choice(engine, chat, index=i, echo=echo, **built.choice_options) for i in range(built.n)]
        request_id = built.request_id or request.headers.get("x-request-id") or streams[0].request_id
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if built.streaming:
            events = self._events(engine, list(zip(choices, streams)), head, built)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collected = asyncio.ensure_future(asyncio.gather(*(collect(stream) for stream in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collected.done():
                collected.cancel()
                for stream in streams:  # the client left: free its requests
                    engine.abort(stream.request_id)
        if gone.done() and not collected.done():
            return Response(status_code=499)
        finals = collected.result()
        if (error := next((f.error for f in finals if f.error is not None), None)) is not None:
            return error_response(error, chat)
        bodies = [choice.body(final, stream=False) for choice, final in zip(choices, finals)]
        answer = {**head, "choices": bodies, "usage": usage(*finals)}
        if built.prompt_logprobs:  # vLLM's: per choice on completions, once on chat
            scored = [prompt_logprobs_json(f, choices[0].token_text) for f in finals]
            if chat:
                answer["prompt_logprobs"] = scored[0]
            else:
                for body, one in zip(bodies, scored):
                    body["prompt_logprobs"] = one
        return JSONResponse(answer)

    async def _beam_search(self, request: Request, built: OpenAIRequest, model: str) -> Response:
        """vLLM's use_beam_search: the whole answer once the search ends (beam_search.py)."""
        engine, ids, params = await self.servicer.prepare(built.proto, built.prompt.ids)
        gone = _disconnected(request)
        beams = await beam_search.run(engine, ids, built.beam, params.max_tokens, built.proto, gone)
        if beams is None:
            return Response(status_code=499)
        tokens_out = built.choice_options["return_token_ids"]
        body = beam_search.answer(engine, beams, len(ids), built.chat, params.skip_special_tokens, tokens_out)
        kind = ("chatcmpl-", "chat.completion") if built.chat else ("cmpl-", "text_completion")
        request_id = built.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        return JSONResponse(
            {"id": kind[0] + request_id, "object": kind[1], "created": int(time.time()), "model": model, **body}
        )

    async def _events(
        self, engine: Engine, choices: list[tuple[Choice, RequestStream]], head: dict[str, Any], built: OpenAIRequest
    ) -> AsyncIterator[str]:
        """Server-sent events ending in `data: [DONE]`, each chunk one choice's delta (with n
        choices, theirs interleaved as they come); the requests are aborted when the response
        is cancelled (client gone) or closed before their final deltas. With
        stream_options.include_usage a last chunk carries the usage of all choices; with
        continuous_usage_stats every chunk does, counting its choice's tokens so far (as vLLM)."""
        chat = built.chat
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        prompt_tokens, generated, finals = choices[0][1].num_prompt_tokens, [0] * len(choices), []

        def extra(i: int) -> dict[str, Any]:
            if not built.include_usage:
                return {}
            if not built.continuous_usage:
                return {"usage": None}
            return {"usage": usage(StreamDelta(prompt_tokens=prompt_tokens, completion_tokens=generated[i]))}

        try:
            if chat:  # OpenAI's first chunk of each choice carries the role
                for i in range(len(choices)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield _sse({**head, "choices": [{**first, "finish_reason": None}], **extra(i)})
            async with contextlib.aclosing(_merged([stream_deltas(stream) for _, stream in choices])) as deltas:
                async for i, d in deltas:
                    if d.error is not None:
                        yield _sse(json.loads(error_response(d.error, chat).body))
                        break
                    generated[i] += len(d.token_ids)
                    yield _sse({**head, "choices": [choices[i][0].body(d, stream=True)], **extra(i)})
                    if d.finished:
                        finals.append(d)
                else:
                    if built.include_usage:
                        yield _sse({**head, "choices": [], "usage": usage(*finals)})
            yield "data: [DONE]\n\n"
        finally:
            for _, stream in choices:
                if not stream.finished:
                    engine.abort(stream.request_id)

    # ---- serving -----------------------------------------------------------------------

    async def start(self, host: str, port: int, cert_file: str | None = None, key_file: str | None = None) -> int:
        """Listens (ValueError when the port is taken) and serves as a task on this loop."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise ValueError(f"--http-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # the process's logging stays as configured
            access_log=False,
            ws="none",
            ssl_certfile=cert_file,
            ssl_keyfile=key_file,
            timeout_graceful_shutdown=5,
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="http-api")
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Stops listening, lets open responses finish for `grace` s, then cancels them."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, grace + 2)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the scheduler process owns SIGINT/SIGTERM and
    stops this server through HttpFront.stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _merged(sources: list[AsyncIterator[StreamDelta]]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(source index, item) from every source as each comes, until all are exhausted; one
    source alone is read straight through. Closing this generator cancels what still waits."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(source)): i for i, source in enumerate(sources)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # a fixed order among ready ones
                i = pending.pop(task)
                if task.exception() is None:
                    yield i, task.result()
                    pending[asyncio.ensure_future(anext(sources[i]))] = i
                elif not isinstance(task.exception(), StopAsyncIteration):
                    raise task.exception()
    finally:
        for task in pending:
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
