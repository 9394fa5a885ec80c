"""The metrics proxy over real multiprocess files (written by real prometheus_client processes)
and real upstream HTTP servers: healthy, down, slow, garbage, HTTP 500, clashing names."""

import gzip
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from paved.launcher.gate import free_port
from paved.metrics.proxy import MetricsProxy, Upstream, split_families
from paved.metrics.server import make_server
from paved.testing.http_stub import LoopbackHTTPServer, TricklingServer, reply

WRITER = """
import os, sys
from prometheus_client import Counter, Gauge, Histogram
n = int(sys.argv[1])
c = Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"])
c.labels("tiny").inc(10 * n)
g = Gauge("vllm:num_requests_running", "Running.", ["model_name"], multiprocess_mode="livesum")
g.labels("tiny").set(n)
k = Gauge("vllm:kv_cache_usage_perc", "KV usage.", ["model_name"], multiprocess_mode="mostrecent")
k.labels("tiny").set(0.25 * n)
h = Histogram("vllm:e2e_request_latency_seconds", "Latency.", ["model_name"], buckets=[0.1, 1.0])
h.labels("tiny").observe(0.5)
"""

TRITON = """# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 7
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5
# HELP vllm:prompt_tokens a clash with the engine's family
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="x"} 99
plain_untyped 3
"""

# Valid expositions whose HELP text / label value holds a character str.splitlines() breaks at
# (and Prometheus does not): re-emitted split there, they would carry a sample of the upstream's
# choosing, or not parse at all.
SMUGGLE_HELP = (
    '# HELP triton_up Server up.\x0binjected_metric{tenant="victim"} 42\n'
    "# TYPE triton_up gauge\ntriton_up 1\n"
)
SMUGGLE_LABEL = '# TYPE triton_up gauge\ntriton_up{model="a\u2028injected_metric{tenant=\\"victim\\"} 1"} 1\n'


class _Upstreams:
    """Real HTTP servers on loopback, one behaviour per path."""

    def __init__(self):
        bodies = {
            "/triton": TRITON,
            "/garbage": "this is {not prometheus\n\x00\x01",
            "/smuggle-help": SMUGGLE_HELP,
            "/smuggle-label": SMUGGLE_LABEL,
        }

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/slow":
                    time.sleep(3)
                if self.path == "/error":
                    reply(self, 500, content_type=None)
                    return
                reply(self, 200, bodies.get(self.path, "ok 1\n").encode(), content_type=None)

        self.stub = LoopbackHTTPServer(H)
        self.port = self.stub.port

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture(scope="module")
def upstreams():
    u = _Upstreams()
    yield u
    u.stub.close()


@pytest.fixture()
def prom_dir(tmp_path):
    d = tmp_path / "prom"
    d.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d), "PYTHONPATH": os.pathsep.join(sys.path)}
    for n in (1, 2):
        subprocess.run([sys.executable, "-c", WRITER, str(n)], env=env, check=True)
    return d


def _parse(body: bytes) -> dict:
    text = body.decode()
    for directive in ("# HELP ", "# TYPE "):
        names = [ln.split()[2] for ln in text.splitlines() if ln.startswith(directive)]
        assert len(names) == len(set(names)), f"duplicate {directive.strip()}: {names}"
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name, sample=None, **labels):
    for s in families[name].samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


def test_engine_and_upstream_merged_with_first_source_winning(prom_dir, upstreams):
    proxy = MetricsProxy(str(prom_dir), [Upstream("triton", upstreams.url("/triton"))])
    fams = _parse(proxy.render())
    # Engine: two processes merged the way MultiProcessCollector does.
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny") == 30
    assert _value(fams, "vllm:num_requests_running", model_name="tiny") == 3  # livesum
    assert _value(fams, "vllm:kv_cache_usage_perc", model_name="tiny") in (0.25, 0.5)  # most recent
    assert _value(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    # Upstream: passed through unchanged (Triton's counter keeps its name, no _total added).
    text = proxy.render().decode()
    assert 'nv_inference_count{model="llm",version="1"} 7' in text
    assert 'nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5' in text and "plain_untyped 3" in text
    # Clash: the engine had vllm:prompt_tokens first; the upstream's family is dropped, counted.
    assert 'model_name="x"' not in text
    assert _value(fams, "paved_metrics_proxy_dropped_families", source="triton") >= 1
    assert _value(fams, "paved_metrics_proxy_up", source="engine") == 1
    assert _value(fams, "paved_metrics_proxy_up", source="triton") == 1
    assert _value(fams, "paved_metrics_proxy_scrape_duration_seconds", source="triton") > 0


def test_a_mirroring_upstreams_copies_of_engine_families_drop_quietly(prom_dir, upstreams, caplog):
    """The launcher's frontend repeats the engine files' vLLM families by design: its copies are
    dropped without a warning or a count; its own families still pass, and the same clash from
    an ordinary upstream still warns and counts."""
    frontend = Upstream("frontend", upstreams.url("/triton"), mirrors_engine=True)
    mirror = MetricsProxy(str(prom_dir), [frontend])
    plain = MetricsProxy(str(prom_dir), [Upstream("triton", upstreams.url("/triton"))])
    with caplog.at_level("WARNING", logger="paved.metrics"):
        mirrored = mirror.render()
    assert not [r for r in caplog.records if "dropping family" in r.getMessage()]
    fams = _parse(mirrored)
    text = mirrored.decode()
    assert 'model_name="x"' not in text and 'nv_inference_count{model="llm",version="1"} 7' in text
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny") == 30
    assert (
        "paved_metrics_proxy_dropped_families" not in fams
        or not fams["paved_metrics_proxy_dropped_families"].samples
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="paved.metrics"):
        counted = _parse(plain.render())
    assert [r for r in caplog.records if "dropping family 'vllm:prompt_tokens'" in r.getMessage()]
    assert _value(counted, "paved_metrics_proxy_dropped_families", source="triton") == 1
    mirror.close()
    plain.close()


def test_failing_upstreams_are_up_0_and_everything_else_still_served(prom_dir, upstreams):
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    proxy = MetricsProxy(
        str(prom_dir),
        [
            Upstream("down", dead),
            Upstream("slow", upstreams.url("/slow")),
            Upstream("garbage", upstreams.url("/garbage")),
            Upstream("error", upstreams.url("/error")),
            Upstream("triton", upstreams.url("/triton")),
        ],
        timeout_s=1.0,
    )
    t0 = time.monotonic()
    fams = _parse(proxy.render())
    assert time.monotonic() - t0 < 2.5, "a slow upstream held the scrape past its timeout"
    for name in ("down", "slow", "garbage", "error"):
        assert _value(fams, "paved_metrics_proxy_up", source=name) == 0, name
    assert _value(fams, "paved_metrics_proxy_up", source="triton") == 1
    reasons = {
        s.labels["source"]: s.labels["reason"] for s in fams["paved_metrics_proxy_upstream_errors"].samples
    }
    assert reasons == {"down": "connect", "slow": "timeout", "garbage": "parse", "error": "http_status"}
    assert "vllm:prompt_tokens" in fams and "nv_inference_count" in fams


@pytest.mark.parametrize("path", ["/smuggle-help", "/smuggle-label"])
def test_upstream_lines_split_at_newline_only(path, upstreams):
    """An upstream's validated text is re-emitted as the same lines: no other line breaks."""
    proxy = MetricsProxy(None, [Upstream("triton", upstreams.url(path))])
    try:
        fams = _parse(proxy.render())
    finally:
        proxy.close()
    assert _value(fams, "paved_metrics_proxy_up", source="triton") == 1
    assert "injected_metric" not in fams
    expected = {
        f.name: f for f in text_string_to_metric_families(SMUGGLE_HELP if "help" in path else SMUGGLE_LABEL)
    }
    assert fams["triton_up"] == expected["triton_up"]


def test_a_trickling_upstream_times_out_and_never_starves_the_others(upstreams):
    """The deadline covers the whole exchange, headers included: each scrape gives up on the
    trickler, and its pool threads come back. They stayed blocked before, and after a few
    scrapes the pool had no thread left for the healthy upstream."""
    # Its status line, then one header byte every 0.2 s.
    trickler = TricklingServer(b"HTTP/1.1 200 OK\r\nX-Slow: ", b"a", interval_s=0.2)
    proxy = MetricsProxy(
        None,
        [
            Upstream("slow", f"http://127.0.0.1:{trickler.port}/metrics"),
            Upstream("triton", upstreams.url("/triton")),
        ],
        timeout_s=0.5,
    )
    try:
        for _ in range(6):  # the pool has 4 threads
            fams = _parse(proxy.render())
            assert _value(fams, "paved_metrics_proxy_up", source="slow") == 0
            assert _value(fams, "paved_metrics_proxy_up", source="triton") == 1
            assert "nv_inference_count" in fams
        errors = fams["paved_metrics_proxy_upstream_errors"].samples
        assert {s.labels["reason"] for s in errors if s.labels["source"] == "slow"} == {"timeout"}
    finally:
        proxy.close()
        trickler.close()


def test_corrupt_db_file_is_skipped_and_counted(prom_dir):
    (prom_dir / "counter_999.db").write_bytes(b"\xff" * 64)
    (prom_dir / "gauge_all_998.db").write_bytes(b"")
    proxy = MetricsProxy(str(prom_dir))
    fams = _parse(proxy.render())
    assert _value(fams, "paved_metrics_proxy_corrupt_files") == 2
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny") == 30
    fams = _parse(proxy.render())
    assert (
        _value(fams, "paved_metrics_proxy_corrupt_file_skips", "paved_metrics_proxy_corrupt_file_skips_total")
        == 4
    )


def test_foreign_entries_named_db_are_skipped_and_counted(prom_dir):
    """A directory or a FIFO named like a metrics file is counted as corrupt and skipped: the
    directory failed every merge (no engine metric at all), the FIFO blocked the scrape."""
    (prom_dir / "backup.db").mkdir()
    fifo = prom_dir / "gauge_all_99.db"
    os.mkfifo(fifo)
    proxy = MetricsProxy(str(prom_dir))
    result = {}
    scrape = threading.Thread(target=lambda: result.update(body=proxy.render_safely()), daemon=True)
    scrape.start()
    scrape.join(60)
    if scrape.is_alive():  # blocked opening the FIFO: a writer lets it go, so the test ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        scrape.join()
        pytest.fail("the scrape blocked on a FIFO named like a metrics file")
    fams = _parse(result["body"])
    assert _value(fams, "paved_metrics_proxy_corrupt_files") == 2
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny") == 30
    proxy.close()


def test_missing_multiproc_dir_is_up_0_not_an_error(tmp_path):
    fams = _parse(MetricsProxy(str(tmp_path / "nope")).render())
    assert _value(fams, "paved_metrics_proxy_up", source="engine") == 0


def test_split_families_keeps_blocks_verbatim():
    blocks = split_families(TRITON + "# TYPE nv_gpu_utilization gauge\nnv_gpu_utilization 1\n")
    names = [b.name for b in blocks]
    assert names == [
        "nv_inference_count",
        "nv_gpu_utilization",
        "vllm:prompt_tokens",
        "plain_untyped",
        "nv_gpu_utilization",
    ]
    assert blocks[0].lines[-1] == 'nv_inference_count{model="llm",version="1"} 7'


def test_http_server_serves_gzip_and_200_always(prom_dir, upstreams):
    proxy = MetricsProxy(str(prom_dir), [Upstream("garbage", upstreams.url("/garbage"))])
    server = make_server(proxy, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Encoding"] == "gzip"
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fams = _parse(gzip.decompress(r.read()))
        assert _value(fams, "paved_metrics_proxy_up", source="garbage") == 0
        with urllib.request.urlopen(url, timeout=10) as r:
            assert "vllm:prompt_tokens" in _parse(r.read())
    finally:
        server.shutdown()
        proxy.close()


def test_lines_are_split_as_the_validating_parser_reads_them():
    """An indented TYPE, an indented sample and CRLF endings: the validating parser strips each
    line, so the splitter must too, or the family passes the clash check under no name."""
    blocks = split_families("  # TYPE foo counter\r\n  foo_total 2\r\n# TYPE bar gauge\nbar 1\n")
    assert [(b.name, b.lines) for b in blocks] == [
        ("foo", ["# TYPE foo counter", "foo_total 2"]),
        ("bar", ["# TYPE bar gauge", "bar 1"]),
    ]


def test_a_connection_that_stops_mid_request_is_closed(prom_dir):
    """Each connection has a thread: one that sends half a request line (or idles) gives it back
    after the connection timeout instead of holding it for good."""
    proxy = MetricsProxy(str(prom_dir), [])
    server = make_server(proxy, "127.0.0.1", 0, connection_timeout_s=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=30) as stalled:
            stalled.sendall(b"GET /metr")
            assert stalled.recv(1024) == b""  # closed by the server, well before our 30 s
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        server.shutdown()
        proxy.close()


def test_upstream_spec_parsing():
    assert Upstream.parse("triton=http://h:8002/metrics") == Upstream("triton", "http://h:8002/metrics")
    assert Upstream.parse("http://h:8002/metrics").name == "h:8002"
    with pytest.raises(ValueError):
        Upstream.parse("triton=ftp://h/metrics")
    with pytest.raises(ValueError):
        MetricsProxy(None, [Upstream("engine", "http://h/m")])
