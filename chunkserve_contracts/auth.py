"""Bearer-token checks as gRPC server interceptors: the public API and the executor port.

Callers send `authorization: Bearer <token>` metadata. The standard health and reflection
services stay open, so orchestrator probes and grpcurl's `list` work without the secret.
The comparison is constant-time so the token cannot be guessed byte by byte from timing.

Two flavours of one check: `BearerTokenInterceptor` for grpc.aio servers (the scheduler's
public API, `--api-key`) and `SyncBearerTokenInterceptor` for threaded grpc servers (the
executor, `--executor-token`). No torch and nothing from either service is imported here.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
DEFAULT_DENIAL = "missing or wrong bearer token"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _expected(token: str) -> bytes:
    if not token:
        raise ValueError("a bearer token must not be empty")
    return f"Bearer {token}".encode()


def token_matches(metadata: Iterable[Any] | None, expected: bytes) -> bool:
    """Whether the call's `authorization` metadata is exactly `expected`, in constant time."""
    sent = dict(metadata or ()).get("authorization", "")
    return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio: rejects calls without the right token with UNAUTHENTICATED."""

    def __init__(self, token: str, denial: str = DEFAULT_DENIAL) -> None:
        self._expected = _expected(token)

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, denial)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES) or token_matches(details.invocation_metadata, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # no such method here: UNIMPLEMENTED, so a client at the wrong port can say so
            return None
        return self._deny_stream if handler.response_streaming else self._deny_unary


class SyncBearerTokenInterceptor(grpc.ServerInterceptor):
    """Threaded grpc.server: rejects calls without the right token with UNAUTHENTICATED."""

    def __init__(self, token: str, denial: str = DEFAULT_DENIAL) -> None:
        self._expected = _expected(token)

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, denial)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES) or token_matches(details.invocation_metadata, self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # no such method here: UNIMPLEMENTED, so a client at the wrong port can say so
            return None
        return self._deny_stream if handler.response_streaming else self._deny_unary
