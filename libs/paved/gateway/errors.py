"""The gateway's errors: each carries the HTTP status, OpenAI error code and headers it leaves
with, so every layer (auth, limits, router, proxy) raises and only the app renders.

gRPC mapping (KServe forwarding) is `grpc_code`: 400 INVALID_ARGUMENT, 401 UNAUTHENTICATED,
404 NOT_FOUND, 413 RESOURCE_EXHAUSTED, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504
DEADLINE_EXCEEDED, else INTERNAL.
"""

from __future__ import annotations


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})


class AuthError(GatewayError):
    """401: missing, malformed, unknown, revoked or expired key (the message says which,
    never echoing the secret)."""

    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


class ModelNotAllowedError(GatewayError):
    """404 for a model the caller's tenant may not use, worded exactly like an unknown model so
    a caller cannot probe which models exist."""

    def __init__(self, model: str):
        super().__init__(
            404,
            f"The model '{model}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )


class RateLimitedError(GatewayError):
    """429 with Retry-After (whole seconds, at least 1) and the x-ratelimit-* headers."""

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str] | None = None):
        merged = dict(headers or {})
        merged["Retry-After"] = str(max(1, int(retry_after_s + 0.999)))
        super().__init__(429, message, code="rate_limit_exceeded", headers=merged)
        self.retry_after_s = retry_after_s


class NoBackendError(GatewayError):
    """503 + Retry-After: the model is routed but no backend is healthy right now."""

    def __init__(self, message: str, retry_after_s: int = 2):
        super().__init__(503, message, code="no_healthy_backend", headers={"Retry-After": str(retry_after_s)})


_GRPC = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def grpc_code_name(status: int) -> str:
    """The grpc.StatusCode member name for an HTTP status (the module stays free of grpc)."""
    return _GRPC.get(status, "INTERNAL")
