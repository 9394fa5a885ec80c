"""Rollout analysis tells a backend pushing back from one failing (issue 22).

A backend that answers `503 {"error":{"code":"overloaded"}}` + Retry-After is saturated: the
gateway's flow control holds the request and tries again, so a busy new version must pass its
analysis. One that answers plain 503s (an engine down; the simulated engine's `fail_after`) or
other 5xx must fail it. The counters are those of the gateway's own registry
(`paved.gateway.metrics.GatewayMetrics`), counted as the proxy counts them, served as its
`/metrics` is, and read by both metrics sources (the scrape and a Prometheus answering the
PromQL query the Prometheus source sends), which must agree."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.metrics_source import (
    GatewayCounters,
    PrometheusSource,
    ScrapeSource,
    parse_gateway_metrics,
)
from paved.control_plane.rollout import Analysis, RolloutParams
from paved.gateway.metrics import GatewayMetrics
from paved.testing.http_stub import LoopbackHTTPServer, reply

NEW = "http://127.0.0.1:31002"  # the new version's replica (a backend id is its URL)
OLD = "http://127.0.0.1:31001"
MAX_ERROR_RATE = RolloutParams().max_error_rate


class Fleet:
    """One gateway's registry, counted as paved.gateway.forwarding.proxy counts."""

    def __init__(self) -> None:
        self.metrics = GatewayMetrics()

    def answered(self, backend: str, status: int, n: int = 1, *, pushback: bool = False) -> None:
        """Answers passed on to the client (a 503 `overloaded` is also a push-back)."""
        self.metrics.requests.labels("t", "tiny", backend, str(status)).inc(n)
        if pushback:
            self.metrics.pushback.labels(backend).inc(n)

    def retried(self, backend: str, n: int = 1, *, pushback: bool) -> None:
        """Tries moved elsewhere or queued again."""
        self.metrics.retries.labels(backend, "overloaded" if pushback else "error").inc(n)
        if pushback:
            self.metrics.pushback.labels(backend).inc(n)

    def refused_by_gateway(self, n: int = 1) -> None:
        """The gateway's own 503s (queue full, wait expired, every try failed): no backend."""
        self.metrics.requests.labels("t", "tiny", "", "503").inc(n)

    def text(self) -> str:
        return self.metrics.render().decode()


class _Served:
    """The gateway's /metrics and a Prometheus' /api/v1/query over the same registry."""

    def __init__(self, fleet: Fleet) -> None:
        owner = self
        self.fleet = fleet
        self.queries: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/metrics":
                    reply(self, 200, owner.fleet.text().encode(), "text/plain; version=0.0.4")
                elif url.path == "/api/v1/query":
                    query = urllib.parse.parse_qs(url.query)["query"][0]
                    owner.queries.append(query)
                    reply(self, 200, json.dumps(_prometheus_answer(owner.fleet.text(), query)).encode())
                else:
                    self.send_error(404)

        self.stub = LoopbackHTTPServer(Handler)
        self.url = self.stub.url

    def close(self) -> None:
        self.stub.close()


_NAME_MATCHER = re.compile(r'__name__=~"((?:[^"\\]|\\.)*)"')


def _prometheus_answer(text: str, query: str) -> dict:
    """What Prometheus answers the Prometheus source's raw-series selector with: the samples
    whose name the `__name__=~` regex matches (the other matchers pick the gateway: all here)."""
    m = _NAME_MATCHER.search(query)
    assert m is not None, query
    # The PromQL string escapes (\\ for \) come off before the regex is compiled.
    names = re.compile(m.group(1).replace("\\\\", "\\"))
    result = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if names.fullmatch(s.name):
                metric = {"__name__": s.name, **s.labels}
                result.append({"metric": metric, "value": [time.time(), repr(s.value)]})
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


@pytest.fixture
def served() -> Iterator[Callable[[Fleet], _Served]]:
    servers: list[_Served] = []

    def serve(fleet: Fleet) -> _Served:
        servers.append(_Served(fleet))
        return servers[-1]

    yield serve
    for s in servers:
        s.close()


def _windows(served_fleet: _Served, phase: Callable[[], None]) -> list[Analysis]:
    """The analysis of the new version over `phase`, by the scrape source and by the Prometheus
    source, each from a baseline taken before it (as a rollout persists at a phase's start)."""
    analyzers = [
        GatewayAnalyzer(source=ScrapeSource([served_fleet.url + "/metrics"], timeout_s=5.0)),
        GatewayAnalyzer(source=PrometheusSource(served_fleet.url)),
    ]

    async def run() -> list[Analysis]:
        baselines = []
        for a in analyzers:
            assert await a.scrape_once(), a.last_error
            baselines.append(a.counters({NEW}))
        phase()
        out = []
        for a, baseline in zip(analyzers, baselines, strict=True):
            assert await a.scrape_once(), a.last_error
            out.append(a.analyze({NEW}, since=0.0, baseline=baseline))
        return out

    return asyncio.run(run())


def _fails(a: Analysis) -> bool:
    return a.requests > 0 and a.errors / a.requests > MAX_ERROR_RATE


def test_a_saturated_version_that_only_pushes_back_passes(served) -> None:
    fleet = Fleet()
    fleet.answered(OLD, 200, 50)
    s = served(fleet)

    def saturated() -> None:
        fleet.answered(NEW, 200, 60)
        # Its engine queue full: the gateway held these and retried them (elsewhere or later) ...
        fleet.retried(NEW, 30, pushback=True)
        # ... passed a few on where it had no queue slot for them ...
        fleet.answered(NEW, 503, 10, pushback=True)
        # ... and refused some itself when its own queue was full: no backend's error.
        fleet.refused_by_gateway(25)

    by_scrape, by_prometheus = _windows(s, saturated)
    assert by_scrape == by_prometheus
    # Push-back is neither an error nor a request: the tries that were not served do not
    # dilute the error rate either.
    assert by_scrape.requests == 60 and by_scrape.errors == 0, by_scrape
    assert not _fails(by_scrape)
    # The Prometheus source asked for the push-back series too.
    assert any("paved_gateway_pushback_total" in q for q in s.queries), s.queries


@pytest.mark.parametrize("passed_on", [0, 10, 40])
def test_a_version_refusing_with_plain_503s_fails(served, passed_on: int) -> None:
    """The simulated engine's fail_after answers 503 `unavailable` (+ Retry-After): a failure."""
    fleet = Fleet()
    s = served(fleet)

    def failing() -> None:
        fleet.answered(NEW, 200, 2)
        fleet.retried(NEW, 40 - passed_on, pushback=False)
        fleet.answered(NEW, 503, passed_on)

    by_scrape, by_prometheus = _windows(s, failing)
    assert by_scrape == by_prometheus
    assert by_scrape.requests == 42 and by_scrape.errors == 40, by_scrape
    assert _fails(by_scrape)


def test_errors_among_push_back_still_count(served) -> None:
    fleet = Fleet()
    s = served(fleet)

    def mixed() -> None:
        fleet.answered(NEW, 200, 80)
        fleet.retried(NEW, 50, pushback=True)
        fleet.answered(NEW, 503, 20, pushback=True)
        fleet.answered(NEW, 500, 6)
        fleet.retried(NEW, 4, pushback=False)  # a reset, a connect refused, a 502 ...

    by_scrape, by_prometheus = _windows(s, mixed)
    assert by_scrape == by_prometheus
    assert by_scrape.requests == 90 and by_scrape.errors == 10, by_scrape
    # 10 failures in 90 answers: over the 5 % default, however much it pushed back besides.
    assert _fails(by_scrape)


def test_a_version_that_only_pushes_back_is_inconclusive_not_failing(served) -> None:
    fleet = Fleet()
    s = served(fleet)

    def full() -> None:
        fleet.retried(NEW, 30, pushback=True)
        fleet.answered(NEW, 503, 5, pushback=True)

    by_scrape, by_prometheus = _windows(s, full)
    assert by_scrape == by_prometheus == Analysis(0, 0, None)


def test_a_gateway_without_the_push_back_series_counts_every_retry_as_before() -> None:
    """An older gateway (retries by exception name or status, no push-back series)."""
    text = (
        "# TYPE paved_gateway_retries_total counter\n"
        f'paved_gateway_retries_total{{backend="{NEW}",reason="503"}} 3\n'
        "# TYPE paved_gateway_requests_total counter\n"
        f'paved_gateway_requests_total{{tenant="t",model="tiny",backend="{NEW}",status="503"}} 2\n'
        f'paved_gateway_requests_total{{tenant="t",model="tiny",backend="{NEW}",status="200"}} 5\n'
    )
    counters = parse_gateway_metrics(text, 1.0)
    assert counters.requests[NEW] == 10 and counters.errors[NEW] == 5


@settings(max_examples=60, deadline=None)
@given(
    ok=st.integers(0, 50),
    pushed_back_retried=st.integers(0, 50),
    pushed_back_passed_on=st.integers(0, 50),
    failed_retried=st.integers(0, 50),
    failed_answered=st.integers(0, 50),
    gateway_refusals=st.integers(0, 50),
)
def test_errors_are_exactly_the_failures_whatever_the_mix(
    ok: int,
    pushed_back_retried: int,
    pushed_back_passed_on: int,
    failed_retried: int,
    failed_answered: int,
    gateway_refusals: int,
) -> None:
    fleet = Fleet()
    fleet.answered(NEW, 200, ok)
    fleet.retried(NEW, pushed_back_retried, pushback=True)
    fleet.answered(NEW, 503, pushed_back_passed_on, pushback=True)
    fleet.retried(NEW, failed_retried, pushback=False)
    fleet.answered(NEW, 502, failed_answered)
    fleet.refused_by_gateway(gateway_refusals)
    counters = parse_gateway_metrics(fleet.text(), 1.0)
    tries = ok + failed_retried + failed_answered
    assert counters.requests.get(NEW, 0.0) == tries
    assert counters.errors.get(NEW, 0.0) == failed_retried + failed_answered
    # The baseline a rollout persists round-trips with the push-back already netted out.
    again = GatewayCounters.parse(json.loads(json.dumps(counters.only({NEW}))))
    assert again is not None and again.errors.get(NEW, 0.0) == failed_retried + failed_answered
