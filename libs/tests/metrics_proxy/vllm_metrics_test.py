"""The metrics proxy over a real vLLM (CPU) engine writing multiprocess metrics.

The engine is vLLM's own OpenAI server on //models/tiny, started by the launcher in standalone
mode with a PROMETHEUS_MULTIPROC_DIR (so this also covers standalone mode and the metrics-dir
wipe). Requests sharing a long prefix produce prefix-cache hits. The proxy runs as its CLI
(`python -m paved.metrics.server`) next to a real upstream HTTP server in Triton's place.
One engine boot (~40-90 s on 2 busy cores).
"""

import http.server
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from paved.launcher.build import build_package
from paved.launcher.gate import free_port
from paved.launcher.testing import LauncherProcess, subprocess_env
from paved.testing.fixtures import tiny_model_dir
from paved.testing.http_stub import LoopbackHTTPServer, reply

TRITON = (
    "# HELP nv_inference_request_success Number of successful inference requests\n"
    "# TYPE nv_inference_request_success counter\n"
    'nv_inference_request_success{model="llm",version="1"} 12\n'
)
# ~40 words: a few hundred tokens of the tiny tokenizer, several 16-token KV blocks.
PREFIX = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def triton():
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            reply(self, 200, TRITON.encode(), content_type=None)

    with LoopbackHTTPServer(H) as stub:
        yield f"{stub.url}/metrics"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    args = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True}
    build_package(tiny_model_dir(), str(tmp / "pkg"), "tiny", "1", args, mode="standalone")
    prom = tmp / "prom"
    prom.mkdir()
    (prom / "histogram_77.db").write_bytes(b"from a previous run")
    port = free_port()
    launcher = LauncherProcess(
        [
            str(tmp / "pkg"),
            "--cache-dir",
            str(tmp / "cache"),
            "--port",
            str(port),
            "--metrics-dir",
            str(prom),
        ],
        str(tmp / "launcher.log"),
    )
    try:
        assert launcher.wait_line(r"paved launcher: ready", 600), launcher.stderr()[-5000:]
        for i in range(4):  # a shared prefix: blocks 2..n are prefix-cache hits
            body = json.dumps({"model": "tiny", "prompt": f"{PREFIX} q{i}", "max_tokens": 8}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        time.sleep(1.5)  # vLLM's stat loggers record on the engine's output loop
        yield prom
    finally:
        launcher.proc.send_signal(signal.SIGTERM)
        try:
            assert launcher.wait(120) == 0, launcher.stderr()[-3000:]
        finally:
            launcher.kill()


@pytest.fixture(scope="module")
def proxy(engine, triton, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("proxy") / "proxy.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "paved.metrics.server", "--port", str(port), "--multiproc-dir", str(engine),
         "--upstream", f"triton={triton}", "--upstream", f"down=http://127.0.0.1:{free_port()}/metrics"],
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url.replace("/metrics", "/health"), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "metrics proxy did not start"
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


def _scrape(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    for directive in ("# HELP ", "# TYPE "):
        names = [ln.split()[2] for ln in text.splitlines() if ln.startswith(directive)]
        assert len(names) == len(set(names)), f"duplicate {directive.strip()}"
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(fams, family, sample):
    return sum(s.value for s in fams[family].samples if s.name == sample)


def test_merged_metrics_from_a_real_engine(engine, proxy):
    assert not (engine / "histogram_77.db").exists(), "the launcher did not wipe the stale file"
    fams = _scrape(proxy)
    vllm = {n: f for n, f in fams.items() if n.startswith("vllm:")}
    series = sum(len(f.samples) for f in vllm.values())
    assert series >= 40, f"only {series} vllm: series: {sorted(vllm)}"
    assert _total(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") >= 4 * 40
    assert _total(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 4 * 8
    assert "vllm:kv_cache_usage_perc" in vllm
    assert _total(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
    assert _total(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") > 0
    assert _total(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 4
    # Upstream merged verbatim; the proxy's own per-source up gauge.
    assert (
        'nv_inference_request_success{model="llm",version="1"} 12'
        in urllib.request.urlopen(proxy).read().decode()
    )
    up = {s.labels["source"]: s.value for s in fams["paved_metrics_proxy_up"].samples}
    assert up == {"engine": 1.0, "triton": 1.0, "down": 0.0}
    print(f"{len(vllm)} vllm: families, {series} series")


def test_a_corrupt_file_next_to_the_engine_is_skipped(engine, proxy):
    bad = engine / "counter_31337.db"
    bad.write_bytes(os.urandom(4096))
    try:
        fams = _scrape(proxy)
        assert fams["paved_metrics_proxy_corrupt_files"].samples[0].value == 1
        assert _total(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 4 * 8
    finally:
        bad.unlink()
