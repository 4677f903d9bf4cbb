"""Bearer-token checks as gRPC server interceptors: the public API and the executor port.

Callers send `authorization: Bearer <token>` metadata. The standard health and reflection
services stay open, so orchestrator probes and grpcurl's `list` work without the secret.
The comparison is constant-time so the token cannot be guessed byte by byte from timing.

Two flavours of one check: `BearerTokenInterceptor` for grpc.aio servers (the scheduler's
public API, `--api-key`; the admin ports of the scheduler and the router, `--admin-token`,
where a second, narrower token may be accepted for some services: `scoped`) and
`SyncBearerTokenInterceptor` for threaded grpc servers (the executor, `--executor-token`).
`check_admin_bind` is the start-up rule of the admin ports: off loopback, a token or an
explicit opt-out. No torch and nothing from either service is imported here.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
DEFAULT_DENIAL = "missing or wrong bearer token"
ADMIN_TOKEN_ENV = "CHUNKSERVE_ADMIN_TOKEN"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def admin_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata a client of a scheduler's admin port sends: CHUNKSERVE_ADMIN_TOKEN, the
    variable the server reads its --admin-token from (none when unset)."""
    return bearer_metadata(os.environ.get(ADMIN_TOKEN_ENV))


def _expected(token: str) -> bytes:
    if not token:
        raise ValueError("a bearer token must not be empty")
    return f"Bearer {token}".encode()


def token_matches(metadata: Iterable[Any] | None, expected: bytes) -> bool:
    """Whether the call's `authorization` metadata is exactly `expected`, in constant time."""
    sent = dict(metadata or ()).get("authorization", "")
    return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, expected)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine only: 127.0.0.0/8, ::1 or `localhost`.
    Anything else (0.0.0.0, ::, a pod IP, another name) counts as reachable from the network."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_admin_bind(
    host: str, token: str | None, allow_unauthenticated: bool, token_source: str = "CHUNKSERVE_ADMIN_TOKEN"
) -> None:
    """The start-up rule of an admin port: listening beyond loopback needs a token, unless the
    operator opted out explicitly. ValueError of one line naming what to set otherwise
    (`token_source`: the environment variable that carries the token)."""
    if token or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"--admin-host {host} is not loopback and no admin token is set: anyone who reaches that port could "
        f"change the running server and read the prompts' token ids. Set {token_source} (a long random secret; "
        "the environment keeps it out of `ps`), or pass --admin-allow-unauthenticated if a network policy "
        "already admits only trusted callers (docs/deploy.md)"
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio: rejects calls without the right token with UNAUTHENTICATED.

    `scoped` maps a method prefix (`/chunkserve.v1.Replica/`) to one more token accepted for
    the methods under it only: the admin port's read token, which a router holds, opens the
    Replica service and nothing that changes the server."""

    def __init__(
        self, token: str, denial: str = DEFAULT_DENIAL, scoped: Mapping[str, str | None] | None = None
    ) -> None:
        self._expected = _expected(token)
        self._scoped = tuple((prefix, _expected(t)) for prefix, t in (scoped or {}).items() if t)

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, denial)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        # A client-streaming method is denied without reading a request: a client may wait for
        # the stream's first answer before it writes (chunkserve/router/legs.py does).
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES) or self._allowed(details):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # no such method here: UNIMPLEMENTED, so a client at the wrong port can say so
            return None
        if handler.request_streaming:
            return self._deny_bidi
        return self._deny_stream if handler.response_streaming else self._deny_unary

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        metadata = details.invocation_metadata
        if token_matches(metadata, self._expected):
            return True
        return any(details.method.startswith(p) and token_matches(metadata, t) for p, t in self._scoped)


class SyncBearerTokenInterceptor(grpc.ServerInterceptor):
    """Threaded grpc.server: rejects calls without the right token with UNAUTHENTICATED."""

    def __init__(self, token: str, denial: str = DEFAULT_DENIAL) -> None:
        self._expected = _expected(token)

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, denial)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)  # the step stream: no read first

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES) or token_matches(details.invocation_metadata, self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # no such method here: UNIMPLEMENTED, so a client at the wrong port can say so
            return None
        if handler.request_streaming:
            return self._deny_bidi
        return self._deny_stream if handler.response_streaming else self._deny_unary
