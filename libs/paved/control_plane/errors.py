"""The control plane's errors: each carries the HTTP status and a short machine code, so the
store, rollout and controller raise and only the API renders (`{"error": {...}}` with status).

The store raises `Unavailable` (503) when its database cannot be reached, `Conflict` (409) for a
duplicate or a lost compare-and-set, `NotFound` (404) and `BadRequest` (400) for invalid input.
"""

from __future__ import annotations


class ControlError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


class BadRequest(ControlError):
    def __init__(self, message: str, *, code: str = "invalid_request"):
        super().__init__(400, message, code=code)


class NotFound(ControlError):
    def __init__(self, message: str, *, code: str = "not_found"):
        super().__init__(404, message, code=code)


class Conflict(ControlError):
    def __init__(self, message: str, *, code: str = "conflict"):
        super().__init__(409, message, code=code)


class Unavailable(ControlError):
    """503 + Retry-After: the control plane's database (or another dependency) is down."""

    def __init__(self, message: str, *, code: str = "unavailable", retry_after_s: int = 2):
        super().__init__(503, message, code=code, headers={"Retry-After": str(retry_after_s)})
