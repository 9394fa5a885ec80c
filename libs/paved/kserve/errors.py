"""KServe v2 errors: one exception type that both transports render the way Triton does.

gRPC carries the status code; HTTP carries the status Triton's HTTP frontend uses for the same
condition (http_server.cc `HttpCodeFromError`) and a `{"error": "..."}` body, which is what
`tritonclient.http` parses. Engine-protocol errors map onto the same codes, so a bad sampling
parameter is INVALID_ARGUMENT / 400 whichever layer noticed it.
"""

from __future__ import annotations

import logging

import grpc

from paved.engine.protocol import (
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.CANCELLED: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


class KServeError(Exception):
    """A request failure with the code a KServe v2 client sees. `message` is client-facing."""

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self.code, 500)

    def __repr__(self) -> str:
        return f"KServeError({self.code.name}, {self.message!r})"


def invalid_argument(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str, retry_after_s: int | None = None) -> KServeError:
    return KServeError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=retry_after_s)


def unsupported(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.UNIMPLEMENTED, message)


def too_large(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def from_exception(exc: BaseException) -> KServeError:
    """The KServe error for anything raised while serving a request (unexpected ones are logged
    with their traceback and reach the client as a generic INTERNAL, never as a stack dump)."""
    if isinstance(exc, KServeError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid_argument(exc.message)
    if isinstance(exc, ModelNotFoundError):
        return not_found(str(exc))
    if isinstance(exc, EngineOverloadedError):
        return unavailable(str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineUnavailableError):
        return unavailable(str(exc))
    logger.error("internal error while serving a KServe request", exc_info=exc)
    return KServeError(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
