"""Request ids and W3C trace context shared by every paved hop (gateway, frontend).

Invariants:
- A request id is the client's `x-request-id` when it matches `[A-Za-z0-9._:-]{1,128}` (safe in
  logs, headers and engine request ids), else 32 new random hex digits; it is never empty.
- Each hop continues a well-formed incoming `traceparent` (version 00, non-zero trace id) with
  a new span id of its own, keeping the trace id and flags; anything else starts a new trace
  (flags 01). The incoming span id becomes the hop's parent span id.
- Knows no framework: it reads a mapping of (case-insensitive) header names to values, or
  gRPC invocation metadata (`metadata_context`).
- Every paved access line (a JSON object per request) opens with `access_fields`: request_id
  and trace_id first, so one grep finds a request on every hop.
- `AccessMiddleware` is the one outermost ASGI middleware of the paved HTTP servers (frontend,
  KServe): it only needs Starlette's header helpers, no application framework.
"""

from __future__ import annotations

import json
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
TRACEPARENT_HEADER = "traceparent"

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32


@dataclass(frozen=True)
class TraceContext:
    """One hop's ids: the request id, the trace, this hop's span and the caller's span."""

    request_id: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    flags: str

    @property
    def traceparent(self) -> str:
        """The W3C `traceparent` naming this hop's span (sent to the next hop)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def trace_context(headers: Mapping[str, str]) -> TraceContext:
    """The ids of a request arriving with `headers` (see the module's invariants)."""
    # Every id this hop may need from one read of the system's randomness (a call each was
    # three system calls per request): request id 32 hex digits, trace id 32, span id 16.
    fresh = os.urandom(40).hex()
    given = headers.get(REQUEST_ID_HEADER)
    request_id = given if given is not None and _REQUEST_ID.fullmatch(given) else fresh[:32]
    parent = headers.get(TRACEPARENT_HEADER)
    match = _TRACEPARENT.fullmatch(parent) if parent else None
    continued = match is not None and match.group(1) != _ZERO_TRACE
    trace_id = match.group(1) if match and continued else fresh[32:64]
    if trace_id == _ZERO_TRACE:  # W3C: an all-zero id is invalid (1 in 2^128 here)
        trace_id = "0" * 31 + "1"
    span_id = fresh[64:] if fresh[64:] != "0" * 16 else "0" * 15 + "1"
    # Kept from the gateway's original rule: a malformed-but-matching header's flags survive.
    flags = match.group(3) if match else "01"
    return TraceContext(
        request_id=request_id,
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=match.group(2) if match and continued else None,
        flags=flags,
    )


class _HasHeaders(Protocol):
    @property
    def headers(self) -> Mapping[str, str]: ...


def request_ids(request: _HasHeaders) -> tuple[str, str]:
    """The request's id (the client's `x-request-id` if well formed, else new) and the W3C
    `traceparent` to send upstream (the client's trace continued with a new span id, or a new
    trace)."""
    context = trace_context(request.headers)
    return context.request_id, context.traceparent


def metadata_context(metadata: Iterable[tuple[str, Any]] | None) -> TraceContext:
    """`trace_context` of a gRPC call's invocation metadata. Keys are matched lowercase and the
    first text value of a key counts; binary (`-bin`) values never name a request."""
    headers: dict[str, str] = {}
    for key, value in metadata or ():
        key = key.lower()
        if key in (REQUEST_ID_HEADER, TRACEPARENT_HEADER) and isinstance(value, str):
            headers.setdefault(key, value)
    return trace_context(headers)


def access_fields(context: TraceContext) -> dict[str, Any]:
    """The id fields an access line opens with, in this order."""
    return {
        "request_id": context.request_id,
        "trace_id": context.trace_id,
        "span_id": context.span_id,
        "parent_span_id": context.parent_span_id,
    }


def access_json(fields: Mapping[str, Any]) -> str:
    """One access line: compact JSON, keys in the caller's order."""
    return json.dumps(fields, separators=(",", ":"))


R = TypeVar("R")


class AccessMiddleware(ABC, Generic[R]):
    """Outermost ASGI middleware of an HTTP server: gives each request its `TraceContext`, sets
    `x-request-id` on the response (errors included) and writes one access line once the
    response has ended (streams included), whatever the app raised.

    A server says what differs: `open` makes the request's record (the server's handlers may
    fill it in while the request runs), `error_status` names the status of an exception that
    escaped before any response started (the server's catch-all handler answers it outside
    this middleware, so it never passes `send`), and `write` logs the line."""

    def __init__(self, app: ASGIApp):
        self.app = app

    @abstractmethod
    def open(self, scope: Scope, context: TraceContext) -> R:
        """The record of a request arriving with `context`."""

    def error_status(self, error: Exception) -> int:
        """The status answered for `error` when it escaped before a response started."""
        return 500

    @abstractmethod
    def write(self, scope: Scope, record: R, status: int, started: float) -> None:
        """Writes the access line; `started` is the request's `time.perf_counter()`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = trace_context(Headers(scope=scope))
        record = self.open(scope, context)
        status: int | None = None
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = context.request_id
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as e:
            if status is None:
                status = self.error_status(e)
            raise
        finally:
            # Nothing started and no Exception to map (a cancelled request, or an app that never
            # answered): logged as 500.
            self.write(scope, record, 500 if status is None else status, started)
