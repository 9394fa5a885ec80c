"""Request metrics of the KServe v2 server, in the spirit of Triton's `nv_inference_*`.

    paved_kserve_request_success_total{model,protocol}          nv_inference_request_success
    paved_kserve_request_failure_total{model,protocol,status}   nv_inference_request_failure
    paved_kserve_inference_count_total{model,protocol}          nv_inference_count
    paved_kserve_request_duration_seconds{model,protocol}       nv_inference_request_duration_us
    paved_kserve_requests_in_flight{model,protocol}

What counts is an inference request: a ModelInfer call, each request on a ModelStreamInfer
stream, and an HTTP infer / generate / generate_stream call (health, metadata and the other
routes are not). `protocol` is grpc or http; `status` is the gRPC status code name on both
transports (NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE, RESOURCE_EXHAUSTED, CANCELLED, ...), so a
failure reads the same whichever way it came. The inference count is rows: the batch dimension
of a model with `max_batch_size > 0` (an XGBoost request of 5 rows counts 5), one otherwise
(an LLM request). Durations are of successful requests (a stream: until its final response),
from the request's arrival to its answer.

Label cardinality is bounded: `model` is a name the repository serves, or `(unknown)` for any
other (a client cannot grow the series by inventing names).

The metrics live in the CollectorRegistry they are given: the OpenAI frontend passes its own,
so its /metrics carries them; the standalone server has a registry of its own served at GET
/metrics on its HTTP port.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from paved.kserve.errors import from_exception

UNKNOWN_MODEL = "(unknown)"
GRPC = "grpc"
HTTP = "http"
# From XGBoost's sub-millisecond batches to an LLM's minutes-long generation.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


class _Series(NamedTuple):
    """One (model, protocol)'s children of the metrics (failures have a status label more)."""

    in_flight: Gauge
    success: Counter
    inferences: Counter
    duration: Histogram


class KServeMetrics:
    def __init__(self, registry: CollectorRegistry, serves: Callable[[str], bool]):
        """`serves(name)`: whether the repository serves a model of that name (its label)."""
        self._serves = serves
        labels = ["model", "protocol"]

        def counter(name: str, documentation: str, *more_labels: str) -> Counter:
            return Counter(name, documentation, [*labels, *more_labels], registry=registry)

        self.success = counter(
            "paved_kserve_request_success",
            "KServe inference requests answered successfully, by model and protocol.",
        )
        self.failure = counter(
            "paved_kserve_request_failure",
            "KServe inference requests that failed, by model, protocol and gRPC status code name.",
            "status",
        )
        self.inferences = counter(
            "paved_kserve_inference_count",
            "Rows inferred by successful KServe requests (the batch size; 1 for an unbatched model).",
        )
        self.duration = Histogram(
            "paved_kserve_request_duration_seconds",
            "Time from a KServe inference request's arrival to its (final) response, successes only.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        # livesum: under PROMETHEUS_MULTIPROC_DIR (the launcher sets it) the merged view is the
        # live processes' sum, not one series per pid.
        self.in_flight = Gauge(
            "paved_kserve_requests_in_flight",
            "KServe inference requests being served, by model and protocol.",
            labels,
            registry=registry,
            multiprocess_mode="livesum",
        )

        # (model label, protocol) -> its series: `labels()` validates and locks on every call,
        # several microseconds each, four times per request. Bounded as the labels are.
        self._series: dict[tuple[str, str], _Series] = {}

    def series(self, label: str, protocol: str) -> _Series:
        key = (label, protocol)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = _Series(
                self.in_flight.labels(label, protocol),
                self.success.labels(label, protocol),
                self.inferences.labels(label, protocol),
                self.duration.labels(label, protocol),
            )
        return found

    def model_label(self, name: str) -> str:
        return name if self._serves(name) else UNKNOWN_MODEL

    def request(self, name: str, protocol: str) -> InferenceRecord:
        """Count an inference request for model `name` arriving now (in flight until it ends)."""
        return InferenceRecord(self, self.model_label(name), protocol)

    def failed(self, label: str, protocol: str, status: str, *, was_started: bool = True) -> None:
        """A failed request; `was_started=False` for one refused before it was counted in flight."""
        if was_started:
            self.series(label, protocol).in_flight.dec()
        self.failure.labels(label, protocol, status).inc()


class InferenceRecord:
    """One inference request, in flight from its creation until `succeeded` or `failed`."""

    def __init__(self, metrics: KServeMetrics, label: str, protocol: str):
        self._metrics = metrics
        self.label = label
        self.protocol = protocol
        self._started = time.perf_counter()
        self._series = metrics.series(label, protocol)
        self._series.in_flight.inc()

    def succeeded(self, rows: int) -> None:
        series = self._series
        series.in_flight.dec()
        series.success.inc()
        series.inferences.inc(rows)
        series.duration.observe(time.perf_counter() - self._started)

    def failed(self, status: str) -> None:
        self._metrics.failed(self.label, self.protocol, status)

    @contextmanager
    def failures(self) -> Iterator[None]:
        """Count a failure raised in the block: a cancellation as CANCELLED (re-raised), any
        other exception as the KServeError that from_exception makes of it, raised in its place
        (from_exception once per request: it logs unexpected errors)."""
        try:
            yield
        except asyncio.CancelledError:
            self.failed(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as e:
            error = from_exception(e)
            self.failed(error.code.name)
            if error is e:
                raise
            raise error from e


def batch_rows(max_batch_size: int, inputs: dict) -> int:
    """Rows a request carries: its batch dimension for a batching model, else 1."""
    if max_batch_size > 0:
        for array in inputs.values():
            shape = getattr(array, "shape", ())
            if shape:
                return int(shape[0])
    return 1
