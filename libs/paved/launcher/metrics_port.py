"""The launcher's metrics port (`--metrics-port`): one /metrics per replica for its whole run.

A paved.metrics proxy merges, in this order (the first source of a name wins):
  1. `engine`: the *.db files of the engine's PROMETHEUS_MULTIPROC_DIR (`--metrics-dir`);
  2. `frontend`: the child's own /metrics on its private loopback port.

It serves from right after the metrics dir is cleaned (so never a previous run's files) until
the launcher exits. The child's private port is only picked when the child starts, so until
then there is no `frontend` source; from then on, until the child answers,
`paved_metrics_proxy_up{source="frontend"}` is 0. Unlike the public ports it is not gated: a
scraper sees a starting or draining replica as it is instead of a refused connection.

The server runs on threads of its own (a ThreadingHTTPServer), so a scrape never waits on the
launcher's event loop, and a slow scrape never delays it.
"""

from __future__ import annotations

import threading

from paved.metrics.proxy import MetricsProxy, Upstream
from paved.metrics.server import make_server

FRONTEND = "frontend"


class MetricsPort:
    def __init__(self, multiproc_dir: str | None, host: str, port: int):
        """Binds and starts serving; raises OSError when the port cannot be bound."""
        self.proxy = MetricsProxy(multiproc_dir)
        try:
            self.server = make_server(self.proxy, host, port)
        except BaseException:
            self.proxy.close()
            raise
        bound = self.server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="paved-launcher-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}/metrics"

    def set_frontend(self, port: int) -> None:
        """Merge the child's /metrics on 127.0.0.1:`port` from the next scrape on."""
        # render() reads `upstreams` once per scrape and rebinding an attribute is atomic, so a
        # concurrent scrape sees either the old list or the new one, never a torn one.
        self.proxy.upstreams = [Upstream(FRONTEND, f"http://127.0.0.1:{port}/metrics", mirrors_engine=True)]

    def close(self) -> None:
        """Stop serving, free the port and the proxy's fetch threads (blocks up to serve_forever's
        0.5 s poll)."""
        self.server.shutdown()  # returns once serve_forever has returned
        self.server.server_close()
        self.proxy.close()
        self._thread.join()
