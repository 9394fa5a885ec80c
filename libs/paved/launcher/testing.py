"""Real servers and artifacts for the launcher's tests and benchmarks (no mocks).

* `MotoServer`: moto's standalone S3-compatible server on a free loopback port, in its own
  process; its request log (werkzeug's access lines) tells how many GETs each object got.
* `FlakyProxy`: a TCP proxy in front of it that cuts the first N responses it forwards after
  a given number of bytes (a connection lost mid-download, for the retry path), and can slow
  responses down (so that two launchers surely overlap).
* `make_wheel`: a minimal pure-Python wheel with entry points, written with zipfile.
* `minimal_hf_dir`: the smallest folder the package builder accepts (config + tokenizer).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from typing import Any

from paved.launcher.gate import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ACCESS = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


class MotoServer:
    def __init__(self, log_path: str):
        self.log_path = log_path
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer within {timeout_s}s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def client(self) -> Any:
        from paved.launcher.storage import make_s3_client

        for k, v in CREDENTIALS.items():
            os.environ.setdefault(k, v)
        return make_s3_client(self.endpoint, addressing_style="path")

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple[str, str, int]]:
        """(method, path, status) of every request served so far, filtered."""
        with open(self.log_path, "rb") as f:
            text = _ANSI.sub("", f.read().decode(errors="replace"))
        out = []
        for m in _ACCESS.finditer(text):
            if (method is None or m.group(1) == method) and contains in m.group(2):
                out.append((m.group(1), m.group(2), int(m.group(3))))
        return out


class FlakyProxy:
    """Forwards loopback TCP to `upstream_port`; the first `failures` connections whose response
    stream passes `cut_after` bytes are closed right there; each forwarded response chunk (up
    to 64 KiB) is followed by a `delay_s` pause."""

    def __init__(self, upstream_port: int, cut_after: int = 0, failures: int = 0, delay_s: float = 0.0):
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.cut_after = cut_after
        self.failures_left = failures
        self.cuts = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closing = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closing:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if response and sent + len(data) > self.cut_after:
                    with self._lock:
                        cut = self.failures_left > 0
                        if cut:
                            self.failures_left -= 1
                            self.cuts += 1
                    if cut:
                        dst.sendall(data[: max(self.cut_after - sent, 0)])
                        break
                dst.sendall(data)
                sent += len(data)
                if response and self.delay_s:
                    time.sleep(self.delay_s)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._closing = True
        self._sock.close()


def minimal_hf_dir(path) -> str:
    """Create `path` with an empty config.json and tokenizer.json; returns it."""
    os.makedirs(path)
    for name in ("config.json", "tokenizer.json"):
        with open(os.path.join(path, name), "w") as f:
            f.write("{}")
    return str(path)


def make_wheel(
    out_dir: str,
    name: str,
    version: str,
    modules: dict[str, str],
    entry_points: dict[str, dict[str, str]],
) -> str:
    """Write `<name>-<version>-py3-none-any.whl` with `modules` ({"pkg/mod.py": source})."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = os.path.join(out_dir, f"{dist}-py3-none-any.whl")
    files: dict[str, bytes] = {k: v.encode() for k, v in modules.items()}
    files[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    )
    files[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: paved-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist}.dist-info/entry_points.txt"] = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in entry_points.items()
    ).encode()
    record = []
    for k, v in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b"=").decode()
        record.append(f"{k},sha256={digest},{len(v)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for k in sorted(files):
            info = zipfile.ZipInfo(k, date_time=(1980, 1, 1, 0, 0, 0))
            zf.writestr(info, files[k])
    return path


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that must import paved (and S3 test credentials)."""
    env = dict(os.environ)
    env.update(CREDENTIALS)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env


class LauncherProcess:
    """`python -m paved.launcher.main ARGS` in the background; stdout lines are collected."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None):
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in wait)
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paved.launcher.main", *args],
            env=env or subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match | None:
        """The first stdout line matching `pattern`; None if the process ended or time ran out."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for line in self.lines:
                    if m := rx.search(line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    return None
                self._cond.wait(min(left, 0.2))

    def stderr(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self, grace_s: float = 30.0) -> None:
        """Stop it however the test ended. SIGTERM first: the launcher's child runs in a process
        group of its own, which a SIGKILL of the launcher alone would leave running; on SIGTERM
        the launcher stops it (and kills that group after its drain and grace)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
