"""Errors that map to gRPC status codes (the servicer turns them into aborts).

Keeping the mapping in one place means every path reports the same code for the same
situation (the table in docs/architecture.md, "Errors").
"""

from __future__ import annotations

import grpc


class ServingError(Exception):
    """An error the client should see with a specific status code."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequestError(ServingError, ValueError):
    """A parameter is invalid and retrying will not help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class QueueFullError(ServingError):
    """Over capacity for now; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(ServingError):
    """Loading, draining, or the executor is gone."""

    code = grpc.StatusCode.UNAVAILABLE


class StepFailedError(ServingError):
    """The executor refused or could not run one step (out of memory, a rejected plan) but
    is alive: that step's requests fail with this code, the server carries on."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class InternalError(ServingError):
    """A bug or broken invariant; the server log has the traceback."""

    code = grpc.StatusCode.INTERNAL
