"""A backend pushing back is not a backend failing, in the gateway's metrics (issue 22).

The gateway main in front of (a) loopback backends that answer every request as paved's
frontend answers a full engine queue, `503 {"error":{"code":"overloaded"}}` + Retry-After, and
(b) a real paved frontend on the simulated engine with its fault injection (`fail_after=0`:
every request a 503 `unavailable`). Push-back lands in `paved_gateway_pushback_total` and
`paved_gateway_retries_total{reason="overloaded"}`, never in `reason="error"`; the injected
faults the other way round. The 503 the gateway then sends itself (every try refused, or its
queue's wait expired) names no backend. Read as rollout analysis reads it, the pushing-back
backends have neither errors nor requests and the faulty one fails every request."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from gateway_proc import GatewayProcess, write_routes
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerProcess

from paved.control_plane.metrics_source import parse_gateway_metrics
from paved.http.errors import error_body
from paved.testing.http_stub import LoopbackHTTPServer, reply

N = 4  # requests per model


class PushesBack:
    """A loopback backend whose engine queue is always full: every completion is refused with
    the body and headers paved's frontend sends then (paved.frontend.errors: overloaded)."""

    def __init__(self) -> None:
        owner = self
        self.tries = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                reply(self, 200 if self.path == "/health/ready" else 404, b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                with owner.lock:
                    owner.tries += 1
                body = error_body(503, "the engine's queue is full (2 waiting); retry", code="overloaded")
                reply(self, 503, json.dumps(body).encode(), headers={"Retry-After": "1"})

        self.stub = LoopbackHTTPServer(Handler)
        self.url = self.stub.url

    def close(self) -> None:
        self.stub.close()


@pytest.fixture(scope="module")
def busy() -> Iterator[list[PushesBack]]:
    backends = [PushesBack(), PushesBack()]
    yield backends
    for b in backends:
        b.close()


@pytest.fixture(scope="module")
def faulty() -> Iterator[ServerProcess]:
    server = ServerProcess("--engine", "sim://tiny?fail_after=0", ready_timeout_s=120)
    yield server
    server.terminate()


def _gateway(tmp: Path, busy: list[PushesBack], faulty: ServerProcess, *args: str) -> GatewayProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    routes = write_routes(
        tmp / "routes.json",
        [
            {"alias": "busy", "backends": [{"url": b.url, "version": "v1"} for b in busy]},
            # The one faulty frontend twice (two ids), so that one try is retried and one passed on.
            {
                "alias": "broken",
                "backends": [
                    {"url": faulty.url, "version": "v1", "id": f"broken-{i}", "upstream_model": "tiny"}
                    for i in range(len(busy))
                ],
            },
        ],
    )
    gw = GatewayProcess(
        routes,
        "--health-interval",
        "60",
        "--no-backend-metrics",
        *args,
        admin_key="adm-" + secrets.token_hex(16),
        state_dir=tmp,
    )
    gw.tenant("t")
    gw.key_t = gw.key("t")  # type: ignore[attr-defined]
    return gw


def _post(gw: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/completions",
        headers={"Authorization": f"Bearer {gw.key_t}"},  # type: ignore[attr-defined]
        json={"model": model, "prompt": "x", "max_tokens": 1},
        timeout=60,
    )


def _samples(gw: GatewayProcess) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _sum(samples, name: str, backends: set[str] | None = None, **labels: str) -> float:
    return sum(
        v
        for n, ls, v in samples
        if n == name
        and (backends is None or ls.get("backend") in backends)
        and all(ls.get(k) == want for k, want in labels.items())
    )


def test_push_back_and_injected_faults_land_in_their_own_series(tmp_path, busy, faulty) -> None:
    # No queue, two tries: the first backend's answer is retried on the other, whose answer is
    # passed on to the client.
    gw = _gateway(tmp_path, busy, faulty, "--queue-size", "0", "--max-attempts", "2")
    try:
        for model in ("busy", "broken"):
            for _ in range(N):
                r = _post(gw, model)
                assert r.status_code == 503, r.text
        samples = _samples(gw)
        metrics_text = httpx.get(gw.url + "/metrics", timeout=10).text
    finally:
        gw.stop()
    busy_ids = {b.url for b in busy}
    broken_ids = {"broken-0", "broken-1"}
    # Every try at the busy backends is push-back: half retried, half passed on.
    assert sum(b.tries for b in busy) == 2 * N
    assert _sum(samples, "paved_gateway_pushback_total", busy_ids) == 2 * N
    assert _sum(samples, "paved_gateway_retries_total", busy_ids, reason="overloaded") == N
    assert _sum(samples, "paved_gateway_retries_total", busy_ids, reason="error") == 0
    assert _sum(samples, "paved_gateway_requests_total", busy_ids, status="503") == N
    # The injected faults are errors, and no push-back.
    assert _sum(samples, "paved_gateway_pushback_total", broken_ids) == 0
    assert _sum(samples, "paved_gateway_retries_total", broken_ids, reason="error") == N
    assert _sum(samples, "paved_gateway_retries_total", broken_ids, reason="overloaded") == 0
    assert _sum(samples, "paved_gateway_requests_total", broken_ids, status="503") == N
    # As rollout analysis reads them: a busy version has no errors, a broken one nothing else.
    counters = parse_gateway_metrics(metrics_text, 0.0)
    assert sum(counters.requests.get(b, 0.0) for b in busy_ids) == 0  # nothing served, nothing failed
    assert sum(counters.errors.get(b, 0.0) for b in busy_ids) == 0
    assert sum(counters.requests.get(b, 0.0) for b in broken_ids) == 2 * N
    assert sum(counters.errors.get(b, 0.0) for b in broken_ids) == 2 * N


def test_the_gateways_own_refusal_names_no_backend(tmp_path, busy, faulty) -> None:
    # A queue whose wait expires: each refused try goes back to the queue until the 503
    # queue_timeout, which is the gateway's answer, not a backend's.
    gw = _gateway(
        tmp_path, busy[:1], faulty, "--queue-size", "8", "--queue-max-wait", "0.5", "--max-attempts", "1"
    )
    before = busy[0].tries
    try:
        for model in ("busy", "broken"):
            r = _post(gw, model)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout", r.text
        samples = _samples(gw)
    finally:
        gw.stop()
    tries = busy[0].tries - before
    assert tries >= 1
    assert _sum(samples, "paved_gateway_pushback_total", {busy[0].url}) == tries
    assert _sum(samples, "paved_gateway_retries_total", {busy[0].url}, reason="overloaded") == tries
    assert _sum(samples, "paved_gateway_retries_total", {busy[0].url}, reason="error") == 0
    assert _sum(samples, "paved_gateway_retries_total", {"broken-0"}, reason="error") >= 1
    assert _sum(samples, "paved_gateway_pushback_total", {"broken-0"}) == 0
    # Both answers were the gateway's own: counted without a backend.
    assert _sum(samples, "paved_gateway_requests_total", {busy[0].url, "broken-0"}) == 0
    assert _sum(samples, "paved_gateway_requests_total", {""}, status="503") == 2
