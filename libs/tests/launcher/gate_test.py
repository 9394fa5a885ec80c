"""The launcher's start gate and drain, with a small real HTTP server as the child.

The child behaves like the paved frontend: it listens at once, answers /health/ready 503
until it is "loaded", streams /slow, and on SIGTERM finishes in-flight requests then exits.
Each test runs the real launcher CLI (`python -m paved.launcher.main`) on a local package.
"""

import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from paved.launcher.build import build_package
from paved.launcher.gate import free_port, reserve
from paved.launcher.testing import LauncherProcess

CHILD = r"""
import os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, ready_after, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
start = time.monotonic()
print(f"fake engine: loading {sys.argv[4]}", flush=True)
if mode == "fail":
    time.sleep(ready_after)
    print("Traceback (most recent call last):", flush=True)
    print("RuntimeError: CUDA out of memory while loading weights", flush=True)
    sys.exit(3)

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.handle_get()
        # Like uvicorn: once draining, a connection ends after its in-flight response.
        if draining.is_set():
            self.close_connection = True
    def handle_get(self):
        if self.path == "/health/ready":
            ok = time.monotonic() - start >= ready_after and not draining.is_set()
            if mode.startswith("file:"):  # ready once the test creates this file
                ok = ok and os.path.exists(mode[len("file:"):])
            body = b"ready" if ok else b"loading"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path.startswith("/slow"):
            n = int(self.path.split("=")[1])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                chunk = f"tok{i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

draining = threading.Event()
if len(sys.argv) > 5:  # a second, non-HTTP port (gRPC's place): a TCP echo server
    import socketserver
    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            while data := self.request.recv(65536):
                self.request.sendall(data)
    echo = socketserver.ThreadingTCPServer(("127.0.0.1", int(sys.argv[5])), Echo)
    echo.daemon_threads = True
    threading.Thread(target=echo.serve_forever, daemon=True).start()
server = ThreadingHTTPServer(("127.0.0.1", port), H)
server.daemon_threads = False
def on_term(*_):
    if mode == "stubborn":
        print("fake engine: ignoring SIGTERM", flush=True)
        return
    draining.set()
    threading.Thread(target=server.shutdown).start()
signal.signal(signal.SIGTERM, on_term)
if mode == "crash":  # serves, then dies on its own after a while
    def crash():
        time.sleep(ready_after + 1.0)
        print("RuntimeError: engine core died unexpectedly", flush=True)
        os._exit(7)
    threading.Thread(target=crash, daemon=True).start()
server.serve_forever()
server.server_close()  # joins the request threads: in-flight requests finish
print("fake engine: drained", flush=True)
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkg")
    hf = d / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    build_package(str(hf), str(d / "pkg"), "fake", "1")
    (d / "child.py").write_text(CHILD)
    return d


class PortWatch:
    """Tries to connect to a port every 20 ms; records whether it ever accepted."""

    def __init__(self, port):
        self.port, self.accepted_at, self._stop = port, None, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                self.accepted_at = self.accepted_at or time.monotonic()
            except OSError:
                pass
            time.sleep(0.02)

    def stop(self):
        self._stop.set()
        self._t.join()


def _launch(tmp_path, package, *, ready_after=1.5, mode="ok", extra=(), port=None):
    port, admin = port or free_port(), free_port()
    child = f"{{python}} {package / 'child.py'} {{http_port}} {ready_after} {mode} {{model_dir}}"
    if "--grpc-port" in extra:
        child += " {grpc_port}"
    args = [
        str(package / "pkg"), "--cache-dir", str(tmp_path / "cache"), "--port", str(port),
        "--admin-port", str(admin), "--child-cmd", child, *extra,
    ]  # fmt: skip
    return LauncherProcess(args, str(tmp_path / "launcher.log")), port, admin


def _get(port, path, timeout=5):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_admin(admin, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return _get(admin, "/status")
        except OSError:
            time.sleep(0.05)
    raise AssertionError("admin port never answered")


def test_public_port_opens_only_when_ready_and_relays(tmp_path, package):
    proc, port, admin = _launch(tmp_path, package, ready_after=2.0)
    watch = PortWatch(port)
    try:
        _wait_admin(admin)
        status, body = _get(admin, "/health/ready")
        assert status == 503, body
        # Ready only once the child is: until then the public port refuses connections.
        m = proc.wait_line(r"paved launcher: ready: fake:1 on http 127\.0\.0\.1:(\d+)", 60)
        assert m, proc.stderr()
        ready_seen = time.monotonic()
        assert int(m.group(1)) == port
        assert watch.accepted_at is None or watch.accepted_at >= ready_seen - 0.5
        assert _get(admin, "/health/ready")[0] == 200
        st = json.loads(_get(admin, "/status")[1])
        assert st["phase"] == "ready" and st["package"]["model_id"] == "fake"
        assert st["timings_s"]["ready"] >= 2.0
        # Relayed to the child, chunked streaming included.
        assert _get(port, "/health/ready") == (200, b"ready")
        assert _get(port, "/slow?n=3")[1] == b"tok0\ntok1\ntok2\n"
    finally:
        watch.stop()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr()


def test_public_port_is_held_from_the_start_refusing_until_ready(tmp_path, package):
    ready_file = tmp_path / "ready"
    proc, port, admin = _launch(tmp_path, package, ready_after=0, mode=f"file:{ready_file}")
    try:
        _wait_admin(admin)
        deadline = time.monotonic() + 60
        while (st := json.loads(_get(admin, "/status")[1]))["phase"] != "starting" or not st["child_pid"]:
            assert time.monotonic() < deadline and st["phase"] != "failed", st
            time.sleep(0.05)
        # The engine runs and is not ready: the port is the launcher's (shown on /status, not
        # bindable by anyone else) and refuses connections.
        assert st["ports"]["http"] == ["127.0.0.1", port]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="in use"):
                other.bind(("127.0.0.1", port))
        assert _get(admin, "/health/ready")[0] == 503
        ready_file.touch()
        assert proc.wait_line(rf"paved launcher: ready: fake:1 on http 127\.0\.0\.1:{port}\b", 60), (
            proc.stderr()
        )
        assert _get(port, "/health/ready") == (200, b"ready")
    finally:
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr()
    # Released on exit: a next launcher gets the port (its served connections' TIME_WAIT left
    # on it takes reserve()'s SO_REUSEADDR retry).
    with reserve("127.0.0.1", port) as again:
        again.listen()


@pytest.mark.parametrize("route", ["http", "grpc"])
@pytest.mark.parametrize("holder", ["listening", "reserved"])
def test_a_taken_public_port_fails_the_start_before_the_engine(tmp_path, package, route, holder):
    """Another server listens on the port, or another launcher holds it: exit 1 at once, with
    nothing materialized and no engine started (not after a model load)."""
    with reserve("127.0.0.1", 0) as busy:
        if holder == "listening":
            busy.listen()
        taken = busy.getsockname()[1]
        if route == "grpc":
            proc, port, _ = _launch(tmp_path, package, ready_after=0, extra=("--grpc-port", str(taken)))
        else:
            proc, port, _ = _launch(tmp_path, package, ready_after=0, port=taken)
        try:
            code = proc.wait(60)
        finally:
            proc.kill()
    err = proc.stderr()
    flag = "--grpc-port" if route == "grpc" else "--port"
    assert code == 1, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"launcher: start failed: cannot bind the public port 127.0.0.1:{taken} ({flag}): ")
    ), err
    assert "phase: materializing" not in err and "fake engine: loading" not in err, err
    if route == "grpc":  # the --port reserved before it was released too
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))


def test_a_second_port_is_gated_and_relayed_too(tmp_path, package):
    grpc = free_port()
    proc, _, _ = _launch(tmp_path, package, ready_after=1.5, extra=("--grpc-port", str(grpc)))
    watch = PortWatch(grpc)
    try:
        m = proc.wait_line(
            r"paved launcher: ready: fake:1 on http 127\.0\.0\.1:\d+, grpc 127\.0\.0\.1:(\d+)", 60
        )
        assert m, proc.stderr()
        ready_seen = time.monotonic()
        assert int(m.group(1)) == grpc
        assert watch.accepted_at is None or watch.accepted_at >= ready_seen - 0.5
        with socket.create_connection(("127.0.0.1", grpc), timeout=5) as s:
            s.sendall(b"\x00\x00\x12PRI * HTTP/2.0")  # any bytes: a TCP splice
            got = b""
            while len(got) < 17:
                got += s.recv(100)
        assert got == b"\x00\x00\x12PRI * HTTP/2.0"
    finally:
        watch.stop()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr()


def test_grpc_port_needs_a_child_that_serves_it(tmp_path, package):
    port = free_port()
    args = [str(package / "pkg"), "--cache-dir", str(tmp_path / "c"), "--port", str(port), "--grpc-port", "0"]
    proc = LauncherProcess(args, str(tmp_path / "l.log"))
    assert proc.wait(60) == 1
    assert "--grpc-port needs a --child-cmd" in proc.stderr()


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path, package):
    proc, port, _ = _launch(tmp_path, package, ready_after=0.5)
    assert proc.wait_line(r"paved launcher: ready", 60), proc.stderr()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/slow?n=20")  # ~2 s of streaming
    resp = conn.getresponse()
    first = resp.readline()
    assert first == b"tok0\n"
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    # New connections are refused promptly while the old one keeps streaming.
    refused = False
    while time.monotonic() - t0 < 1.5 and not refused:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            time.sleep(0.05)
        except OSError:
            refused = True
    assert refused, "the public port still accepts connections while draining"
    rest = resp.read()
    assert first + rest == b"".join(f"tok{i}\n".encode() for i in range(20))
    assert proc.wait(30) == 0, proc.stderr()
    log = proc.stderr()
    assert "phase: draining" in log and "fake engine: drained" in log and "phase: stopped" in log


def test_engine_start_failure_exits_1_with_reason_and_port_never_opened(tmp_path, package):
    proc, port, _ = _launch(tmp_path, package, ready_after=1.0, mode="fail")
    watch = PortWatch(port)
    try:
        code = proc.wait(60)
    finally:
        watch.stop()
    err = proc.stderr()
    assert code == 1, err
    assert "start failed: the engine failed to start (exit code 3)" in err
    assert "RuntimeError: CUDA out of memory while loading weights" in err.splitlines()[-1]
    assert watch.accepted_at is None, "the public port was opened"


def test_engine_dying_while_serving_exits_1(tmp_path, package):
    proc, port, _ = _launch(tmp_path, package, ready_after=0.3, mode="crash")
    assert proc.wait_line(r"paved launcher: ready", 60), proc.stderr()
    assert proc.wait(30) == 1
    last = proc.stderr().strip().splitlines()[-1]
    assert last == (
        "launcher: failed: the engine process exited (code 7): RuntimeError: engine core died unexpectedly"
    ), last
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_drain_deadline_kills_a_stuck_engine_and_exits_1(tmp_path, package):
    proc, _port, _admin = _launch(
        tmp_path,
        package,
        ready_after=0.2,
        mode="stubborn",
        extra=("--drain-timeout", "1", "--stop-grace", "1"),
    )
    assert proc.wait_line(r"paved launcher: ready", 60), proc.stderr()
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 1
    assert 1.5 < time.monotonic() - t0 < 10
    assert "did not stop within 2s; killed" in proc.stderr()


def test_sigterm_while_starting_stops_the_child_and_exits_0(tmp_path, package):
    proc, _, admin = _launch(tmp_path, package, ready_after=60)
    _wait_admin(admin)
    deadline = time.monotonic() + 60
    while (st := json.loads(_get(admin, "/status")[1]))["phase"] != "starting":
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    assert st["child_pid"]
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr()
    with pytest.raises(ProcessLookupError):
        os.kill(st["child_pid"], 0)


def test_bad_usage_exits_2(tmp_path):
    proc = LauncherProcess(["x", "--workers", "0"], str(tmp_path / "l.log"))
    assert proc.wait(30) == 2


def test_a_burst_of_300_connections_all_connect_and_are_answered():
    """300 clients connect at once while the gate's event loop is busy (blocked here), as a
    gateway opens one connection per concurrent stream: every connection completes its handshake
    in the kernel's accept queue, then each gets its answer through the relay. With asyncio's
    default backlog (100) the surplus SYNs were dropped, and those clients waited for SYN
    retransmits (1 s, 3 s, 7 s) until their connect timed out."""
    import asyncio
    import errno
    import select

    from paved.launcher.gate import Gate, Route

    n = 300
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    loop = asyncio.new_event_loop()
    started, unblock = threading.Event(), threading.Event()
    holder: dict = {}

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def setup():
        child = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        gate = Gate([Route("http", "127.0.0.1", 0, child.sockets[0].getsockname()[1])])
        await gate.open()
        holder.update(child=child, gate=gate)

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(setup())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    port = holder["gate"].bound["http"][1]
    loop.call_soon_threadsafe(unblock.wait)  # the gate accepts nothing until released
    clients = []
    try:
        for _ in range(n):
            c = socket.socket()
            c.setblocking(False)
            assert c.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
            clients.append(c)
        # A handshake completes in the kernel while the gate's loop is blocked only if the
        # accept queue has room for it; the wait bounds a failure, it is not a timing assertion.
        pending, deadline = set(clients), time.monotonic() + 20
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.5)
            for c in writable:
                assert c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                pending.discard(c)
        assert not pending, f"{len(pending)} of {n} connections never got through the handshake"
        unblock.set()
        for c in clients:
            c.setblocking(True)
            c.settimeout(30)
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for c in clients:
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            assert data == answer
    finally:
        unblock.set()
        for c in clients:
            c.close()

        async def teardown():
            await holder["gate"].abort()
            holder["child"].close()

        asyncio.run_coroutine_threadsafe(teardown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("head", ["line", "header"])
def test_admin_port_answers_431_to_a_request_head_over_64_kib(head):
    """A request line or header field past the stream limit is answered (431) and closed; it
    raised out of the handler before, and the client got no answer at all."""
    import asyncio

    from paved.launcher.gate import AdminServer

    big = b"a" * 200_000

    async def scenario():
        admin = AdminServer(lambda: {"phase": "ready"}, lambda: True)
        host, port = await admin.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection(host, port)
            if head == "line":
                writer.write(b"GET /" + big + b" HTTP/1.1\r\n\r\n")
            else:
                writer.write(b"GET /status HTTP/1.1\r\nX-Big: " + big + b"\r\n\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /status HTTP/1.1\r\n\r\n")
            after = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return answer, after
        finally:
            admin.close()

    answer, after = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"error": "request line or header field too long"}
    assert after.startswith(b"HTTP/1.1 200 ") and after.endswith(b'{"phase": "ready"}')


def test_admin_client_still_connected_at_shutdown_logs_no_error(caplog):
    """The launcher's loop ends while an admin client is still connected (here: one answered 431,
    its handler dropping the rest of its request): the cancelled handler is no error traceback."""
    import asyncio

    from paved.launcher.gate import AdminServer

    async def scenario():
        admin = AdminServer(lambda: {"phase": "ready"}, lambda: True)
        host, port = await admin.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"}"), 30)
        admin.close()
        return answer, writer  # left open: asyncio.run cancels the handler

    with caplog.at_level("ERROR", logger="asyncio"):
        answer, _ = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
