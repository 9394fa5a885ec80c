"""OpenAI-style errors: every failure leaves as {"error": {"message", "type", "param", "code"}}.

Validation problems are 400 (OpenAI's status), not FastAPI's default 422, and engine errors map
to the status a client can act on: 400 fix the request, 404 wrong model, 413 too big, 503 retry.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paved.engine.protocol import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)
from paved.frontend.tracing import response_headers
from paved.http.errors import error_body, validation_message

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def to_api_error(exc: Exception) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), code="unavailable", headers={"Retry-After": "5"})
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors(), exc.body)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def _api(request: Request, exc: Exception) -> JSONResponse:
        error = to_api_error(exc)
        if isinstance(exc, EngineOverloadedError):
            # Every 503 overloaded, wherever raised (admission, the engine's queue, a remote
            # engine's answer): alerting subtracts this push-back from a version's errors.
            state = getattr(request.app.state, "paved", None)
            if state is not None:
                state.metrics.rejected.labels(exc.model, exc.reason).inc()
        # The catch-all runs in Starlette's server-error middleware, outside TracingMiddleware:
        # the id header is added here so that 500s carry it too.
        headers = {**(error.headers or {}), **response_headers(request)}
        return error_response(
            error.status, error.message, param=error.param, code=error.code, headers=headers
        )

    # Expected errors are answered by the exception middleware; only the catch-all for bugs
    # goes through Starlette's server-error middleware, which also logs the traceback.
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(EngineError, _api)
    app.add_exception_handler(Exception, _api)
