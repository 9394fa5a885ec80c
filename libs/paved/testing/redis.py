"""A throwaway redis-server on loopback for tests: no persistence, its own temp dir, always
stopped and removed on exit (also when the test fails)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from paved.net import free_port

__all__ = ["REDIS_SERVER", "redis_server"]

REDIS_SERVER = "/usr/bin/redis-server"


def _command(port: int, line: bytes, timeout_s: float) -> bytes:
    """Sends one inline command and returns the first reply chunk (b"" if none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(line + b"\r\n")
        try:
            return conn.recv(64)
        except (TimeoutError, ConnectionError):
            return b""


def _wait_ready(proc: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
    """True once PING answers; False if the server exited (e.g. the port was taken)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            if _command(port, b"PING", 1.0).startswith(b"+PONG"):
                return True
        time.sleep(0.02)
    raise TimeoutError("redis-server did not answer PING in time")


def _stop(proc: subprocess.Popen[bytes], port: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            _command(port, b"SHUTDOWN NOSAVE", 2.0)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-2000:]
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def redis_server(
    binary: str = REDIS_SERVER, *, start_timeout_s: float = 20.0, port: int | None = None
) -> Iterator[str]:
    """Starts `binary` on 127.0.0.1 at a free port (or `port`: a restart on the same address)
    and yields `redis://127.0.0.1:PORT/0`.

    Invariant: when the block exits, the server has exited and its directory is gone."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise RuntimeError(f"{binary} not found: install redis-server (tools/bazel does, from its apt list)")
    workdir = tempfile.mkdtemp(prefix="paved-redis-")
    logfile = os.path.join(workdir, "log")
    proc: subprocess.Popen[bytes] | None = None
    fixed, port = port, 0
    try:
        deadline = time.monotonic() + start_timeout_s
        # The free port can be taken between probing and binding: then the server exits and
        # another port is tried (a fixed port is tried once).
        for _ in range(1 if fixed else 5):
            port = fixed or free_port()
            proc = subprocess.Popen(  # noqa: S603 (the caller's own binary, fixed arguments)
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--dir",
                    workdir,
                    "--logfile",
                    logfile,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if _wait_ready(proc, port, deadline):
                break
            proc.wait(timeout=5)
            proc = None
        if proc is None:
            raise RuntimeError(f"redis-server did not start:\n{_log_tail(logfile)}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None:
            _stop(proc, port)
        shutil.rmtree(workdir, ignore_errors=True)
