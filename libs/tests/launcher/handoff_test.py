"""The launcher hands the public HTTP socket to the paved frontend (`--listen-fd {http_fd}`):
no relay on the data path, still refused until the engines are ready, closed first on drain.

Real processes: the launcher CLI, the paved frontend over the simulated engine (sim://), and
for the not-ready phase a frontend whose remote engine (kserve://) answers only once the test
starts the KServe server it waits for.
"""

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from paved.launcher.build import build_package
from paved.launcher.gate import free_port
from paved.launcher.testing import LauncherProcess, minimal_hf_dir, subprocess_env


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkg")
    build_package(minimal_hf_dir(d / "hf"), str(d / "pkg"), "fake", "1")
    return d / "pkg"


def _launch(tmp_path, package, engine: str):
    port, admin = free_port(), free_port()
    child = (
        f"{{python}} -m paved.frontend.server --engine {engine} --model fake --port {{http_port}} "
        "--drain-timeout 30 --listen-fd {http_fd}"
    )
    args = [
        str(package), "--cache-dir", str(tmp_path / "cache"), "--port", str(port),
        "--admin-port", str(admin), "--child-cmd", child,
    ]  # fmt: skip
    return LauncherProcess(args, str(tmp_path / "launcher.log")), port, admin


def _get(port, path, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _refused(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _listening_inode(port) -> str:
    """The inode of the socket listening on 127.0.0.1:port (from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # 0A: LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def _holds(pid, inode) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    targets = set()
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            targets.add(os.readlink(f"{fd_dir}/{fd}"))
    return f"socket:[{inode}]" in targets


def _wait_log(proc, text, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while text not in proc.stderr():
        assert proc.proc.poll() is None, proc.stderr()
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{proc.stderr()}"
        time.sleep(0.1)


def test_the_frontend_listens_on_the_handed_off_port_only_once_its_engine_is_ready(tmp_path, package):
    grpc_port = free_port()
    proc, port, admin = _launch(tmp_path, package, f"kserve://127.0.0.1:{grpc_port}")
    backend = None
    try:
        # The frontend runs (its lifespan started) while its engine waits for the remote model:
        # the public socket, bound and now the child's, refuses.
        _wait_log(proc, "Application startup complete")
        assert json.loads(_get(admin, "/status")[1])["phase"] == "starting"
        assert _refused(port)
        backend = subprocess.Popen(
            [sys.executable, "-m", "paved.frontend.server", "--engine", "sim://fake",
             "--port", "0", "--kserve-grpc-port", str(grpc_port)],
            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        m = proc.wait_line(r"paved launcher: ready: fake:1 on http 127\.0\.0\.1:(\d+)", 120)
        assert m and int(m.group(1)) == port, proc.stderr()
        status = json.loads(_get(admin, "/status")[1])
        assert status["served_by_child"] == ["http"]
        # The frontend itself holds the listening socket: the launcher keeps no copy of it.
        inode = _listening_inode(port)
        assert _holds(status["child_pid"], inode) and not _holds(proc.proc.pid, inode)
        assert _get(port, "/v1/models")[0] == 200
    finally:
        proc.kill()
        if backend is not None:
            backend.terminate()
            backend.wait(30)


def test_a_burst_on_the_handed_off_port_is_answered_and_drain_refuses_new_connections(tmp_path, package):
    proc, port, admin = _launch(tmp_path, package, "sim://fake?tokens_per_s=20")
    try:
        assert proc.wait_line(r"paved launcher: ready", 120), proc.stderr()
        # 300 connections at once, each a request of its own, all answered by the frontend.
        with concurrent.futures.ThreadPoolExecutor(300) as pool:
            answers = list(pool.map(lambda _: _get(port, "/v1/models")[0], range(300)))
        assert answers == [200] * 300
        # No relay: the launcher counted none of them.
        assert json.loads(_get(admin, "/status")[1])["connections"]["open"] == 0
        # Drain: a stream in flight finishes while new connections are refused.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"model": "fake", "prompt": "hi", "max_tokens": 20, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _refused(port):
            assert time.monotonic() < deadline, "the public port still accepts connections while draining"
            time.sleep(0.05)
        rest = resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        assert proc.wait(60) == 0, proc.stderr()
        assert _refused(port)
    finally:
        proc.kill()
