"""OpenAI-style error bodies: every paved HTTP failure leaves as
{"error": {"message", "type", "param", "code"}}, whichever server (frontend, gateway) answers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.types import Send

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
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


_NO_BODY = object()


def validation_message(errors: Sequence[Any], body: Any = _NO_BODY) -> tuple[str, str | None]:
    """An OpenAI-style message and `param` for pydantic validation errors (a request body that
    failed its model): 400, not FastAPI's default 422 with its own body shape.

    Given the `body` that was validated, pydantic's union labels (`stop.str`,
    `prompt.list[constrained-str]`, a tagged union's tag) are left out of the field paths: only
    the keys and indexes the client wrote remain."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = _client_path(first, body)
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if not loc and kind == "missing":
        return "the request body is missing", None
    if not loc and kind in ("model_attributes_type", "model_type", "dict_type"):
        return "the request body must be a JSON object", None
    messages = []
    for error in errors[:3]:
        where = ".".join(_client_path(error, body))
        # Our own validators raise ValueError; pydantic prefixes their text with this.
        text = error["msg"].removeprefix("Value error, ")
        messages.append(f"{where}: {text}" if where else text)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(messages) + more, param


def _client_path(error: Any, body: Any) -> list[str]:
    parts = [part for part in error.get("loc", ()) if part != "body"]
    if body is _NO_BODY:
        return [str(part) for part in parts]
    path: list[str] = []
    value = body
    for i, part in enumerate(parts):
        if _has(value, part):
            value = value[part]
        elif not (isinstance(value, dict) and i == len(parts) - 1 and not _type_label(part)):
            # A label pydantic adds (a union member, a tagged union's tag): the client wrote
            # no such key. (A field absent from an object, last in the path, is kept: missing,
            # or checked against the others at its default.)
            continue
        path.append(str(part))
    return path


def _has(value: Any, part: Any) -> bool:
    if isinstance(value, dict):
        return isinstance(part, str) and part in value
    return isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)


_SCALAR_LABELS = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict"})


def _type_label(part: Any) -> bool:
    text = str(part)
    return text in _SCALAR_LABELS or "[" in text or "-" in text or text[:1].isupper()
