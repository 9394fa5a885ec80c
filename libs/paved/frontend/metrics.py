"""One /metrics for the process: frontend request metrics, admission state, every engine's
own metrics (vLLM's `vllm:*` families, one `model_name` label value per model) and, with a
KServe listener on, its request metrics (paved.kserve.metrics' `paved_kserve_*`, registered in
this registry by paved.frontend.server)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Metric,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from paved.frontend.registry import ModelRegistry

logger = logging.getLogger(__name__)

# Routes are a closed set; anything else (scanners, typos) shares one label value so a client
# cannot grow the metric's cardinality.
ROUTES = frozenset(
    {
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/rank",
        "/v1/responses",
        "/health/live",
        "/health/ready",
        "/metrics",
    }
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def process_registry() -> CollectorRegistry:
    """A registry of its own with the process, platform and GC collectors. Not the global one:
    that is where vLLM (un)registers its collectors, and tests build several servers in one
    process."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class FrontendMetrics:
    def __init__(self, models: ModelRegistry):
        self.registry = process_registry()
        self.http_requests = Counter(
            "paved_http_requests",
            "HTTP requests answered, by route, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "paved_http_request_duration_seconds",
            "Time from request start to the end of the response body (whole stream for SSE).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_in_flight = Gauge(
            "paved_http_requests_in_flight", "HTTP requests being served.", ["route"], registry=self.registry
        )
        self.rejected = Counter(
            "paved_requests_rejected",
            "Requests answered 503 overloaded (push-back: retry later), by model and reason "
            "(queue_full, engine_queue_full, constraint_checks).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.constrained = Counter(
            "paved_constrained_requests",
            "Requests with a structured-output constraint, by model and enforcing backend.",
            ["model", "backend"],
            registry=self.registry,
        )
        self.registry.register(_AdmissionCollector(models))
        self.registry.register(_EngineCollector(models))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _AdmissionCollector:
    def __init__(self, models: ModelRegistry):
        self._models = models

    def collect(self) -> Iterable[Metric]:
        queued = GaugeMetricFamily(
            "paved_queued_sequences", "Sequences admitted and not yet finished, per model.", labels=["model"]
        )
        capacity = GaugeMetricFamily(
            "paved_max_queued_sequences", "Admission bound per model (beyond it: 503).", labels=["model"]
        )
        ready = GaugeMetricFamily(
            "paved_ready", "1 when every engine is warm and the server is not draining."
        )
        for served in self._models.served():
            queued.add_metric([served.card.id], served.queued_sequences)
            capacity.add_metric([served.card.id], served.max_queued_sequences)
        ready.add_metric([], 1.0 if self._models.ready() else 0.0)
        return [queued, capacity, ready]


class _EngineCollector:
    """Engines' metric families, merged by name across engines (one family, many label sets)."""

    def __init__(self, models: ModelRegistry):
        self._models = models

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for engine in self._models.engines:
            try:
                metrics = list(engine.metrics())
            except Exception:  # a broken engine must not take /metrics down with it
                logger.exception("collecting an engine's metrics failed")
                continue
            for metric in metrics:
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(
                        metric.name, metric.documentation, metric.type, metric.unit
                    )
                family.samples.extend(metric.samples)
        return list(families.values())
