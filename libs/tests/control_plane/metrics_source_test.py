"""The two MetricsSources side by side on the same recorded data: a fake exporter serves two
gateways' and two replicas' metrics, step by step; a real Prometheus (Debian's 2.42) scrapes it
every second with the labels paved's discovery gives. After each step (once Prometheus has
scraped it: a generation gauge says so) the scrape source and the Prometheus source must hand
over the same counters and gauges, so the rollout analysis (GatewayAnalyzer) and the autoscaler
reach the same decisions. Plus the Prometheus source's refusals and failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.autoscaler import Autoscaler
from paved.control_plane.metrics_source import (
    MetricsSourceError,
    PrometheusSource,
    ScrapeSource,
    parse_metrics_source,
)
from paved.control_plane.types import AutoscalePolicy
from paved.platform.prometheus import LocalPrometheus, PrometheusError
from paved.testing.http_stub import LoopbackHTTPServer, reply

V1 = "http://127.0.0.1:31001"  # backends are replica URLs
V2 = "http://127.0.0.1:31002"
BUCKETS = (0.1, 0.5, 1.0, 5.0)


class Exporter:
    """Serves `texts[path]` (thread-safe swaps) on 127.0.0.1."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with owner.lock:
                    text = owner.texts.get(self.path)
                if text is None:
                    self.send_error(404)
                    return
                reply(self, 200, text.encode(), "text/plain; version=0.0.4")

            def log_message(self, *args: object) -> None:
                pass

        self.stub = LoopbackHTTPServer(Handler)
        self.url = self.stub.url

    def set(self, texts: dict[str, str]) -> None:
        with self.lock:
            self.texts = dict(texts)

    def close(self) -> None:
        self.stub.close()


@dataclass
class Gateway:
    """Cumulative counters of one gateway, rendered as its /metrics would be."""

    ok: dict[str, int]
    errors: dict[str, int]
    retries: dict[str, int]
    latency: dict[str, list[float]]  # backend -> first-byte times observed

    def text(self, generation: int) -> str:
        lines = [
            "# TYPE paved_gateway_requests_total counter",
        ]
        for b, n in self.ok.items():
            lines.append(
                f'paved_gateway_requests_total{{model="tiny",tenant="t",backend="{b}",status="200"}} {n}'
            )
        for b, n in self.errors.items():
            lines.append(
                f'paved_gateway_requests_total{{model="tiny",tenant="t",backend="{b}",status="503"}} {n}'
            )
        # Refused before routing: no backend, never counted.
        lines.append('paved_gateway_requests_total{model="tiny",tenant="t",backend="",status="429"} 7')
        lines.append("# TYPE paved_gateway_retries_total counter")
        for b, n in self.retries.items():
            lines.append(f'paved_gateway_retries_total{{backend="{b}"}} {n}')
        lines.append("# TYPE paved_gateway_upstream_first_byte_seconds histogram")
        for b, times in self.latency.items():
            for le in (*BUCKETS, float("inf")):
                n = sum(1 for t in times if t <= le)
                bound = "+Inf" if le == float("inf") else repr(le)
                lines.append(
                    f'paved_gateway_upstream_first_byte_seconds_bucket{{backend="{b}",le="{bound}"}} {n}'
                )
            lines.append(f'paved_gateway_upstream_first_byte_seconds_count{{backend="{b}"}} {len(times)}')
            lines.append(f'paved_gateway_upstream_first_byte_seconds_sum{{backend="{b}"}} {sum(times)}')
        lines.append(f"paved_test_generation {generation}")
        return "\n".join(lines) + "\n"


def replica_text(
    waiting: float, running: float, kv: float, generation: int, queued: int | None = None
) -> str:
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{model_name="tiny",engine="0"}} {waiting}',
        f'vllm:num_requests_running{{model_name="tiny",engine="0"}} {running}',
        f'vllm:kv_cache_usage_perc{{model_name="tiny",engine="0"}} {kv}',
        # Another model's series on the same endpoint: filtered out by both sources.
        'vllm:num_requests_waiting{model_name="other",engine="0"} 100',
    ]
    if queued is not None:
        lines += [
            f'paved_queued_sequences{{model="tiny"}} {queued}',
            'paved_max_queued_sequences{model="tiny"} 64',
        ]
    lines.append(f"paved_test_generation {generation}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class R:
    id: str
    metrics_url: str | None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Exporter, LocalPrometheus]]:
    exporter = Exporter()
    host = exporter.url.removeprefix("http://")

    def target(path: str, **labels: str) -> dict:
        # One host for all: `instance` tells the targets' series apart.
        return {"targets": [host], "labels": {"__metrics_path__": path, "instance": path, **labels}}

    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "paved",
                "static_configs": [
                    target("/gw1", paved_role="gateway"),
                    target("/gw2", paved_role="gateway"),
                    target(
                        "/r1",
                        paved_role="replica",
                        paved_model="tiny",
                        paved_version="v1",
                        paved_replica="r1",
                    ),
                    target(
                        "/r2",
                        paved_role="replica",
                        paved_model="tiny",
                        paved_version="v1",
                        paved_replica="r-2.x",
                    ),
                ],
            }
        ],
    }
    try:
        with LocalPrometheus(yaml.safe_dump(config), tmp_path_factory.mktemp("prometheus")) as prom:
            yield exporter, prom
    finally:
        exporter.close()


def publish(exporter: Exporter, prom: LocalPrometheus, texts: dict[str, str], generation: int) -> None:
    """Serve `texts` and wait until Prometheus has scraped every target at this generation."""
    exporter.set(texts)
    deadline = time.monotonic() + 60
    while True:
        seen = prom.query("paved_test_generation")
        if {s["metric"]["instance"] for s in seen if float(s["value"][1]) == generation} == set(texts):
            return
        assert time.monotonic() < deadline, f"prometheus did not scrape generation {generation}: {seen}"
        time.sleep(0.2)


def test_gateway_counters_and_analysis_agree(world: tuple[Exporter, LocalPrometheus]) -> None:
    exporter, prom = world
    gw_urls = [exporter.url + "/gw1", exporter.url + "/gw2"]
    scrape_src = ScrapeSource(gw_urls)
    prom_src = PrometheusSource(prom.url)
    by_scrape = GatewayAnalyzer(source=scrape_src)
    by_prom = GatewayAnalyzer(source=prom_src)
    g1 = Gateway({V1: 0}, {}, {}, {V1: []})
    g2 = Gateway({V1: 0}, {}, {}, {V1: []})
    analyses = []

    async def step(generation: int) -> None:
        publish(exporter, prom, {"/gw1": g1.text(generation), "/gw2": g2.text(generation)}, generation)
        direct = await scrape_src.gateway_counters()
        queried = await prom_src.gateway_counters()
        # The same counters, summed over both gateways, whichever way they were read.
        assert (direct.requests, direct.errors, direct.buckets) == (
            queried.requests,
            queried.errors,
            queried.buckets,
        )
        assert await by_scrape.scrape_once() and await by_prom.scrape_once()

    async def scenario() -> None:
        await step(1)
        # v2 joins healthy on gateway 1, then fails (503s, retries) on both.
        baseline = (by_scrape.counters({V2}), by_prom.counters({V2}))
        assert baseline[0] == {**baseline[1], "at": baseline[0]["at"]}
        for gen, failing in ((2, False), (3, False), (4, True), (5, True)):
            for g in (g1, g2):
                g.ok[V1] += 40
                g.latency[V1] += [0.05] * 10
                if failing:
                    g.errors[V2] = g.errors.get(V2, 0) + 6
                    g.retries[V2] = g.retries.get(V2, 0) + 4
                else:
                    g.ok[V2] = g.ok.get(V2, 0) + 10
                    g.latency.setdefault(V2, []).extend([0.3, 0.7, 2.0])
            await step(gen)
            since = time.time() - 3600
            analyses.append(
                (
                    by_scrape.analyze({V2}, since, baseline[0]),
                    by_prom.analyze({V2}, since, baseline[1]),
                    by_scrape.analyze({V1}, since),
                    by_prom.analyze({V1}, since),
                )
            )

    asyncio.run(scenario())
    for a_scrape, a_prom, v1_scrape, v1_prom in analyses:
        assert a_scrape == a_prom and v1_scrape == v1_prom
    final = analyses[-1][0]
    # v2: 2 healthy steps x 2 gateways x 10, then 2 failing steps x 2 x (6 + 4).
    assert (final.requests, final.errors) == (80, 40)
    assert final.p99_s == 5.0
    assert analyses[-1][2].errors == 0 and analyses[-1][2].requests > 0


def test_replica_gauges_and_autoscaler_decisions_agree(world: tuple[Exporter, LocalPrometheus]) -> None:
    exporter, prom = world
    replicas = [R("r1", exporter.url + "/r1"), R("r-2.x", exporter.url + "/r2"), R("gone", None)]
    scrape_src = ScrapeSource()
    prom_src = PrometheusSource(prom.url)
    policy = AutoscalePolicy(
        enabled=True,
        target_waiting=2,
        target_in_flight=8,
        stable_window_s=10,
        panic_window_s=2,
        scale_down_delay_s=4,
    )
    scalers = (Autoscaler(policy), Autoscaler(policy))
    loads = [(0, 1, 0.1), (4, 6, 0.5), (9, 8, 0.9), (1, 2, 0.2), (0, 0, 0.0)]
    decisions = []

    async def run() -> None:
        target = 2
        for i, (waiting, running, kv) in enumerate(loads, start=10):
            publish(
                exporter,
                prom,
                {
                    "/r1": replica_text(waiting, running, kv, i, queued=running + waiting),
                    "/r2": replica_text(waiting / 2, running / 2, kv / 2, i),
                },
                i,
            )
            direct = await scrape_src.replica_gauges(replicas, "tiny")
            queried = await prom_src.replica_gauges(replicas, "tiny")
            assert direct == queried and len(direct) == 2
            now = float(i * 3)
            pair = []
            for scaler, samples in zip(scalers, (direct, queried), strict=True):
                scaler.observe(samples, now=now)
                pair.append(
                    scaler.decide(
                        current_target=target,
                        ready=target,
                        min_replicas=1,
                        max_replicas=10,
                        step_in_flight=False,
                        now=now,
                    )
                )
            decisions.append(pair)
            target = pair[0].target

    asyncio.run(run())
    for a, b in decisions:
        assert a == b
    assert max(a.target for a, _ in decisions) > 2  # the load did move the target


def test_prometheus_source_refusals_and_failures(world: tuple[Exporter, LocalPrometheus]) -> None:
    exporter, prom = world
    for bad in ("ftp://x", "http://", "http://h:99999", "http://h/?q=1"):
        with pytest.raises(ValueError, match="Prometheus URL"):
            PrometheusSource(bad)
    with pytest.raises(ValueError, match="label matchers"):
        PrometheusSource(prom.url, gateway_selector='x="1"} or vector(1)')
    for bad in ("prom", "prometheus", "prometheus:http://x", "scrape=1"):
        with pytest.raises(ValueError, match="scrape or prometheus=URL"):
            parse_metrics_source(bad)
    assert isinstance(parse_metrics_source("scrape", ["http://127.0.0.1:1/metrics"]), ScrapeSource)
    assert parse_metrics_source(f"prometheus={prom.url}/").url == prom.url  # type: ignore[attr-defined]

    async def failures() -> None:
        # Not a Prometheus (the exporter answers 404 for /api/v1/query), and nothing listening.
        for url in (exporter.url, "http://127.0.0.1:9"):
            src = PrometheusSource(url, timeout_s=2)
            with pytest.raises(MetricsSourceError):
                await src.gateway_counters()
            assert await src.replica_gauges([R("r1", None)], "tiny") == []
            analyzer = GatewayAnalyzer(source=src)
            assert not await analyzer.scrape_once() and analyzer.last_error
        # A PromQL error is reported as such.
        with pytest.raises(MetricsSourceError, match=r"parse error|bad_data|unexpected"):
            await PrometheusSource(prom.url).query("sum(")

    asyncio.run(failures())


def test_local_prometheus_refuses_a_bad_config(tmp_path: Path) -> None:
    with pytest.raises(PrometheusError, match="exited"), LocalPrometheus("scrape_configs: [[[", tmp_path):
        pass


def test_the_scrape_source_reads_every_replica_at_once(monkeypatch):
    """Each replica's gauges are read concurrently: one after another, replicas that hang each
    cost their whole deadline, and the controller's pass (wakes included) waited for them all.
    Here no scrape returns before all five have started; read in turn, the first never would."""
    from types import SimpleNamespace

    from paved.control_plane import metrics_source
    from paved.metrics.gauges import ReplicaMetrics

    started = 0

    async def scrape(url: str, *, model_id: str) -> ReplicaMetrics:
        nonlocal started
        started += 1
        while started < 5:
            await asyncio.sleep(0.01)
            if time.monotonic() > deadline:
                raise AssertionError(f"only {started} of 5 scrapes started: they are read in turn")
        return ReplicaMetrics(waiting=0, running=1, kv_usage=0.1)

    monkeypatch.setattr(metrics_source, "scrape", scrape)
    replicas = [SimpleNamespace(id=f"r{i}", metrics_url=f"http://127.0.0.1:9/{i}") for i in range(5)]
    deadline = time.monotonic() + 20
    read = asyncio.run(metrics_source.ScrapeSource([]).replica_gauges(replicas, "tiny"))
    assert len(read) == 5
