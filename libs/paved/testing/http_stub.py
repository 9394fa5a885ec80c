"""A loopback HTTP service for tests: the stand-in for a backend, a control plane, an exporter.

`LoopbackHTTPServer(Handler)` serves a `BaseHTTPRequestHandler` class on 127.0.0.1 (a free
port) from a daemon thread, one thread per request; `close()` (or leaving its `with`) stops the
loop, closes the socket and joins the thread, so no test leaves one behind. `reply` writes a
whole answer (status, headers, body with its Content-Length) from a handler.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class LoopbackHTTPServer:
    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port: int = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> LoopbackHTTPServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def reply(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes = b"",
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
) -> None:
    handler.send_response(status)
    if content_type is not None:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(body)
