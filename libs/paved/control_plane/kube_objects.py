"""The Kubernetes objects of one deployment in one region: a Deployment running the launcher
image, a Service and a PodDisruptionBudget (plain dicts, applied server-side by
paved.control_plane.kube_driver and printed by `paved render`).

Invariants callers rely on:
- Names and labels depend only on (deployment id, region): re-rendering is idempotent, and the
  driver finds its objects again after a restart from the labels alone.
- The Deployment never sets `spec.replicas`: the count belongs to the scale subresource (the
  driver), so re-applying the objects never resizes a running deployment.
- A pod serves when its `paved.dev/member` label is "true"; the driver flips it to "released"
  to take one chosen pod out of the ReplicaSet (and the Service) before deleting it.
- Every container port is fixed (each pod has its own IP): http 8000, admin 8001, metrics 8002,
  KServe gRPC 8003; the launcher binds them on the pod's IP (`$(POD_IP)`).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from paved.control_plane.driver import ReplicaRequest, launcher_args, port_names
from paved.control_plane.errors import BadRequest
from paved.control_plane.store import validate_placement

PORTS = {"http": 8000, "admin": 8001, "metrics": 8002, "grpc": 8003}
CACHE_MOUNT = "/var/cache/paved/models"
METRICS_MOUNT = "/var/run/paved/metrics"
MANAGED_BY = "paved"
LABEL_DEPLOYMENT = "paved.dev/deployment"
LABEL_REGION = "paved.dev/region"
LABEL_MEMBER = "paved.dev/member"
ANNOTATION_REPLICA = "paved.dev/replica"
_IMAGE = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"(?::[0-9]{1,5})?/)?"
    r"[a-z0-9]+(?:(?:\.|_{1,2}|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_{1,2}|-+)[a-z0-9]+)*)*"
    r"@sha256:[0-9a-f]{64}"
)
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class KubeSettings:
    """How one region's replicas run on its cluster.

    model_cache: "pvc:CLAIM" (a ReadWriteMany claim shared by the region's pods: the launcher's
    verified cache makes a second pod's start a warm one) or "host:/PATH" (a node's directory,
    warm per node) or "" (an emptyDir: every pod downloads its package).
    """

    namespace: str = "paved"
    image: str = ""  # the launcher image, by digest (name@sha256:...)
    model_cache: str = ""
    drain_timeout_s: float = 30.0
    # The gateways learn a routes change a moment after it is published; preStop waits that
    # long before the launcher is told to drain (Controller.drain_delay_s, by another name).
    pre_stop_s: int = 3
    # LLM cold starts (download, load, compile, warm-up) take minutes: the startup probe allows
    # this long before the liveness probe takes over.
    startup_budget_s: int = 1800
    gpu_resource: str = "nvidia.com/gpu"  # "" on a CPU cluster: gpus are not requested
    cpu: str = "2"
    memory: str = "8Gi"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    s3_endpoint_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> KubeSettings:
        if not isinstance(self.namespace, str) or not _NAMESPACE.fullmatch(self.namespace):
            raise BadRequest(f"namespace must be a DNS label, got {self.namespace!r:.80}")
        try:
            image_ref(self.image)
        except ValueError as e:
            raise BadRequest(f"image must be pinned by digest: {e}") from None
        kind, _, where = self.model_cache.partition(":")
        if self.model_cache and not (
            (kind == "pvc" and _NAMESPACE.fullmatch(where)) or (kind == "host" and where.startswith("/"))
        ):
            raise BadRequest(f"model_cache must be pvc:CLAIM or host:/PATH, got {self.model_cache!r:.120}")
        if not (
            isinstance(self.drain_timeout_s, int | float)
            and math.isfinite(self.drain_timeout_s)
            and 0 < self.drain_timeout_s <= 3600
        ):
            raise BadRequest(f"drain_timeout_s must be in (0, 3600], got {self.drain_timeout_s!r}")
        for name in ("pre_stop_s", "startup_budget_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 86400:
                raise BadRequest(f"{name} must be an integer in [0, 86400], got {value!r}")
        for name in ("cpu", "memory"):
            if not _QUANTITY.fullmatch(str(getattr(self, name))):
                raise BadRequest(f"{name} must be a Kubernetes quantity, got {getattr(self, name)!r:.40}")
        validate_placement({"node_selector": self.node_selector, "tolerations": self.tolerations})
        return self


def image_ref(text: str) -> str:
    """`text` if it is an image pinned by digest (name@sha256:<64 lowercase hex>), else
    ValueError saying why (a tag, no digest, a malformed name)."""
    if not isinstance(text, str) or not text:
        raise ValueError("an image is required, pinned by digest: NAME@sha256:<64 hex>")
    if _IMAGE.fullmatch(text):
        return text
    name, at, digest = text.partition("@")
    if not at:
        raise ValueError(f"image {text!r:.200} is not pinned by digest: use NAME@sha256:<64 hex>, not a tag")
    if ":" in name.rsplit("/", 1)[-1]:
        raise ValueError(f"image {text!r:.200} has a tag as well as a digest: give NAME@sha256:<64 hex> only")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ValueError(f"image {text!r:.200}: the digest must be sha256: and 64 lowercase hex digits")
    raise ValueError(f"image {text!r:.200}: not a valid image name (lowercase [a-z0-9._-] path components)")


def object_name(deployment_id: str, region: str) -> str:
    """A DNS label unique per (deployment, region): readable prefix, hashed suffix."""
    slug = re.sub(r"[^a-z0-9]+", "-", deployment_id.lower()).strip("-")[:40] or "d"
    digest = hashlib.sha256(f"{deployment_id}\0{region}".encode()).hexdigest()[:8]
    return f"paved-{slug}-{digest}"


def selector(deployment_id: str, region: str) -> dict[str, str]:
    return {
        LABEL_DEPLOYMENT: label_value(deployment_id),
        LABEL_REGION: label_value(region),
        LABEL_MEMBER: "true",
    }


def label_value(value: str) -> str:
    """A label value for any string: as is when valid, else a readable hash."""
    if _LABEL_VALUE.fullmatch(value):
        return value
    return "h-" + hashlib.sha256(value.encode()).hexdigest()[:40]


def _toleration(t: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in t.items() if k != "toleration_seconds"}
    if "toleration_seconds" in t:
        out["tolerationSeconds"] = t["toleration_seconds"]
    return out


def replica_objects(
    *,
    deployment_id: str,
    model_id: str,
    version: str,
    region: str,
    package_uri: str,
    engine: str = "package",
    kserve: bool = False,
    kind: str = "generate",
    gpus: int = 0,
    placement: dict[str, Any] | None = None,
    settings: KubeSettings,
    pdb_api: str = "policy/v1",
) -> list[dict[str, Any]]:
    """[Deployment, Service, PodDisruptionBudget] for one deployment's replicas in `region`."""
    settings.validate()
    placement = validate_placement(placement or {})
    if pdb_api not in ("policy/v1", "policy/v1beta1"):
        raise BadRequest(f"pdb_api must be policy/v1 or policy/v1beta1, got {pdb_api!r}")
    # The same checks as a local replica's (the id is a stand-in: pods get their own).
    req = ReplicaRequest(
        replica_id="pod",
        deployment_id=deployment_id,
        model_id=model_id,
        version=version,
        package_uri=package_uri,
        region=region,
        engine=engine,
        kserve=kserve,
        kind=kind,
        gpus=gpus,
    )
    req.validate()
    name = object_name(deployment_id, region)
    match = selector(deployment_id, region)
    labels = {
        "app.kubernetes.io/name": "paved-replica",
        "app.kubernetes.io/part-of": "paved",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": "replica",
        **match,
    }
    annotations = {
        "paved.dev/model": model_id,
        "paved.dev/version": version,
        "paved.dev/deployment-id": deployment_id,
    }
    meta = {"name": name, "namespace": settings.namespace, "labels": labels, "annotations": annotations}
    names = port_names(req)
    args = launcher_args(
        req,
        host="$(POD_IP)",
        ports={n: PORTS[n] for n in names},
        cache_dir=CACHE_MOUNT,
        metrics_dir=METRICS_MOUNT,
        drain_timeout_s=settings.drain_timeout_s,
        s3_endpoint_url=settings.s3_endpoint_url,
    )
    resources: dict[str, Any] = {
        "requests": {"cpu": settings.cpu, "memory": settings.memory},
        "limits": {"memory": settings.memory},
    }
    tolerations = [_toleration(t) for t in (*settings.tolerations, *placement.get("tolerations", []))]
    if gpus and settings.gpu_resource:
        resources["requests"][settings.gpu_resource] = str(gpus)
        resources["limits"][settings.gpu_resource] = str(gpus)
        tolerations.append({"key": settings.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    admin = {"port": "admin", "scheme": "HTTP"}
    container = {
        "name": "launcher",
        "image": settings.image,
        "args": args,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *({"name": k, "value": v} for k, v in sorted(settings.env.items())),
        ],
        "ports": [{"name": n, "containerPort": PORTS[n], "protocol": "TCP"} for n in names],
        "resources": resources,
        "startupProbe": {
            "httpGet": {**admin, "path": "/health/live"},
            "periodSeconds": 5,
            "failureThreshold": max(1, settings.startup_budget_s // 5),
        },
        "livenessProbe": {
            "httpGet": {**admin, "path": "/health/live"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {**admin, "path": "/health/ready"},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        # The routes without this pod reach the gateways before the launcher drains.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.pre_stop_s)]}}},
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            {"name": "metrics", "mountPath": METRICS_MOUNT},
        ],
        "securityContext": {"allowPrivilegeEscalation": False},
        # A launcher that fails writes why as its last line; the kubelet keeps the log's tail
        # as the termination message, which the driver's exit_reason reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    kind_, _, where = settings.model_cache.partition(":")
    if kind_ == "pvc":
        cache: dict[str, Any] = {"name": "model-cache", "persistentVolumeClaim": {"claimName": where}}
    elif kind_ == "host":
        cache = {"name": "model-cache", "hostPath": {"path": where, "type": "DirectoryOrCreate"}}
    else:
        cache = {"name": "model-cache", "emptyDir": {}}
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # a replica never talks to the API server
        "enableServiceLinks": False,
        # preStop, then the launcher's own drain, then a margin before SIGKILL.
        "terminationGracePeriodSeconds": settings.pre_stop_s + math.ceil(settings.drain_timeout_s) + 5,
        "containers": [container],
        "volumes": [cache, {"name": "metrics", "emptyDir": {}}],
    }
    node_selector = {**settings.node_selector, **placement.get("node_selector", {})}
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": match},
            "revisionHistoryLimit": 2,
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "selector": match,
            "ports": [{"name": n, "port": PORTS[n], "targetPort": n, "protocol": "TCP"} for n in names],
        },
    }
    pdb = {
        "apiVersion": pdb_api,
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        # Node drains take replicas one at a time; the control plane's own scale-down is not
        # an eviction and is not held by it.
        "spec": {"selector": {"matchLabels": match}, "maxUnavailable": 1},
    }
    return [deployment, service, pdb]
