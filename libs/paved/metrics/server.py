"""`tools/bazel run //services/metrics_proxy:serve -- [--upstream triton=http://h:8002/metrics]...`

Serves GET /metrics (the merged exposition, gzip when asked) and GET /health. The proxy never
answers 500 for a source's failure (see paved.metrics.proxy). Its own metrics are built per
scrape, never through prometheus_client's multiprocess values, so it writes nothing into
PROMETHEUS_MULTIPROC_DIR.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from paved.metrics.proxy import MetricsProxy, Upstream

log = logging.getLogger("paved.metrics")


# Seconds a connection may sit between reads before it is closed (scrapes take milliseconds).
CONNECTION_TIMEOUT_S = 10.0


def make_server(
    proxy: MetricsProxy, host: str, port: int, *, connection_timeout_s: float = CONNECTION_TIMEOUT_S
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "paved-metrics-proxy"
        # Headers and body leave in one write (flushed when the request is done), no Nagle delay.
        wbufsize = 1 << 20
        disable_nagle_algorithm = True
        # A client that stops mid-request (or idles on keep-alive) gives its thread back.
        timeout = connection_timeout_s

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            headers = {"Content-Type": content_type}
            if "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > 1024:
                body = gzip.compress(body, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, proxy.render_safely(), CONTENT_TYPE_PLAIN_0_0_4)
            elif path in ("/health", "/health/live", "/health/ready"):
                self._send(200, b"ok\n", "text/plain")
            else:
                self._send(404, b"not found: try /metrics\n", "text/plain")

        do_HEAD = do_GET

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="metrics_proxy", description="One /metrics for vLLM, upstreams and the proxy."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9400, help="0: any free port (printed)")
    p.add_argument(
        "--multiproc-dir",
        default=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
        help="the engine's PROMETHEUS_MULTIPROC_DIR (default: the environment's)",
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        type=Upstream.parse,
        help="[name=]http://host:port/metrics to merge (repeatable), e.g. triton=http://127.0.0.1:8002/metrics",
    )
    p.add_argument("--upstream-timeout", type=float, default=3.0, help="seconds per upstream per scrape")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s metrics_proxy %(levelname)s: %(message)s"
    )
    try:
        proxy = MetricsProxy(args.multiproc_dir, args.upstream, args.upstream_timeout)
    except ValueError as e:
        print(f"metrics_proxy: {e}", file=sys.stderr)
        return 2
    server = make_server(proxy, args.host, args.port)
    host, port = server.socket.getsockname()[:2]
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sources = ", ".join([f"engine={args.multiproc_dir}"] + [f"{u.name}={u.url}" for u in args.upstream])
    print(f"paved metrics proxy: serving http://{host}:{port}/metrics ({sources})", flush=True)
    server.serve_forever()
    server.server_close()
    proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
