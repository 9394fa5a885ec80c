"""Loopback HTTP services for tests: the stand-in for a backend, a control plane, an exporter.

`LoopbackHTTPServer(Handler)` serves a `BaseHTTPRequestHandler` class on 127.0.0.1 (a free
port) from a daemon thread, one thread per request; `close()` (or leaving its `with`) stops the
loop, closes the socket and joins the thread, so no test leaves one behind. `reply` writes a
whole answer (status, headers, body with its Content-Length) from a handler.
`TricklingServer` answers a head, then one byte at a time, for ever: a peer too slow to
finish but never silent long enough for a socket timeout.
"""

from __future__ import annotations

import socket
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


class TricklingServer:
    """Answers every connection (after reading its request) with `head`, then `trickle` every
    `interval_s`, until closed: each read of it returns well within any socket timeout, and
    the answer never completes."""

    def __init__(self, head: bytes, trickle: bytes = b"\0", interval_s: float = 0.1):
        self.head, self.trickle, self.interval_s = head, trickle, interval_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(self.head)
            while not self._stop.wait(self.interval_s):
                conn.sendall(self.trickle)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for conn in self._conns:
            conn.close()
