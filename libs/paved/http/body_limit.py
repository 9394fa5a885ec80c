"""Request body bounds as pure ASGI middleware, shared by every paved HTTP server.

Pure ASGI (Starlette's BaseHTTPMiddleware would buffer streams and break the disconnect signal
that aborts engine requests).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paved.http.errors import error_body, send_json

# Bytes of chunked (length-less) request bodies all requests together may hold while they are
# buffered: without it, N clients each trickling a body just under max_bytes hold N x max_bytes.
DEFAULT_MAX_BUFFERED_BYTES = 128 * 1024 * 1024


class BodyLimitMiddleware:
    """Answer 413 for request bodies over `max_bytes`, before the app parses anything.

    Declared sizes are refused from the header; chunked bodies are read up to the limit and
    replayed to the app, so an oversized upload never reaches JSON parsing or an engine.
    The chunked bodies being buffered share `max_buffered_bytes`: a chunk that would take the
    total past it ends its request with 503 (Retry-After) and frees what that request held.
    A buffered body counts until its request ends (the app keeps the replayed copy that long).

    With `stream_chunked` (an app that streams its body to disk, as file uploads do) chunked
    bodies are not buffered: they reach the app as they arrive, counted, and one that passes
    `max_bytes` is cut off there (the app sees the client disconnect) and answered 413.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        *,
        stream_chunked: bool = False,
    ):
        if max_buffered_bytes < max_bytes:
            raise ValueError("max_buffered_bytes must be at least max_bytes (else a full body never fits)")
        self.app = app
        self.max_bytes = max_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.stream_chunked = stream_chunked
        # Chunked-body bytes held right now, by every request together.
        self.buffered_bytes = 0

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
                    await send_json(send, 400, error_body(400, "invalid Content-Length header"))
                    return
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        if self.stream_chunked:
            await self._counted(scope, receive, send)
            return
        # No declared length (chunked): buffer up to the limit, then replay.
        held = 0
        try:
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
                if self.buffered_bytes + len(body) > self.max_buffered_bytes:
                    await self._busy(send)
                    return
                self.buffered_bytes += len(body)
                held += len(body)
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
        finally:
            self.buffered_bytes -= held

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A chunked body passed through as it arrives, cut off past `max_bytes` with a 413."""
        size = 0
        cut = started = False

        async def counted() -> Message:
            nonlocal size, cut
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    cut = True
                    return {"type": "http.disconnect"}
            return message

        async def answer(message: Message) -> None:
            nonlocal started
            if cut and not started:
                return  # the app's answer to the disconnect it saw: the 413 below replaces it
            started = True
            await send(message)

        try:
            await self.app(scope, counted, answer)
        except Exception:
            if not cut:
                raise
        if cut and not started:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        message = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        await send_json(send, 413, error_body(413, message, code="request_too_large"))

    async def _busy(self, send: Send) -> None:
        message = (
            "the server is buffering too many chunked request bodies right now "
            f"(max_buffered_body_bytes={self.max_buffered_bytes}); retry shortly, or send a "
            "Content-Length header"
        )
        await send_json(send, 503, error_body(503, message, code="overloaded"), retry_after="1")
