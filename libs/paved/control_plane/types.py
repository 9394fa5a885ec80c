"""The control plane's values: what is deployed, what runs, how rollouts move.

Invariants callers rely on:
- A deployment is one `(model_id, version)`; its `strategy` says how a new version replaces it
  ("red_black": traffic shifts from the old deployment to the new one and the old goes away;
  "versioned": both live side by side, consumers pin `model@version`, the bare alias follows
  `current`).
- Replica `state` moves only forward: starting -> ready -> (unhealthy -> ready)* -> draining ->
  stopped, or to failed from anywhere. Only `ready` replicas are in the published routes.
- Every decision (phase change, scale step, rollback and why) is one `AuditEvent`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

Strategy = Literal["red_black", "versioned"]
ReplicaState = Literal["starting", "ready", "unhealthy", "draining", "stopped", "failed"]
RolloutStatus = Literal["running", "succeeded", "rolled_back", "failed", "halted"]


@dataclass(frozen=True)
class AutoscalePolicy:
    """Knative-KPA-style target tracking (paved.control_plane.autoscaler)."""

    enabled: bool = False
    target_waiting: float = 2.0  # vllm:num_requests_waiting per replica
    target_kv_usage: float = 0.8  # vllm:kv_cache_usage_perc per replica (0..1)
    target_in_flight: float = 8.0  # requests running + waiting per replica
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0  # desired/current ratio that enters panic mode
    scale_down_delay_s: float = 30.0
    interval_s: float = 2.0
    # Scale to zero: with min_replicas 0, a deployment that has shown no demand (no request in
    # flight at its replicas, none answered through the gateways, no wake call) for this long
    # is scaled to 0; a gateway holding a request for it wakes it (POST
    # /v1/models/{model}/wake). None: never below one replica (the KPA's floor is then
    # max(1, min_replicas)). Needs `enabled` and min_replicas 0 (store.validate_spec).
    scale_to_zero_after_s: float | None = None


@dataclass(frozen=True)
class DeploymentSpec:
    model_id: str
    version: str
    package_uri: str  # the launcher's format: s3://..., a path, a tarball
    strategy: Strategy = "red_black"
    min_replicas: int = 1
    max_replicas: int = 4
    replicas: int = 1  # desired now (autoscaler and rollouts move it within [min, max])
    regions: tuple[str, ...] = ("local",)
    engine: str = "package"  # "package" (the package's own engine) or a sim:// URI (simulated)
    autoscale: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    no_gc: bool = False  # pinned: never garbage-collected
    # The gateway route options this version's alias is published with (ROUTE_OPTIONS in
    # paved.control_plane.store: cache, template, context budget, summarizer, tokenizer).
    route: dict[str, Any] = field(default_factory=dict)
    # Where a cluster driver may place the replicas: {"node_selector": {label: value},
    # "tolerations": [Kubernetes toleration objects]} (store.validate_placement). The local
    # driver has one host and ignores it.
    placement: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Deployment:
    id: str
    spec: DeploymentSpec
    fingerprint: dict[str, Any]
    created_at: datetime
    state: Literal["active", "inactive", "deleted"] = "active"
    current: bool = False  # versioned: the version the bare alias follows
    last_traffic_at: datetime | None = None


@dataclass(frozen=True)
class Replica:
    id: str
    deployment_id: str
    region: str
    state: ReplicaState
    url: str  # OpenAI base (the launcher's public HTTP port)
    admin_url: str  # the launcher's admin port (/health/ready, /status)
    kserve_grpc: str | None = None
    kserve_http: str | None = None
    metrics_url: str | None = None  # where its engine gauges are scraped
    # How the driver finds its process again after a control-plane restart.
    driver_ref: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why unhealthy / failed


@dataclass(frozen=True)
class AuditEvent:
    id: int
    at: datetime
    kind: str  # e.g. "rollout.phase", "scale", "rollback", "replica.replaced", "gc"
    model_id: str | None
    version: str | None
    rollout_id: str | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)
