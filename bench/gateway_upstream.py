"""A minimal OpenAI-shaped upstream for //bench:gateway: fixed answers, as fast as Python gets.

    python -m bench.gateway_upstream [--port 0] [--cpu N]

A raw asyncio protocol on uvloop with httptools' parser (no framework), HTTP/1.1 keep-alive:

  * POST /v1/chat/completions, /v1/completions: a fixed small `chat.completion` JSON, or with
    `"stream": true` an SSE stream (role chunk, three content chunks, a finish chunk, a usage
    chunk, `data: [DONE]`) in one chunked write;
  * GET /health/ready, /health, /health/liveliness, /v1/models: 200.

Prints `serving upstream on http://127.0.0.1:PORT` once listening. The request body is only
scanned for `"stream": true` (a real JSON parse would be most of this server's cost); anything
else gets 404. It exists so that what //bench:gateway measures is the proxy in front of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import sys

import httptools
import uvloop

_STREAM = re.compile(rb'"stream"\s*:\s*true')
_CREATED = 1_700_000_000

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": _CREATED,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the bench upstream."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
    },
    separators=(",", ":"),
).encode()


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": "tiny",
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


_SSE = b"".join(
    [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hello"}),
        _chunk({"content": " from the"}),
        _chunk({"content": " bench upstream."}),
        _chunk({}, finish="stop"),
        _chunk({}, usage={"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}),
        b"data: [DONE]\n\n",
    ]
)


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_JSON_OK = _response(b"200 OK", b"application/json", _COMPLETION)
_READY = _response(b"200 OK", b"application/json", b'{"status":"ok"}')
_MODELS = _response(
    b"200 OK", b"application/json", b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
)
_NOT_FOUND = _response(b"404 Not Found", b"application/json", b'{"error":{"message":"not found"}}')
# One chunked-encoding chunk then the terminator: a real stream on the wire (the proxies must
# parse SSE out of a chunked body), written at once so the upstream costs one send.
_SSE_OK = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n" + f"{len(_SSE):x}".encode() + b"\r\n" + _SSE + b"\r\n0\r\n\r\n"
)
_GET = {b"/health/ready": _READY, b"/health": _READY, b"/health/liveliness": _READY, b"/v1/models": _MODELS}
_POST = (b"/v1/chat/completions", b"/v1/completions")
# Request bodies beyond this are refused (the bench sends a few hundred bytes).
_MAX_BODY = 1 << 20


class _Http(asyncio.Protocol):
    """One connection: parse requests as bytes arrive, answer each on message completion."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_response(b"400 Bad Request", b"text/plain", b"bad request"))
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body, self.size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= _MAX_BODY:
            self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if self.size > _MAX_BODY:
            out = _response(b"413 Payload Too Large", b"text/plain", b"too large")
        elif method == b"POST" and path in _POST:
            out = _SSE_OK if _STREAM.search(b"".join(self.body)) else _JSON_OK
        elif method == b"GET":
            out = _GET.get(path, _NOT_FOUND)
        else:
            out = _NOT_FOUND
        self.transport.write(out)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = await loop.create_server(_Http, sock=sock, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving upstream on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await stop.wait()
    server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--cpu", type=int, help="pin this process to this CPU")
    args = parser.parse_args()
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in [0, 65535]")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    uvloop.run(_serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
