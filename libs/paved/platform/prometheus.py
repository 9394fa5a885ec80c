"""Running Debian's `prometheus` (2.42, /usr/bin/prometheus) on loopback: for `up`, and for the
tests and benchmarks that need a real one.

Invariants:
  * It listens on 127.0.0.1 only (`--web.listen-address`), keeps its TSDB in the directory it
    is given, and reads one config file; nothing here touches a system Prometheus.
  * `wait_ready` is bounded and fails (PrometheusError) as soon as the process exits.
  * `LocalPrometheus` stops what it started (SIGTERM, then SIGKILL after a bound).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx

from paved.net import free_port

PROMETHEUS = "/usr/bin/prometheus"
HOST = "127.0.0.1"
INSTALL_HINT = "apt-get install prometheus (Debian's package; tools/bazel installs it)"


class PrometheusError(Exception):
    """Prometheus is missing, did not start, or exited."""


def binary() -> str:
    """The prometheus binary (PrometheusError naming the package when it is missing)."""
    path = PROMETHEUS if os.access(PROMETHEUS, os.X_OK) else shutil.which("prometheus")
    if not path:
        raise PrometheusError(f"no {PROMETHEUS}: {INSTALL_HINT}")
    return path


def argv(config: Path, data_dir: Path, port: int, *, retention: str = "2d") -> list[str]:
    return [
        binary(),
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--storage.tsdb.retention.time={retention}",
        f"--web.listen-address={HOST}:{port}",
        "--log.level=warn",
    ]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path | None = None) -> None:
    """Until `url`/-/ready answers 200 (PrometheusError if `proc` exits or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    where = f"; see {log}" if log else ""
    while True:
        if proc.poll() is not None:
            raise PrometheusError(f"prometheus exited with {proc.returncode}{where}")
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise PrometheusError(f"prometheus not ready within {timeout_s:.0f} s{where}")
        time.sleep(0.2)


class LocalPrometheus:
    """`with LocalPrometheus(config_text, work_dir) as prom:` a Prometheus at `prom.url`, its
    config at work_dir/prometheus.yml and its data in work_dir/data; stopped on exit."""

    def __init__(self, config_text: str, work_dir: Path, *, port: int = 0, timeout_s: float = 60.0):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config = self.work_dir / "prometheus.yml"
        self.config.write_text(config_text)
        self.port = port or free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.log = self.work_dir / "prometheus.log"
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalPrometheus:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                argv(self.config, self.work_dir / "data", self.port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        try:
            wait_ready(self.url, self.proc, self.timeout_s, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def query(self, promql: str) -> list[dict]:
        """An instant query's result (AssertionError-free: PrometheusError on a failed answer)."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise PrometheusError(f"query {promql!r}: {body.get('error')}")
        return list(body["data"]["result"])
