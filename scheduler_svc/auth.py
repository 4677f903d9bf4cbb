"""Bearer-token check for the public API, as a gRPC interceptor.

Clients send `authorization: Bearer <token>` metadata. The standard health and reflection
services stay open, so orchestrator probes and grpcurl's `list` work without the secret.
The comparison is constant-time so the token cannot be guessed byte by byte from timing.
The code is shared with the executor port's token check and lives in chunkserve/auth.py.
"""
from __future__ import annotations

from chunkserve.auth import OPEN_SERVICES, BearerTokenInterceptor

__all__ = ["OPEN_SERVICES", "BearerTokenInterceptor"]
