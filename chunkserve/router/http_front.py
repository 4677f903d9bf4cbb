"""The router's OpenAI-compatible HTTP front: the replicas' HTTP API, proxied.

A completion or chat request is routed like a gRPC one: its prompt (a string, token ids, or
chat messages with text contents) is tokenized as the replicas do it and scored by cached
prefix, predicted TTFT and load (core.py); the body goes to the chosen replica unchanged and
its response streams back byte for byte (SSE included). A replica that refuses before
answering (connection refused, 503 not serving, 429 queue full) is skipped and the request
placed again; once its response started, it is the client's. /v1/models and /version come from
a serving replica; /health is the router's: 200 while some replica serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chunkserve.router.core import NoReplicaError, Router
from chunkserve_contracts.v1 import chunkserve_pb2 as pb

RETRY_STATUS = (429, 503)
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def _scores_prompt(body: Any) -> bool:
    """Whether an OpenAI body asks for prompt logprobs (vLLM's prompt_logprobs, or completions'
    echo with logprobs): then the replica prefills the whole prompt, cached or not."""
    if not isinstance(body, dict):
        return False
    return body.get("prompt_logprobs") is not None or (bool(body.get("echo")) and body.get("logprobs") is not None)


def prompt_request(body: dict[str, Any], chat: bool) -> pb.GenerateRequest | None:
    """The body's prompt as the GenerateRequest the router tokenizes (None: not one it reads)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            return None
        chat_msgs = [pb.ChatMessage(role=str(m.get("role", "")), content=m["content"]) for m in messages]
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=chat_msgs))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return pb.GenerateRequest(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": status}}, status_code=status)


class HttpProxy:
    def __init__(self, router: Router) -> None:
        self.router = router
        # httpx logs every request it sends at INFO: here a line per proxied OpenAI request
        # (1,098 lines in a 13 s benchmark, ~4% of the router's busy CPU). Its warnings stay;
        # a level set for it explicitly is left as it is.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None)
        )
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/models", self._forward_get, methods=["GET"]),
                Route("/version", self._forward_get, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )
        self.port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def _health(self, request: Request) -> Response:
        if any(r.address.http for r in self.router.replicas.routable()):
            return Response(status_code=200)
        return _error(503, "no replica is serving")

    def _forward_headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "accept")}

    async def _forward_get(self, request: Request) -> Response:
        for r in self.router.replicas.routable():
            if r.address.http:
                try:
                    reply = await self.client.get(
                        r.address.http + request.url.path, headers=self._forward_headers(request)
                    )
                except httpx.HTTPError:
                    continue
                return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))
        return _error(503, "no replica with an HTTP port is serving")

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        chat = request.url.path.endswith("/chat/completions")
        parsed = prompt_request(body, chat) if isinstance(body, dict) else None
        token_ids = await self.router.token_ids(parsed) if parsed is not None else None
        salt = body.get("cache_salt") if isinstance(body, dict) and isinstance(body.get("cache_salt"), str) else None
        cacheable = not _scores_prompt(body)
        tried = {r.name for r in self.router.replicas.routable() if not r.address.http}
        while True:
            try:
                ticket = self.router.place(token_ids, salt, tried, cacheable)
            except NoReplicaError as exc:
                return _error(503, str(exc))
            url = ticket.replica.address.http + request.url.path  # type: ignore[operator]
            req = self.client.build_request("POST", url, content=raw, headers=self._forward_headers(request))
            try:
                reply = await self.client.send(req, stream=True)
            except httpx.HTTPError:
                ticket.release()
                tried.add(ticket.replica.name)
                continue
            if reply.status_code in RETRY_STATUS:
                await reply.aclose()
                ticket.release()
                tried.add(ticket.replica.name)
                continue
            headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS}
            return StreamingResponse(self._relay(reply, ticket), reply.status_code, headers=headers)

    @staticmethod
    async def _relay(reply: httpx.Response, ticket) -> AsyncIterator[bytes]:
        try:
            async for chunk in reply.aiter_raw():
                ticket.got_first_token()
                yield chunk
        finally:
            await reply.aclose()
            ticket.release()

    async def start(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise ValueError(f"--http-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False, ws="none")
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="router-http")
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is not None and self._task is not None:
            self._server.config.timeout_graceful_shutdown = grace
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, grace + 2)
        await self.client.aclose()


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
