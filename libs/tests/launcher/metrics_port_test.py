"""The launcher's --metrics-port: a metrics proxy over the engine's multiprocess files and the
child's own /metrics, served for the launcher's whole run.

The launcher runs as its CLI on a local package; its child is the paved frontend over the
simulated engine (seconds, no model), or a child that never listens (a replica still starting).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from paved.launcher.build import build_package
from paved.launcher.gate import free_port
from paved.launcher.main import main
from paved.launcher.metrics_port import MetricsPort
from paved.launcher.testing import LauncherProcess, minimal_hf_dir

SIM_CHILD = (
    "{python} -m paved.frontend.server --engine sim://tiny?tokens_per_s=0 --model tiny --port {http_port}"
)
# Starts, never listens: the launcher stays in "starting" until SIGTERM.
SILENT_CHILD = "{python} -c 'import time; time.sleep(600)'"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkg")
    build_package(minimal_hf_dir(d / "hf"), str(d / "pkg"), "fake", "1")
    return d / "pkg"


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _up(samples: dict, source: str) -> float | None:
    return samples.get(("paved_metrics_proxy_up", (("source", source),)))


def _status(admin: int, deadline_s: float = 60) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return json.loads(_get(f"http://127.0.0.1:{admin}/status")[1])
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _stop(proc: LauncherProcess) -> None:
    try:
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr()[-3000:]
    finally:
        proc.kill()


def test_metrics_port_merges_engine_files_and_the_frontend_once_ready(tmp_path, package):
    admin = free_port()
    args = [
        str(package), "--cache-dir", str(tmp_path / "cache"), "--port", "0", "--admin-port", str(admin),
        "--metrics-dir", str(tmp_path / "prom"), "--metrics-port", "0", "--child-cmd", SIM_CHILD,
    ]  # fmt: skip
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
    try:
        m = proc.wait_line(
            r"paved launcher: ready: fake:1 on http 127\.0\.0\.1:(\d+), metrics 127\.0\.0\.1:(\d+)", 120
        )
        assert m, proc.stderr()[-3000:]
        http_port, metrics_port = int(m.group(1)), int(m.group(2))
        assert _status(admin)["ports"]["metrics"] == ["127.0.0.1", metrics_port]
        assert f"metrics proxy on http://127.0.0.1:{metrics_port}/metrics" in proc.stderr()
        # A request, so that the frontend's counters have a sample to show.
        assert _get(f"http://127.0.0.1:{http_port}/v1/models")[0] == 200

        # The frontend counts a request once its response is sent, so a scrape right after the
        # answer can precede the count (a fresh-clone CI run saw it): scrape until it is there.
        def counted(samples) -> bool:
            return any(
                n == "paved_http_requests_total" and dict(lb).get("route") == "/v1/models"
                for n, lb in samples
            )

        deadline = time.monotonic() + 30
        while True:
            status, body = _get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert status == 200, body
            samples = _samples(body)
            if counted(samples) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert _up(samples, "frontend") == 1.0 and _up(samples, "engine") == 1.0, body.decode()
        names = {name for name, _ in samples}
        # The frontend's families (its admission gauges, the sim engine's vLLM gauges) ...
        assert {"paved_ready", "paved_queued_sequences", "vllm:num_requests_waiting"} <= names, names
        # ... and the engine's multiprocess files: the frontend's prometheus_client counters are
        # written there under PROMETHEUS_MULTIPROC_DIR, so the first source (engine) has them.
        assert counted(samples), names
        assert list((tmp_path / "prom").glob("*.db")), "the child wrote no multiprocess files"
        # Still one family per name (the proxy dropped the frontend's copies).
        families = [f.name for f in text_string_to_metric_families(body.decode())]
        assert len(families) == len(set(families))
    finally:
        _stop(proc)


def test_metrics_port_serves_before_ready_with_the_frontend_down(tmp_path, package):
    admin = free_port()
    args = [
        str(package), "--cache-dir", str(tmp_path / "cache"), "--port", "0", "--admin-port", str(admin),
        "--metrics-port", "0", "--child-cmd", SILENT_CHILD,
    ]  # fmt: skip
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
    try:
        deadline = time.monotonic() + 60
        while (st := _status(admin))["phase"] != "starting" or not st["child_pid"]:
            assert time.monotonic() < deadline and st["phase"] != "failed", st
            time.sleep(0.05)
        host, port = st["ports"]["metrics"]
        assert host == "127.0.0.1"
        # The public port is held from the start but still gated: it refuses connections.
        public = st["ports"]["http"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(tuple(public), timeout=5).close()
        status, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200, body
        samples = _samples(body)
        assert _up(samples, "frontend") == 0.0, body.decode()
        assert (
            samples[
                ("paved_metrics_proxy_upstream_errors_total", (("reason", "connect"), ("source", "frontend")))
            ]
            >= 1
        )
    finally:
        _stop(proc)


def test_metrics_port_that_is_taken_fails_the_start(tmp_path, package):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [
            str(package), "--cache-dir", str(tmp_path / "cache"), "--port", "0",
            "--metrics-port", str(busy.getsockname()[1]), "--child-cmd", SILENT_CHILD,
        ]  # fmt: skip
        proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
        try:
            assert proc.wait(60) == 1
        finally:
            proc.kill()
    assert "launcher: start failed: cannot bind the metrics port" in proc.stderr()


@pytest.mark.parametrize("port", ["-1", "65536", "100000"])
def test_bad_metrics_port_exits_2(port, capsys):
    assert main(["x", "--metrics-port", port]) == 2
    assert f"--metrics-port must be 0..65535 (0: any free port), got {port}" in capsys.readouterr().err


def test_metrics_port_close_frees_the_port_and_its_threads(tmp_path):
    before = set(threading.enumerate())
    mp = MetricsPort(None, "127.0.0.1", 0)
    _, port = mp.address
    samples = _samples(_get(mp.url)[1])
    assert _up(samples, "frontend") is None  # no child yet: no frontend source at all
    mp.set_frontend(free_port())  # nothing listens there
    assert _up(_samples(_get(mp.url)[1]), "frontend") == 0.0
    mp.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # The proxy's fetch workers end once their (refused, immediate) fetch is done.
    deadline = time.monotonic() + 10
    while (
        left := [t for t in threading.enumerate() if t not in before and t.is_alive()]
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left
