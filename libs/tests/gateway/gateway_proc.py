"""Running the real gateway main (`python -m paved.gateway.server`) for tests, and small clients
of its admin API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx


class GatewayProcess:
    """`python -m paved.gateway.server --routes FILE ...` on an ephemeral port; stop() always."""

    URL = re.compile(rb"serving gateway on (http://\S+)")
    GRPC = re.compile(rb"gateway KServe v2 gRPC (\d+) on")

    def __init__(
        self,
        routes: Path | str,
        *args: str,
        admin_key: str,
        state_dir: Path,
        env: dict[str, str] | None = None,
    ):
        self.admin_key = admin_key
        self.log = tempfile.TemporaryFile(dir=os.environ.get("TEST_TMPDIR"))  # noqa: SIM115
        full_env = {**os.environ, "PAVED_ADMIN_KEY": admin_key, **(env or {})}
        state = (
            [] if any(a == "--state" for a in args) else ["--state", f"sqlite:///{state_dir / 'gw.sqlite'}"]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paved.gateway.server",
                "--routes",
                str(routes),
                "--port",
                "0",
                *state,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full_env,
        )
        self.grpc_port: int | None = None
        self.url = self._read_url()

    def _read_url(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = self.GRPC.search(line)
            if match:
                self.grpc_port = int(match.group(1))
            match = self.URL.search(line)
            if match:
                threading.Thread(target=self._drain, daemon=True).start()
                return match.group(1).decode()
        raise RuntimeError(f"gateway exited before printing its URL:\n{self.tail()}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)

    def tail(self, lines: int = 80) -> str:
        self.log.flush()
        self.log.seek(0)
        return b"\n".join(self.log.read().splitlines()[-lines:]).decode(errors="replace")

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.request(
            method,
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=10,
        )

    def tenant(self, name: str, **fields: Any) -> dict[str, Any]:
        r = self.admin("POST", "/admin/v1/tenants", {"name": name, **fields})
        assert r.status_code in (200, 201), r.text
        return r.json()

    def key(self, tenant: str, **fields: Any) -> str:
        r = self.admin("POST", "/admin/v1/keys", {"tenant": tenant, **fields})
        assert r.status_code in (200, 201), r.text
        return r.json()["key"]

    def stop(self, timeout_s: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def write_routes(path: Path, models: list[dict[str, Any]]) -> Path:
    """Write a routes file atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"models": models}))
    os.replace(tmp, path)
    return path
