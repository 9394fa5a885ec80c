"""`paved render`'s objects on a real Kubernetes 1.20 API server (kube_cluster): the version
kubernetes-validate has no schemas for, with its policy/v1beta1 PodDisruptionBudgets.

Every object is created with a server-side dry run and must come back with every field it was
sent (1.20 drops unknown fields silently instead of refusing them, so a field that 1.20 does not
serve shows up as missing here). The control plane's RBAC is then created for real and asked
through SubjectAccessReviews: its ServiceAccount may do each verb of each rule in the replicas'
namespace, and nothing else tried (Secrets, pod creation, other namespaces, cluster scope).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kube_cluster import Cluster, KubeError, KubeHttp, kube_cluster

from paved.control_plane import kube_platform as kp
from paved.control_plane.kube_objects import replica_objects

DIGEST = "sha256:" + "0123456789abcdef" * 4
SETTINGS = kp.PlatformSettings(
    namespace="paved",
    replica_namespace="paved-models",
    create_namespace=True,
    control_plane_image=f"registry.example:5000/paved/control_plane@{DIGEST}",
    gateway_image=f"registry.example:5000/paved/gateway@{DIGEST}",
    launcher_image=f"registry.example:5000/paved/launcher@{DIGEST}",
    model_cache="pvc:paved-models",
    kubernetes=(1, 20),
)
ACCOUNT = f"system:serviceaccount:{SETTINGS.namespace}:{kp.CONTROL_PLANE}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kube_cluster(tmp_path_factory.mktemp("apiserver")) as c:
        yield c


def _path(obj: dict[str, Any]) -> str:
    """The collection an object is created in."""
    group_version = obj["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    plural = {
        "Namespace": "namespaces",
        "ServiceAccount": "serviceaccounts",
        "Service": "services",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "Deployment": "deployments",
        "PodDisruptionBudget": "poddisruptionbudgets",
    }[obj["kind"]]
    namespace = obj["metadata"].get("namespace")
    return f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"


def _missing(sent: Any, got: Any, where: str = "") -> list[str]:
    """Where `got` lacks (or changed) something of `sent`; lists compare item by item."""
    if isinstance(sent, dict):
        if not isinstance(got, dict):
            return [f"{where}: not an object"]
        return [m for k, v in sent.items() for m in _missing(v, got.get(k), f"{where}/{k}")]
    if isinstance(sent, list):
        if not isinstance(got, list) or len(got) != len(sent):
            return [f"{where}: {got!r} for {sent!r}"]
        return [
            m for i, (a, b) in enumerate(zip(sent, got, strict=True)) for m in _missing(a, b, f"{where}/{i}")
        ]
    return [] if sent == got else [f"{where}: {got!r} for {sent!r}"]


def _create_namespaces(
    api: KubeHttp, objects: list[dict[str, Any]], cluster: Cluster
) -> list[dict[str, Any]]:
    """Creates the rendered Namespaces for real (a dry run of a namespaced object needs its
    namespace; the module's tests share the cluster, so one may exist) and returns the others."""
    for ns in (o for o in objects if o["kind"] == "Namespace"):
        try:
            got = api.request("POST", _path(ns), ns)
        except KubeError as e:
            if e.status != 409:
                raise
            got = api.get(f"{_path(ns)}/{ns['metadata']['name']}")
        assert _missing(ns, got) == []
        cluster.namespace(ns["metadata"]["name"])  # its default ServiceAccount is ready
    return [o for o in objects if o["kind"] != "Namespace"]


def test_every_object_is_accepted_whole_by_kubernetes_1_20(cluster: Cluster) -> None:
    api = cluster.http()
    version = api.get("/version")
    assert (version["major"], version["minor"].rstrip("+")) == ("1", "20")
    replicas = replica_objects(
        deployment_id="dep_0123",
        model_id="tiny",
        version="v1",
        region=SETTINGS.region,
        package_uri="s3://models/tiny.tar",
        gpus=2,
        placement={
            "node_selector": {"gpu.example/type": "h100"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
        },
        settings=SETTINGS.replica_settings(),
        pdb_api=SETTINGS.pdb_api,
    )
    objects = _create_namespaces(api, kp.platform_objects(SETTINGS) + replicas, cluster)
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 3 and {o["apiVersion"] for o in pdbs} == {"policy/v1beta1"}
    for obj in objects:
        got = api.request("POST", _path(obj), obj, query={"dryRun": "All"})
        assert got["kind"] == obj["kind"] and got["apiVersion"] == obj["apiVersion"]
        assert _missing(obj, got) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def test_a_field_1_20_does_not_serve_would_be_caught(cluster: Cluster) -> None:
    """The check above can fail: 1.20 drops a newer field (a Service's internalTrafficPolicy,
    1.21+) from what it returns, and _missing names it."""
    api = cluster.http()
    service = next(o for o in kp.platform_objects(SETTINGS) if o["kind"] == "Service")
    cluster.namespace(SETTINGS.namespace)
    newer = {**service, "spec": {**service["spec"], "internalTrafficPolicy": "Local"}}
    got = api.request("POST", _path(newer), newer, query={"dryRun": "All"})
    assert _missing(newer, got) == ["/spec/internalTrafficPolicy: None for 'Local'"]


def test_the_control_plane_may_do_exactly_its_rules(cluster: Cluster) -> None:
    api = cluster.http()
    objects = _create_namespaces(api, kp.platform_objects(SETTINGS), cluster)
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            api.request("POST", _path(obj), obj)

    def allowed(verb: str, group: str, resource: str, namespace: str | None, sub: str = "") -> bool:
        attributes = {"verb": verb, "group": group, "resource": resource}
        if sub:
            attributes["subresource"] = sub
        if namespace is not None:
            attributes["namespace"] = namespace
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": ACCOUNT,
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{SETTINGS.namespace}"],
                "resourceAttributes": attributes,
            },
        }
        got = api.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        return bool(got["status"].get("allowed"))

    replicas_ns = SETTINGS.replicas_namespace
    granted = 0
    for rule in kp.CONTROL_PLANE_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                name, _, sub = resource.partition("/")
                for verb in rule["verbs"]:
                    assert allowed(verb, group, name, replicas_ns, sub), (verb, group, resource)
                    granted += 1
    assert granted == sum(len(r["verbs"]) for r in kp.CONTROL_PLANE_RULES)
    denied = [
        ("get", "", "secrets", replicas_ns),
        ("list", "", "secrets", replicas_ns),
        ("create", "", "pods", replicas_ns),
        ("update", "", "services", replicas_ns),
        ("delete", "apps", "replicasets", replicas_ns),
        ("create", "coordination.k8s.io", "leases", replicas_ns),
        ("create", "rbac.authorization.k8s.io", "roles", replicas_ns),
        ("create", "apps", "deployments", SETTINGS.namespace),  # not where the platform runs
        ("list", "apps", "deployments", None),  # cluster-wide
        ("list", "", "nodes", None),
        ("create", "apps", "deployments", "kube-system"),
    ]
    for verb, group, resource, namespace in denied:
        assert not allowed(verb, group, resource, namespace), (verb, group, resource, namespace)
