"""paved's own objects on a Kubernetes cluster (what `paved render` prints): the control plane
(ServiceAccount, the least RBAC its driver needs, Deployment, Service, PodDisruptionBudget) and
the gateway (ServiceAccount, Deployment, Service, PodDisruptionBudget), as plain dicts.

Invariants callers rely on:
- Pure: the same `PlatformSettings` give the same list, in apply order (namespaces, accounts
  and RBAC before the workloads that use them), of JSON-able dicts sharing no sub-objects;
  nothing here talks to a cluster.
- Every object carries app.kubernetes.io/{name,part-of=paved,managed-by=paved,component}.
- Secrets are only referenced (by name and key), never rendered: no credential ever appears in
  the output. Images are accepted only pinned by digest (`image_ref`).
- The objects use only fields that Kubernetes 1.20 already serves (the oldest version
  supported, `MIN_KUBERNETES`); the PodDisruptionBudget apiVersion follows the target version
  (`pdb_api_version`), so one rendering applies to the cluster it was rendered for.
- The control plane's Role is namespaced, in the replicas' namespace, and is exactly
  `CONTROL_PLANE_RULES`: no ClusterRole (nothing the driver does is cluster-scoped; leader
  election is a PostgreSQL advisory lock, not a Lease).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from paved.control_plane.errors import BadRequest
from paved.control_plane.kube_objects import KubeSettings, image_ref

MIN_KUBERNETES = (1, 20)
PART_OF = "paved"
MANAGED_BY = "paved"
CONTROL_PLANE = "paved-control-plane"
GATEWAY = "paved-gateway"
CONTROL_PLANE_PORT = 8090
GATEWAY_PORT = 8080
# Neither image declares a user; a fixed non-root uid lets runAsNonRoot be checked by the kubelet
# (it refuses to start a non-numeric or root user) and fsGroup makes mounted secrets readable.
RUN_AS = 65532
STATE_DIR = "/var/lib/paved"
# An emptyDir of the pod's own (the root file system is read-only), not a shared /tmp.
TMP_DIR = "/tmp"  # noqa: S108
ADMIN_KEY_DIR = "/etc/paved/admin-key"
ADMIN_KEY_FILE = "admin-key"
# The gateways' admin key, in the control plane's pods only: its dashboard lists every tenant's
# batches through the gateways' read-only admin API.
GATEWAY_ADMIN_KEY_DIR = "/etc/paved/gateway-admin-key"

# The control plane's driver, verb by verb: nothing more (render_test asserts this exact list).
CONTROL_PLANE_RULES: tuple[dict[str, list[str]], ...] = (
    # One Deployment per (model, version, region): created and updated by server-side apply
    # (create + patch), watched for state (get/list/watch), replaced with `update` when an
    # apply conflicts, deleted when the deployment is.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"],
    },
    # Replica counts move only through the scale subresource, so that re-applying a Deployment
    # never resizes it.
    {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "update", "patch"]},
    # The per-deployment Service the gateway's backends are found behind; never `update`d:
    # apply patches it.
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Pods are read for their addresses and readiness (watch), relabelled to take one chosen
    # pod out of its ReplicaSet before a drain (patch) and deleted to drain it. The driver
    # never creates a pod: the ReplicaSet controller does.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    # One PodDisruptionBudget per deployment so a node drain takes replicas one at a time.
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Rollout and drain decisions reported as Events on the objects (`kubectl describe`).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
)

# A reference pinned by digest: [registry[:port]/]path@sha256:<64 hex>. A tag (`:v1`), also one
# next to a digest, is refused: what runs must be exactly what was reviewed.
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
# An extended resource: a domain-qualified name (nvidia.com/gpu, amd.com/gpu).
_RESOURCE = re.compile(r"[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")
# control_plane.store.NAME_RE, without "=" (the region is passed as NAME=in-cluster).
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION = re.compile(r"v?([0-9]{1,3})\.([0-9]{1,3})(?:\.[0-9]{1,5})?")
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# KubeSettings field -> PlatformSettings field.
_REPLICA_FIELDS = {"cpu": "replica_cpu", "memory": "replica_memory"}


def kubernetes_version(text: str) -> tuple[int, int]:
    """'1.20', 'v1.29.3' -> (major, minor); ValueError below MIN_KUBERNETES or malformed."""
    match = _VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"invalid Kubernetes version {text!r:.40}: use MAJOR.MINOR, e.g. 1.29")
    version = (int(match.group(1)), int(match.group(2)))
    if version < MIN_KUBERNETES:
        low = ".".join(map(str, MIN_KUBERNETES))
        raise ValueError(f"Kubernetes {version[0]}.{version[1]} is not supported: paved needs {low} or newer")
    return version


def pdb_api_version(version: tuple[int, int]) -> str:
    """PodDisruptionBudget's apiVersion on that Kubernetes: policy/v1 is served from 1.21,
    policy/v1beta1 until 1.24 (removed in 1.25)."""
    return "policy/v1" if version >= (1, 21) else "policy/v1beta1"


@dataclass(frozen=True)
class SecretRef:
    """One key of a Secret the operator creates (paved never renders its value)."""

    name: str
    key: str

    @classmethod
    def parse(cls, text: str, default_key: str) -> SecretRef:
        """'NAME' or 'NAME:KEY' (NAME a DNS subdomain, KEY a Secret data key)."""
        name, colon, key = text.partition(":")
        ref = cls(name, key if colon else default_key)
        ref.validate()
        return ref

    def validate(self, what: str = "") -> None:
        """ValueError ("WHAT: why", or just why without `what`) for an unusable name or key."""
        prefix = f"{what}: " if what else ""
        if not (len(self.name) <= 253 and _DNS_SUBDOMAIN.fullmatch(self.name)):
            raise ValueError(f"{prefix}Secret name {self.name!r:.80} must be a DNS subdomain ([a-z0-9.-])")
        if not _SECRET_KEY.fullmatch(self.key):
            raise ValueError(f"{prefix}Secret key {self.key!r:.80} must be 1-253 of [-._a-zA-Z0-9]")


def _resources(cpu: str, memory: str, memory_limit: str) -> dict[str, Any]:
    # No CPU limit: throttling a latency-bound proxy hurts more than sharing spare cycles.
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory_limit}}


@dataclass(frozen=True)
class PlatformSettings:
    """What one rendering of the platform needs. `validate()` raises ValueError whose message
    starts with the name of the field at fault (the CLI maps fields to its flags)."""

    namespace: str
    control_plane_image: str
    gateway_image: str
    launcher_image: str
    # Where the replicas run (the Role and RoleBinding live there); "" = `namespace`.
    replica_namespace: str = ""
    region: str = "cluster"
    model_cache: str = ""  # pvc:CLAIM | host:/PATH | "" (an emptyDir per pod)
    gpu_resource: str = "nvidia.com/gpu"
    # A replica pod's CPU and memory requests, and how long a drained replica may take.
    replica_cpu: str = "2"
    replica_memory: str = "8Gi"
    drain_timeout_s: float = 30.0
    # Only apiVersions depend on it: (1, 21) stands for "1.21 or newer" (policy/v1).
    kubernetes: tuple[int, int] = (1, 21)
    create_namespace: bool = False
    control_plane_replicas: int = 2
    gateway_replicas: int = 3
    gateway_service_type: str = "ClusterIP"
    control_plane_state: SecretRef = SecretRef("paved-control-plane-postgres", "url")
    control_plane_admin_key: SecretRef = SecretRef("paved-control-plane-admin", "admin-key")
    gateway_state: SecretRef = SecretRef("paved-gateway-postgres", "url")
    gateway_redis: SecretRef = SecretRef("paved-redis", "url")
    gateway_admin_key: SecretRef = SecretRef("paved-gateway-admin", "admin-key")
    control_plane_resources: dict[str, Any] = field(
        default_factory=lambda: _resources("250m", "512Mi", "1Gi")
    )
    gateway_resources: dict[str, Any] = field(default_factory=lambda: _resources("500m", "512Mi", "2Gi"))

    @property
    def replicas_namespace(self) -> str:
        return self.replica_namespace or self.namespace

    @property
    def pdb_api(self) -> str:
        return pdb_api_version(self.kubernetes)

    def replica_settings(self) -> KubeSettings:
        """The driver's settings, exactly as the rendered control plane builds them from its
        flags (`control_plane_args`): `paved render` prints the replicas' objects it would apply."""
        return KubeSettings(
            namespace=self.replicas_namespace,
            image=self.launcher_image,
            model_cache=self.model_cache,
            drain_timeout_s=self.drain_timeout_s,
            gpu_resource=self.gpu_resource,
            cpu=self.replica_cpu,
            memory=self.replica_memory,
        )

    @property
    def gateway_url(self) -> str:
        """The gateways' Service as the control plane reaches it (cluster DNS)."""
        return f"http://{GATEWAY}.{self.namespace}.svc:{GATEWAY_PORT}"

    @property
    def control_plane_url(self) -> str:
        """The control plane's Service as the gateways reach it (cluster DNS, any cluster domain)."""
        return f"http://{CONTROL_PLANE}.{self.namespace}.svc:{CONTROL_PLANE_PORT}"

    def validate(self) -> PlatformSettings:
        for name in ("namespace", "replica_namespace"):
            value = getattr(self, name)
            if (value or name == "namespace") and not _DNS_LABEL.fullmatch(value):
                raise ValueError(f"{name}: {value!r:.80} must be a DNS label (1-63 of [a-z0-9-])")
        for name in ("control_plane_image", "gateway_image", "launcher_image"):
            try:
                image_ref(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if not _REGION.fullmatch(self.region):
            raise ValueError(
                f"region: {self.region!r:.80} must be 1-128 of [A-Za-z0-9._-], starting alphanumeric"
            )
        kind, _, where = self.model_cache.partition(":")
        if self.model_cache and not (
            (kind == "pvc" and _DNS_SUBDOMAIN.fullmatch(where) and len(where) <= 253)
            or (
                kind == "host"
                and where.startswith("/")
                and ".." not in where.split("/")
                and "\0" not in where
            )
        ):
            raise ValueError(
                f"model_cache: {self.model_cache!r:.120} must be pvc:CLAIM or host:/ABSOLUTE/PATH"
            )
        if self.gpu_resource and not (
            len(self.gpu_resource) <= 253 and _RESOURCE.fullmatch(self.gpu_resource)
        ):
            raise ValueError(
                f"gpu_resource: {self.gpu_resource!r:.80} must be DOMAIN/NAME, e.g. nvidia.com/gpu"
            )
        if self.kubernetes < MIN_KUBERNETES:
            raise ValueError(f"kubernetes: {self.kubernetes} is older than {MIN_KUBERNETES}")
        for name, high in (("control_plane_replicas", 10), ("gateway_replicas", 1000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"{name}: must be an integer in 1..{high}, got {value!r}")
        if self.gateway_service_type not in _SERVICE_TYPES:
            raise ValueError(f"gateway_service_type: must be one of {', '.join(_SERVICE_TYPES)}")
        for name in ("control_plane_state", "control_plane_admin_key", "gateway_state", "gateway_redis"):
            getattr(self, name).validate(name)
        self.gateway_admin_key.validate("gateway_admin_key")
        try:
            self.replica_settings().validate()
        except BadRequest as e:
            # What is left to check there: cpu, memory, drain_timeout_s (the message's first word).
            field = e.message.split(" ", 1)[0]
            raise ValueError(f"{_REPLICA_FIELDS.get(field, field)}: {e.message}") from None
        return self


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": component,
    }


def _selector(name: str, component: str) -> dict[str, str]:
    # The selector is immutable once applied: only labels that never change.
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/component": component,
    }


def _meta(name: str, component: str, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = labels(name, component)
    return meta


def namespace_objects(s: PlatformSettings) -> list[dict[str, Any]]:
    """The Namespace(s), when `create_namespace`: the platform's, and the replicas' if apart."""
    if not s.create_namespace:
        return []
    names = dict.fromkeys([s.namespace, s.replicas_namespace])
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(n, "namespace", None)} for n in names]


def control_plane_rbac(s: PlatformSettings) -> list[dict[str, Any]]:
    """The control plane's ServiceAccount, and a Role + RoleBinding in the replicas' namespace
    granting exactly CONTROL_PLANE_RULES."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(CONTROL_PLANE, "control-plane", s.namespace),
        # Mounted only where a pod asks for it (the control plane's pod does).
        "automountServiceAccountToken": False,
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(CONTROL_PLANE, "control-plane", s.replicas_namespace),
        "rules": [{k: list(v) for k, v in rule.items()} for rule in CONTROL_PLANE_RULES],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(CONTROL_PLANE, "control-plane", s.replicas_namespace),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": CONTROL_PLANE},
        "subjects": [{"kind": "ServiceAccount", "name": CONTROL_PLANE, "namespace": s.namespace}],
    }
    return [account, role, binding]


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        # Both mains write only under $PAVED_STATE_DIR and /tmp, which are emptyDirs.
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _secret_env(name: str, ref: SecretRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _admin_key_volume(ref: SecretRef, name: str = "admin-key") -> dict[str, Any]:
    return {
        "name": name,
        # 0440 with fsGroup: readable by the container's group only.
        "secret": {
            "secretName": ref.name,
            "items": [{"key": ref.key, "path": ADMIN_KEY_FILE}],
            "defaultMode": 0o440,
        },
    }


def _probe(path: str, *, period: int, failures: int, timeout: int = 2) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _spread(selector: dict[str, str]) -> dict[str, Any]:
    # Preferred, not required: a one-node cluster still runs every replica.
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": selector},
                    },
                }
            ]
        }
    }


def _pdb(s: PlatformSettings, name: str, component: str) -> dict[str, Any]:
    # maxUnavailable (not minAvailable): a node drain is never blocked, even at one replica.
    return {
        "apiVersion": s.pdb_api,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, component, s.namespace),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(name, component)}},
    }


def _service(s: PlatformSettings, name: str, component: str, port: int, service_type: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, component, s.namespace),
        "spec": {
            "type": service_type,
            "selector": _selector(name, component),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def control_plane_args(s: PlatformSettings) -> list[str]:
    """The control-plane main's arguments in its pod. `$(VAR)` is expanded by the kubelet from
    the container's env (the state URL comes from a Secret)."""
    args = [
        # The pod's network namespace is the isolation; the Service and the kubelet's probes
        # reach the pod's IP, `kubectl port-forward` its loopback.
        "--host=0.0.0.0",
        f"--port={CONTROL_PLANE_PORT}",
        "--state=$(PAVED_STATE_URL)",
        f"--admin-key-file={ADMIN_KEY_DIR}/{ADMIN_KEY_FILE}",
        "--driver=kubernetes",
        f"--kube-region={s.region}=in-cluster",
        f"--kube-namespace={s.replicas_namespace}",
        f"--kube-image={s.launcher_image}",
    ]
    if s.model_cache:
        args.append(f"--kube-model-cache={s.model_cache}")
    args += [
        # Given even when empty: the main's default is a GPU resource, "" means a CPU cluster.
        f"--kube-gpu-resource={s.gpu_resource}",
        f"--kube-cpu={s.replica_cpu}",
        f"--kube-memory={s.replica_memory}",
        f"--drain-timeout={float(s.drain_timeout_s)}",
        # Any gateway replica answers the batch listing (they share one database).
        f"--gateway-admin={s.gateway_url}",
        f"--gateway-admin-key-file={GATEWAY_ADMIN_KEY_DIR}/{ADMIN_KEY_FILE}",
    ]
    return args


_PROCESS_ENV = (
    {"name": "PAVED_STATE_DIR", "value": STATE_DIR},
    {"name": "HOME", "value": TMP_DIR},
    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
)
_MOUNTS = [
    {"name": "admin-key", "mountPath": ADMIN_KEY_DIR, "readOnly": True},
    {"name": "state", "mountPath": STATE_DIR},
    {"name": "tmp", "mountPath": TMP_DIR},
]


def _deployment(
    s: PlatformSettings,
    name: str,
    component: str,
    *,
    replicas: int,
    container: dict[str, Any],
    admin_key: SecretRef,
    api_token: bool,
    grace_s: int,
    extra_volumes: tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    """The Deployment of one of paved's own services: `container` on a read-only root with
    emptyDirs for its state and /tmp, its admin key mounted from a Secret, replicas spread."""
    selector = _selector(name, component)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, component, s.namespace),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": selector},
            # A new pod is up before an old one goes: the service never has no replica.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(name, component)},
                "spec": {
                    "serviceAccountName": name,
                    "automountServiceAccountToken": api_token,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": grace_s,
                    "securityContext": _pod_security(),
                    "affinity": _spread(selector),
                    "containers": [container],
                    "volumes": [
                        _admin_key_volume(admin_key),
                        {"name": "state", "emptyDir": {}},
                        {"name": "tmp", "emptyDir": {}},
                        *extra_volumes,
                    ],
                },
            },
        },
    }


def control_plane_objects(s: PlatformSettings) -> list[dict[str, Any]]:
    """Deployment (leader elected on its PostgreSQL, so every replica serves the API and one
    drives the cluster), Service and PodDisruptionBudget of the control plane."""
    component = "control-plane"
    container = {
        "name": "control-plane",
        "image": s.control_plane_image,
        "args": control_plane_args(s),
        "env": [
            _secret_env("PAVED_STATE_URL", s.control_plane_state),
            *_PROCESS_ENV,
        ],
        "ports": [{"name": "http", "containerPort": CONTROL_PLANE_PORT, "protocol": "TCP"}],
        # Connecting to PostgreSQL precedes the first answer: up to 2 minutes to come up.
        "startupProbe": _probe("/health/live", period=2, failures=60),
        "livenessProbe": _probe("/health/live", period=10, failures=3),
        # Followers are ready too: they serve the API and the routes feed from the shared store.
        "readinessProbe": _probe("/health/ready", period=5, failures=3),
        "resources": s.control_plane_resources,
        "securityContext": _container_security(),
        "volumeMounts": [
            *_MOUNTS,
            {"name": "gateway-admin-key", "mountPath": GATEWAY_ADMIN_KEY_DIR, "readOnly": True},
        ],
    }
    deployment = _deployment(
        s,
        CONTROL_PLANE,
        component,
        replicas=s.control_plane_replicas,
        container=container,
        admin_key=s.control_plane_admin_key,
        # The only paved pod that talks to the API server (in-cluster config).
        api_token=True,
        # The leader's lock is released when its PostgreSQL session ends; replicas are left
        # running for the next leader to adopt.
        grace_s=30,
        extra_volumes=(_admin_key_volume(s.gateway_admin_key, "gateway-admin-key"),),
    )
    return [
        deployment,
        _service(s, CONTROL_PLANE, component, CONTROL_PLANE_PORT, "ClusterIP"),
        _pdb(s, CONTROL_PLANE, component),
    ]


def gateway_args(s: PlatformSettings) -> list[str]:
    """The gateway main's arguments in its pod: routes from the control plane's feed (the token
    is $PAVED_ROUTES_TOKEN), keys on PostgreSQL and limits on Redis shared by every replica."""
    return [
        "--host=0.0.0.0",
        f"--port={GATEWAY_PORT}",
        f"--routes={s.control_plane_url}",
        # The last table received, served if the control plane is unreachable at start.
        f"--routes-cache={STATE_DIR}/routes.json",
        "--state=$(PAVED_STATE_URL)",
        "--redis=$(PAVED_REDIS_URL)",
        f"--admin-key-file={ADMIN_KEY_DIR}/{ADMIN_KEY_FILE}",
        f"--region={s.region}",
    ]


# How long a terminating gateway finishes what it has in flight: its main's uvicorn
# timeout_graceful_shutdown (paved.gateway.server); the grace period adds a margin to it.
GATEWAY_SHUTDOWN_S = 10
# Endpoints controllers and kube-proxies take a moment to drop a terminating pod; until then
# new connections still arrive, so SIGTERM waits this long.
GATEWAY_PRE_STOP_S = 5


def gateway_objects(s: PlatformSettings) -> list[dict[str, Any]]:
    """ServiceAccount (no token: the gateway never calls the API server), Deployment, Service
    and PodDisruptionBudget of the gateway."""
    component = "gateway"
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(GATEWAY, component, s.namespace),
        "automountServiceAccountToken": False,
    }
    container = {
        "name": "gateway",
        "image": s.gateway_image,
        "args": gateway_args(s),
        "env": [
            _secret_env("PAVED_STATE_URL", s.gateway_state),
            _secret_env("PAVED_REDIS_URL", s.gateway_redis),
            # The routes feed is behind the control plane's admin key.
            _secret_env("PAVED_ROUTES_TOKEN", s.control_plane_admin_key),
            *_PROCESS_ENV,
        ],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health/live", period=2, failures=60),
        "livenessProbe": _probe("/health/live", period=10, failures=3),
        # Not ready until the first routes table arrived: no 404s for models it has not heard of.
        "readinessProbe": _probe("/health/ready", period=2, failures=2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(GATEWAY_PRE_STOP_S)]}}},
        "resources": s.gateway_resources,
        "securityContext": _container_security(),
        "volumeMounts": _MOUNTS,
    }
    deployment = _deployment(
        s,
        GATEWAY,
        component,
        replicas=s.gateway_replicas,
        container=container,
        admin_key=s.gateway_admin_key,
        api_token=False,
        grace_s=GATEWAY_PRE_STOP_S + GATEWAY_SHUTDOWN_S + 5,
    )
    return [
        account,
        deployment,
        _service(s, GATEWAY, component, GATEWAY_PORT, s.gateway_service_type),
        _pdb(s, GATEWAY, component),
    ]


def platform_objects(s: PlatformSettings) -> list[dict[str, Any]]:
    """Everything paved itself needs on the cluster, in apply order (validates `s` first)."""
    s.validate()
    objects = [*namespace_objects(s), *control_plane_rbac(s), *control_plane_objects(s), *gateway_objects(s)]
    # No shared sub-objects: a caller may edit one object (a patch, a dry run) without another.
    # (copy.deepcopy would keep the sharing: it copies a shared dict once.)
    copied: list[dict[str, Any]] = json.loads(json.dumps(objects))
    return copied
