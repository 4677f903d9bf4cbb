"""Bearer-token check for the public API, as a gRPC interceptor.

Clients send `authorization: Bearer <token>` metadata. The standard health and reflection
services stay open, so orchestrator probes and grpcurl's `list` work without the secret.
The comparison is constant-time so the token cannot be guessed byte by byte from timing.
"""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right token with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return self._deny_stream if handler is not None and handler.response_streaming else self._deny_unary
