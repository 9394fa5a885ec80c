"""Request ids, trace context and the JSON access log of the OpenAI frontend.

Invariants:
- Every HTTP request gets a `RequestLog` (the id and trace rules of paved.http.tracing: the
  gateway's `x-request-id` and `traceparent` are continued) before any other middleware runs,
  and every response carries `x-request-id`, errors included (the catch-all error handler adds
  it too: Starlette answers unhandled exceptions outside the user middleware).
- One JSON line per request on logger `paved.frontend.access` at INFO, written once the
  response has ended (streams included): request_id, trace_id, span_id, parent_span_id, method,
  path, model, status, duration_ms, and prompt/completion tokens when known. Never the body,
  the query string or any header other than the two ids. Probes (/health/*, /metrics) log at
  DEBUG so a kubelet polling them does not flood the log.
- Engine request ids embed the request id (`engine_request_id`) and stay unique per request
  even when a client reuses its x-request-id.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import Scope

from paved.engine.protocol import GenerateOutput
from paved.http.tracing import REQUEST_ID_HEADER, AccessMiddleware, TraceContext, trace_context

access_log = logging.getLogger("paved.frontend.access")

# Where the request's log lives in the ASGI scope's state (shared by the whole middleware stack).
_STATE_KEY = "paved.request_log"
_PROBES = ("/health/", "/metrics")


@dataclass
class RequestLog:
    """What one request's access line says; handlers fill in the model and token counts."""

    context: TraceContext
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Per engine stream: its prompt tokens (engines may repeat the count on later outputs).
    _stream_prompts: dict[int, int] = field(default_factory=dict)

    def add_output(self, stream: int, out: GenerateOutput) -> None:
        if out.prompt_tokens is not None:
            self._stream_prompts[stream] = out.prompt_tokens
            self.prompt_tokens = sum(self._stream_prompts.values())
        generated = self.completion_tokens or 0
        for d in out.choices:  # once per streamed token: a loop, not sum() over a generator
            generated += d.token_count
        self.completion_tokens = generated


def _state(scope: Scope) -> dict:
    return scope.setdefault("state", {})


def request_log(request: Request) -> RequestLog:
    """The request's log (made here when the app runs without TracingMiddleware)."""
    state = _state(request.scope)
    log = state.get(_STATE_KEY)
    if log is None:
        log = state[_STATE_KEY] = RequestLog(trace_context(request.headers))
    return log


def engine_request_id(prefix: str, request: Request) -> str:
    """`<prefix>-<x-request-id>-<random>`: vLLM's own request logs and aborts then name the
    client's id, and two requests reusing one x-request-id still get distinct engine ids. The
    request id alphabet ([A-Za-z0-9._:-]) is safe in engine ids."""
    return f"{prefix}-{request_log(request).context.request_id}-{uuid.uuid4().hex[:16]}"


async def counted(stream: AsyncIterator[GenerateOutput], log: RequestLog, index: int = 0):
    """`stream`, counting its tokens into `log` as they pass (the request's engine streams are
    still closed by their owner; this only observes)."""
    async for out in stream:
        log.add_output(index, out)
        yield out


def response_headers(request: Request) -> dict[str, str]:
    """The id headers for a response made outside TracingMiddleware's reach."""
    return {REQUEST_ID_HEADER: request_log(request).context.request_id}


class TracingMiddleware(AccessMiddleware[RequestLog]):
    """Outermost: assigns the request's ids, echoes x-request-id and writes the access line."""

    def open(self, scope: Scope, context: TraceContext) -> RequestLog:
        log = _state(scope)[_STATE_KEY] = RequestLog(context)
        return log

    def write(self, scope: Scope, record: RequestLog, status: int, started: float) -> None:
        _write(scope, record, status, time.perf_counter() - started)


def _write(scope: Scope, log: RequestLog, status: int, duration_s: float) -> None:
    path: str = scope["path"]
    level = logging.DEBUG if path.startswith(_PROBES) else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    context = log.context
    line = {
        # request_id and trace_id first: operators (and tests) grep replica logs for them.
        "request_id": context.request_id,
        "trace_id": context.trace_id,
        "span_id": context.span_id,
        "parent_span_id": context.parent_span_id,
        "method": scope["method"],
        "path": path,
        "model": log.model,
        "status": status,
        "duration_ms": round(duration_s * 1000, 3),
    }
    if log.prompt_tokens is not None:
        line["prompt_tokens"] = log.prompt_tokens
    if log.completion_tokens is not None:
        line["completion_tokens"] = log.completion_tokens
    access_log.log(level, json.dumps(line))
