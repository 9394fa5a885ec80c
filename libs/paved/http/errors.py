"""OpenAI-style error bodies: every paved HTTP failure leaves as
{"error": {"message", "type", "param", "code"}}, whichever server (frontend, gateway) answers."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


async def send_json(send: Send, status: int, body: dict, retry_after: str | None = None) -> None:
    """Answer a raw ASGI request with a JSON body (for middleware, below any framework)."""
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
