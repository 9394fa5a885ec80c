"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streams and break the
disconnect signal that aborts engine requests)."""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paved.frontend.errors import error_body
from paved.frontend.metrics import FrontendMetrics, route_label


class BodyLimitMiddleware:
    """Answer 413 for request bodies over `max_bytes`, before the app parses anything.

    Declared sizes are refused from the header; chunked bodies are read up to the limit and
    replayed to the app, so an oversized upload never reaches JSON parsing or an engine.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, error_body(400, "invalid Content-Length header"))
                    return
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        # No declared length (chunked): buffer up to the limit, then replay.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # Disconnected before the body was complete: nothing to serve.
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        message = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        await _send_json(send, 413, error_body(413, message, code="request_too_large"))


class MetricsMiddleware:
    """Count and time every HTTP request, by route (closed set), method and status."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        status = 500
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight = self.metrics.http_in_flight.labels(route)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            in_flight.dec()
            self.metrics.http_requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.http_latency.labels(route).observe(time.perf_counter() - started)


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
