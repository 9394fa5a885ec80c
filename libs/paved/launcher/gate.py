"""The port gate: public ports reserved at start, listening only once the engine is ready.

The served process (the paved frontend, or vLLM's server in standalone mode) listens on private
loopback ports it is given; the paved frontend, for one, opens its port at once and answers
/health/ready 503 while the engine loads. The launcher binds the public ports at its start
(`reserve`: bound, not listening, so a model that loads for minutes cannot lose its port to
another process meanwhile, and a taken port fails the start at once), polls that readiness
endpoint, and only when it answers 200 serves them. Before that a client gets "connection
refused" (a bound socket that does not listen answers a SYN with a reset), never a half-started
server; if the engine fails, the public port is never opened.

A public port is served one of two ways:

- Handed off (no relay): a child that can take it (the paved frontend's `--listen-fd`, the
  launcher's `{http_fd}` placeholder) inherits the reserved socket at spawn and listens on it
  itself once its engines are ready; the launcher closes its own copy, so the socket lives and
  dies with the child (a dead child's port refuses at once). Clients then talk to the server
  directly: no extra hop, no bytes copied in Python, the real peer address. The child's own
  bounds apply there (the frontend's admission limits, uvicorn's keep-alive timeout), not
  `max_connections` / `idle_timeout_s`.
- Relayed (this module's `Gate`; every other child, and gRPC: grpcio cannot serve an inherited
  socket): the launcher listens once the child is ready and relays bytes both ways (a TCP
  splice, so HTTP, SSE and gRPC / HTTP/2 pass unchanged). Cost: one loopback hop per
  connection, every byte copied through the launcher's event loop (measured with 300 streams
  of 300 small SSE events each: the relay spent 0.9 s of CPU where the server producing them
  spent 0.55 s), and the child sees 127.0.0.1 as the peer address.

Either way the listener's accept queue is as deep as the kernel allows (LISTEN_BACKLOG in
paved.http.sockets, capped by net.core.somaxconn): with asyncio's default of 100, a burst of
300 connections (a gateway opening one per concurrent stream) overflowed it, the kernel
dropped the surplus SYNs, and those clients only retried after 1 s, 3 s, 7 s: a gateway's
connect timed out.

On drain the public listeners close first (new connections are refused) while established
connections carry their in-flight requests to the end: the gate closes its listeners; a child
serving a handed-off socket closes it when it gets SIGTERM (uvicorn's shutdown does).

Bounds of the relay: at most `max_connections` relayed connections at once (default 1024); one
more is answered `503` with an OpenAI-style error body naming the limit on the HTTP route, and
on the gRPC route with gRPC status UNAVAILABLE (14) naming it (a minimal HTTP/2 exchange: the
server's SETTINGS, a trailers-only answer on the client's first stream, GOAWAY), so a gRPC
client reads why rather than a bare reset. A relayed connection with no bytes in either
direction for `idle_timeout_s` (default 600 s; 0: never) is closed: a vanished client cannot
pin a slot and two file descriptors for ever. Long generations that send nothing for that long
need a larger value (streams send tokens; gRPC clients keepalives).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paved.http.sockets import LISTEN_BACKLOG
from paved.net import free_port as free_port  # the launcher's callers and tests take it from here

log = logging.getLogger("paved.launcher")
_BUF = 256 * 1024
_PATHS = ["/health/live", "/health/ready", "/status"]
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_IDLE_TIMEOUT_S = 600.0


def reserve(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that does not listen yet: the port is held, and a
    connection to it is refused until `Gate.open()` listens. Raises OSError if it is taken.

    First without SO_REUSEADDR: on Linux two sockets that both set it may bind one port while
    neither listens, so a reservation that set it would not keep another such server (or
    launcher) out; the later listen() would fail instead. Only if that bind fails is it retried
    with SO_REUSEADDR, as a server binds: a previous run's connections in TIME_WAIT then do not
    block the port, while a port another socket listens on (or holds without it) still fails.
    `Gate.open()` sets SO_REUSEADDR before it listens. (An outgoing connection's ephemeral port
    never lands on a port bound with bind().)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for reuse in (False, True):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if family == socket.AF_INET6:
                # As asyncio's servers: an IPv6 address does not also take the IPv4 port.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if reuse:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            return sock
        except BaseException as e:
            sock.close()
            if reuse or not (isinstance(e, OSError) and e.errno == errno.EADDRINUSE):
                raise
    raise AssertionError("unreachable: the second bind returns or raises")


async def http_get(host: str, port: int, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """A minimal HTTP/1.1 GET (status, body); raises OSError / TimeoutError when unreachable."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = data.partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise OSError(f"not an HTTP answer from {host}:{port}")
        return int(parts[1]), body

    return await asyncio.wait_for(go(), timeout_s)


@dataclass(frozen=True)
class Route:
    name: str  # "http", "grpc"
    public_host: str
    public_port: int
    private_port: int
    private_host: str = "127.0.0.1"


class Gate:
    """Relays the public ports to the child's private ports once `open()` is called.

    `sockets`: route name -> a socket from `reserve()` for that route's public address; the
    gate owns them from then on (`open()` listens on them, `close_listeners()` / `abort()`
    close them, opened or not). A route without one is bound by `open()` itself."""

    def __init__(
        self,
        routes: list[Route],
        *,
        sockets: dict[str, socket.socket] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ):
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if idle_timeout_s < 0:
            raise ValueError("idle_timeout_s must be >= 0 (0: no idle timeout)")
        self.routes = routes
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        # Reserved sockets not yet listening; a started server owns (and closes) its socket.
        self._reserved: dict[str, socket.socket] = dict(sockets or {})
        self._servers: list[asyncio.base_events.Server] = []
        self._conns: set[asyncio.Task] = set()
        self._refusing: set[asyncio.Task] = set()
        # The public addresses: known from the reservation on, listening only after open().
        self.bound: dict[str, tuple[str, int]] = {
            name: sock.getsockname()[:2] for name, sock in self._reserved.items()
        }
        # Connections refused at the cap and closed idle, for /status and tests.
        self.refused = 0
        self.idle_closed = 0

    async def open(self) -> None:
        _raise_fd_limit(2 * self.max_connections + 256)
        for route in self.routes:
            sock = self._reserved.get(route.name)
            if sock is None:
                sock = reserve(route.public_host, route.public_port)
                self._reserved[route.name] = sock
            # A served connection's socket inherits the listener's SO_REUSEADDR, and so does its
            # TIME_WAIT, which without it would block the next launcher's bind of this port for
            # a minute; set only now, as `reserve` explains.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # start_server listens on the socket (until now a connection to it was refused).
            server = await asyncio.start_server(
                functools.partial(self._accept, route=route),
                sock=sock,
                limit=_BUF,
                backlog=LISTEN_BACKLOG,
            )
            del self._reserved[route.name]
            self._servers.append(server)
            self.bound[route.name] = server.sockets[0].getsockname()[:2]

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route) -> None:
        if len(self._conns) >= self.max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning(
                    "gate %s: %d connections open, the limit (--max-connections %d); refusing (%d so far)",
                    route.name,
                    len(self._conns),
                    self.max_connections,
                    self.refused,
                )
            task = asyncio.get_running_loop().create_task(self._refuse(reader, writer, route))
            self._refusing.add(task)
            task.add_done_callback(self._refusing.discard)
            return
        task = asyncio.get_running_loop().create_task(self._relay(reader, writer, route))
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route) -> None:
        try:
            if route.name == "http":
                writer.write(_busy_response(self.max_connections))
                await writer.drain()
            elif route.name == "grpc":
                with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, ValueError):
                    await asyncio.wait_for(_grpc_unavailable(reader, writer, self.max_connections), 5.0)
            if writer.can_write_eof():
                writer.write_eof()
            # Closing with unread request bytes would reset the connection, and the client
            # could lose the answer: read (briefly) what it sent first.
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(reader.read(_BUF), 1.0)
        except OSError:
            pass
        finally:
            writer.close()

    async def _relay(
        self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter, route: Route
    ) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(
                route.private_host, route.private_port, limit=_BUF
            )
        except OSError as e:
            log.warning("gate %s: cannot reach the child on port %d: %s", route.name, route.private_port, e)
            c_writer.close()
            return
        for w in (c_writer, u_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        activity = [time.monotonic()]
        up = asyncio.ensure_future(_pipe(c_reader, u_writer, activity))
        down = asyncio.ensure_future(_pipe(u_reader, c_writer, activity))
        watchers: set[asyncio.Future[Any]] = {up, down}
        idle: asyncio.Future[None] | None = None
        if self.idle_timeout_s:
            idle = asyncio.ensure_future(_idle(activity, self.idle_timeout_s))
            watchers.add(idle)
        try:
            done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
            if idle is not None and idle in done:
                self.idle_closed += 1
                log.info(
                    "gate %s: closing a connection idle for %gs (--idle-timeout)",
                    route.name,
                    self.idle_timeout_s,
                )
            elif up in done and up.result():
                # The client half-closed after its request: the answer may still be coming.
                rest: set[asyncio.Future[Any]] = {down} if idle is None else {down, idle}
                done, _ = await asyncio.wait(rest, return_when=asyncio.FIRST_COMPLETED)
                if idle is not None and idle in done:
                    self.idle_closed += 1
        finally:
            # The child ended the connection (or the client vanished): end both sides.
            for task in watchers:
                task.cancel()
            for w in (c_writer, u_writer):
                w.close()

    def close_listeners(self) -> None:
        for server in self._servers:
            server.close()
        for sock in self._reserved.values():
            sock.close()
        self._reserved.clear()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def wait_connections(self, timeout_s: float) -> bool:
        """Wait for relayed connections to end; True if all did within the timeout."""
        if not self._conns:
            return True
        _, pending = await asyncio.wait(set(self._conns), timeout=max(timeout_s, 0))
        return not pending

    async def abort(self) -> None:
        self.close_listeners()
        for task in [*self._conns, *self._refusing]:
            task.cancel()
        await asyncio.gather(*self._conns, *self._refusing, return_exceptions=True)


def _busy_response(limit: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"this server has {limit} connections open, its limit (--max-connections); "
                "retry shortly",
                "type": "service_unavailable_error",
                "param": None,
                "code": "overloaded",
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_HEADERS, _H2_SETTINGS, _H2_GOAWAY = 0x1, 0x4, 0x7
_H2_END_STREAM, _H2_END_HEADERS = 0x1, 0x4
# Frames read before the client's first HEADERS, at most (a client sends SETTINGS, maybe a
# WINDOW_UPDATE, then HEADERS): a peer that sends more is not a gRPC client.
_H2_MAX_FRAMES = 16


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field as "literal without indexing, new name" (RFC 7541 6.2.2), no Huffman;
    lengths < 127 fit the 7-bit prefix (the caller's fields are short)."""
    if len(name) >= 127 or len(value) >= 127:
        raise ValueError("header field too long for a one-byte length")
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


async def _grpc_unavailable(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int) -> None:
    """Answer the client's first gRPC call with UNAVAILABLE naming the connection limit."""
    if await reader.readexactly(len(_H2_PREFACE)) != _H2_PREFACE:
        raise ValueError("not HTTP/2")
    writer.write(_h2_frame(_H2_SETTINGS, 0, 0, b""))
    stream = 0
    for _ in range(_H2_MAX_FRAMES):
        head = await reader.readexactly(9)
        length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
        if length > 1 << 14:
            raise ValueError("frame larger than the default maximum")
        await reader.readexactly(length)
        if kind == _H2_SETTINGS and not flags & 0x1:
            writer.write(_h2_frame(_H2_SETTINGS, 0x1, 0, b""))  # ACK the client's settings
        if kind == _H2_HEADERS:
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            break
    if not stream:
        raise ValueError("no request")
    # Printable ASCII but '%' needs no percent-encoding in grpc-message.
    message = f"{limit} connections open, the server's limit (--max-connections); retry shortly"
    block = (
        b"\x88"  # :status 200 (static table index 8)
        + _hpack_literal(b"content-type", b"application/grpc")
        + _hpack_literal(b"grpc-status", b"14")
        + _hpack_literal(b"grpc-message", message.encode())
    )
    writer.write(_h2_frame(_H2_HEADERS, _H2_END_STREAM | _H2_END_HEADERS, stream, block))
    writer.write(_h2_frame(_H2_GOAWAY, 0, 0, stream.to_bytes(4, "big") + (0).to_bytes(4, "big")))
    await writer.drain()


def _raise_fd_limit(wanted: int) -> None:
    """Each relayed connection holds two descriptors: lift the soft limit toward the cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning(
            "gate: the descriptor limit (%d) is below what --max-connections needs (%d)", target, wanted
        )


async def _idle(activity: list[float], timeout_s: float) -> None:
    """Return once no byte moved for `timeout_s`."""
    while True:
        remaining = activity[0] + timeout_s - time.monotonic()
        if remaining <= 0:
            return
        await asyncio.sleep(remaining)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: list[float]) -> bool:
    """Copy until EOF; True on a clean EOF (passed on as a half-close), False on an error.
    `activity[0]` is the time bytes last moved (the idle timeout reads it)."""
    try:
        while data := await reader.read(_BUF):
            activity[0] = time.monotonic()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except (ConnectionError, OSError):
        return False


class AdminServer:
    """Control-plane endpoints: /health/live, /health/ready (200 only while serving), /status."""

    def __init__(self, status: Callable[[], dict], ready: Callable[[], bool]):
        self._status = status
        self._ready = ready
        self._server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listens; returns the bound (host, port)."""
        self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = (bound_host, bound_port)
        return self.address

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                # One deadline for the whole head: a client trickling header lines is cut too.
                async with asyncio.timeout(5):
                    line = await reader.readline()
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
            except (ValueError, asyncio.LimitOverrunError):
                # A line past the stream's limit (64 KiB): readline raises instead of returning.
                await self._answer(writer, 431, {"error": "request line or header field too long"})
                # Closing with the rest of the request unread would reset the connection, and
                # the client would lose the answer: read (and drop) it for a while first.
                if writer.can_write_eof():
                    writer.write_eof()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        dropped = 0
                        while dropped < (16 << 20) and (data := await reader.read(1 << 16)):
                            dropped += len(data)
                return
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            status = self._status()
            if path == "/health/live":
                code, body = 200, {"status": "live", "phase": status["phase"]}
            elif path == "/health/ready":
                code = 200 if self._ready() else 503
                body = {"status": "ready" if code == 200 else "not ready", "phase": status["phase"]}
            elif path == "/status":
                code, body = 200, status
            else:
                code, body = (
                    404,
                    {"error": "not found", "paths": ["/health/live", "/health/ready", "/status"]},
                )
            await self._answer(writer, code, body)
        except (TimeoutError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            # The loop is shutting down with this client still connected. Not re-raised: the
            # task ends here anyway, and Python 3.11's start_server callback logs a cancelled
            # handler as an "unhandled exception" traceback.
            pass
        finally:
            writer.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, code: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        reason = {
            200: "OK",
            404: "Not Found",
            431: "Request Header Fields Too Large",
            503: "Service Unavailable",
        }[code]
        writer.write(
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
