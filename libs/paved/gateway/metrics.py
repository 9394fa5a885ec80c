"""The gateway's Prometheus metrics, on a registry of its own (two gateways in one test process
must not share counters).

Label sets are closed: tenant ids and model aliases come from the gateway's own state and routes
(not from request text), backend ids from the routes table, status is the HTTP status.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_STAGE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "paved_gateway_requests",
            "Requests answered, by tenant, model alias, backend and HTTP status",
            ("tenant", "model", "backend", "status"),
            registry=r,
        )
        self.latency = Histogram(
            "paved_gateway_request_duration_seconds",
            "Time from request to last byte, by tenant and model alias",
            ("tenant", "model"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "paved_gateway_upstream_first_byte_seconds",
            "Time from forwarding to the upstream's response headers, by backend",
            ("backend",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "paved_gateway_stage_duration_seconds",
            "Time spent in each gateway stage before forwarding (auth, limits, route)",
            ("stage",),
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "paved_gateway_tokens",
            "Tokens reported by upstreams' usage, by tenant, model alias and kind",
            ("tenant", "model", "kind"),
            registry=r,
        )
        self.in_flight = Gauge(
            "paved_gateway_in_flight_requests",
            "Requests being forwarded, by backend",
            ("backend",),
            registry=r,
        )
        # reason: "overloaded" (the backend pushed back: 503 with error code overloaded) or
        # "error" (anything else: connect errors, resets, other 5xx, a 503 unavailable).
        self.retries = Counter(
            "paved_gateway_retries",
            "Tries a backend did not answer that were moved to another backend or queued again, "
            "by the backend and reason (overloaded: it pushed back; error: it failed)",
            ("backend", "reason"),
            registry=r,
        )
        # Push-back is not failure: rollout analysis subtracts these from a backend's errors.
        self.pushback = Counter(
            "paved_gateway_pushback",
            "Answers by which a backend pushed back (503 with error code overloaded: its queue is "
            "full), whether retried, queued again or passed on, by backend",
            ("backend",),
            registry=r,
        )
        self.stream_errors = Counter(
            "paved_gateway_stream_errors",
            "Streams that ended with an error event (upstream reset or timeout mid-stream), by backend",
            ("backend",),
            registry=r,
        )
        self.disconnects = Counter(
            "paved_gateway_client_disconnects",
            "Requests whose client went away before the answer ended (the upstream was aborted)",
            ("model",),
            registry=r,
        )
        self.cache = Counter(
            "paved_gateway_cache_lookups",
            "Cache lookups by tenant, model alias and result (exact, semantic, miss, bypass)",
            ("tenant", "model", "result"),
            registry=r,
        )
        self.cache_false_hits = Counter(
            "paved_gateway_cache_false_hit_reports",
            "Cache hits a client reported as wrong (the entry is evicted), by tenant",
            ("tenant",),
            registry=r,
        )
        self.summarized_turns = Counter(
            "paved_gateway_context_summarized_turns",
            "Conversation turns replaced by a summary (or dropped) to fit the budget, by model alias",
            ("model",),
            registry=r,
        )
        self.misconfigured = Counter(
            "paved_gateway_misconfigured",
            "Requests served around operator configuration that did not resolve (kind: "
            "route_template, tenant_template, arm_template, arm_version)",
            ("kind", "model"),
            registry=r,
        )
        self.internal = Histogram(
            "paved_gateway_internal_call_duration_seconds",
            "The gateway's own calls through the platform (summaries, cache embeddings), by purpose",
            ("purpose", "outcome"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Flow control (paved.gateway.flow.flow): the per-model queue in front of dispatch.
        self.queue_depth = Gauge(
            "paved_gateway_queue_depth",
            "Requests waiting in the gateway's queue for room at a model's backends, by model alias "
            "and tenant",
            ("model", "tenant"),
            registry=r,
        )
        self.queue_wait = Histogram(
            "paved_gateway_queue_wait_seconds",
            "Time a request waited in the gateway's queue before each dispatch (0 when it went "
            "straight through), by model alias and tenant",
            ("model", "tenant"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_refused = Counter(
            "paved_gateway_queue_refused",
            "Requests refused with 503 by the gateway's queue, by model alias, tenant and reason "
            "(full, deadline)",
            ("model", "tenant", "reason"),
            registry=r,
        )
        self.queue_window = Gauge(
            "paved_gateway_queue_window",
            "Requests this gateway lets be in flight to a model before holding more (learned from "
            "the backends' push-back; 0: not limited), by model alias",
            ("model",),
            registry=r,
        )
        # Scale to zero: these exist while a model has no replica, so they are the demand signal
        # an operator's autoscaler (or a dashboard) can read at zero.
        self.held = Gauge(
            "paved_gateway_held_requests",
            "Requests held for a model scaled to zero while it wakes, by model alias",
            ("model",),
            registry=r,
        )
        self.wake_calls = Counter(
            "paved_gateway_wake_calls",
            "Calls to the control plane's wake endpoint for a model scaled to zero, by model alias "
            "and outcome (ok, error)",
            ("model", "outcome"),
            registry=r,
        )
        self.routes_revision = Gauge(
            "paved_gateway_routes_loaded_timestamp_seconds",
            "When the serving routes table was loaded",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
