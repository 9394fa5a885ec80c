"""The Kubernetes driver against a real API server (Debian's kube-apiserver 1.20 with etcd and
the controller-manager, kube_cluster.py) and a played node that runs each pod as a local
launcher on its own loopback IP: the control-plane main drives the cluster, a gateway main
routes real traffic to the pods, the official `openai` client counts failures."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fleet import (
    FAST,
    SIM,
    TrafficDriver,
    audit_messages,
    chat_burst,
    deploy,
    first_deploy,
    rollout,
    serves,
    tiny_package,
)
from kube_fleet import IMAGE, kube_fleet, kube_node

from paved.control_plane.kube_objects import LABEL_MEMBER


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with kube_node(tmp_path_factory.mktemp("k8s")) as (cluster, node):
        yield cluster, node


def _pods(api, namespace: str) -> list[dict]:
    return api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]


def _deployments(api, namespace: str) -> dict[str, dict]:
    items = api.get(f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"]
    return {d["metadata"]["annotations"]["paved.dev/version"]: d for d in items}


def _objects(api, namespace: str) -> list[str]:
    paths = (
        f"/apis/apps/v1/namespaces/{namespace}/deployments",
        f"/api/v1/namespaces/{namespace}/services",
        f"/apis/policy/v1beta1/namespaces/{namespace}/poddisruptionbudgets",
    )
    return [o["metadata"]["name"] for path in paths for o in api.get(path)["items"]]


def _live(cp, version: str | None = None) -> list[dict]:
    return [
        r
        for r in cp.replicas("tiny")
        if r["state"] in ("starting", "ready", "unhealthy") and (version is None or r["version"] == version)
    ]


def test_create_scale_and_delete_as_pods_of_a_deployment(cluster, tmp_path):
    k8s, _ = cluster
    api = k8s.http()
    with kube_fleet(k8s, tmp_path, "scale") as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key, replicas=2)
        ready = cp.wait_for(
            "two ready pods",
            lambda: rs if len(rs := [r for r in _live(cp) if r["state"] == "ready"]) == 2 else None,
        )
        urls = {r["url"] for r in ready}
        assert len(urls) == 2 and all(u.startswith("http://127.") and u.endswith(":8000") for u in urls), urls
        (deployment,) = _deployments(api, "scale").values()
        name = deployment["metadata"]["name"]
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
        assert any(
            m["manager"] == "paved" and m["operation"] == "Apply"
            for m in deployment["metadata"]["managedFields"]
        )
        # Kubernetes 1.20 has no policy/v1: the driver found that out and used v1beta1.
        pdb = api.get(f"/apis/policy/v1beta1/namespaces/scale/poddisruptionbudgets/{name}")
        assert pdb["spec"]["maxUnavailable"] == 1
        service = api.get(f"/api/v1/namespaces/scale/services/{name}")
        assert {p["name"] for p in service["spec"]["ports"]} >= {"http", "admin", "metrics"}
        claims = {
            (p["metadata"].get("annotations") or {}).get("paved.dev/replica") for p in _pods(api, "scale")
        }
        assert claims == {r["id"] for r in ready}
        assert serves(gw, key)

        # Scale 2 -> 1 through the control plane: exactly the replica it drains loses its pod.
        cp.api("PATCH", "/v1/deployments/tiny/v1", {"replicas": 1})
        cp.wait_for("one live replica", lambda: len(_live(cp)) == 1)
        (kept,) = _live(cp)

        def one_pod() -> bool:
            pods = [p for p in _pods(api, "scale") if not p["metadata"].get("deletionTimestamp")]
            return len(pods) == 1 and pods[0]["status"].get("podIP") in kept["url"]

        cp.wait_for("the drained replica's pod gone, the kept one serving", one_pod, timeout_s=60)
        scale = api.get(f"/apis/apps/v1/namespaces/scale/deployments/{name}/scale")
        assert scale["spec"]["replicas"] == 1
        assert serves(gw, key)

        # Scale to 0 (no pod, the Deployment kept at 0), then delete: its objects go.
        cp.api("PATCH", "/v1/deployments/tiny/v1", {"min_replicas": 0, "replicas": 0})
        cp.wait_for("no pod", lambda: not _pods(api, "scale"), timeout_s=60)
        assert (
            api.get(f"/apis/apps/v1/namespaces/scale/deployments/{name}/scale")["spec"].get("replicas", 0)
            == 0
        )
        cp.wait_for(
            "every replica stopped", lambda: not [r for r in cp.replicas("tiny") if r["state"] != "stopped"]
        )
        cp.api("DELETE", "/v1/deployments/tiny/v1")
        cp.wait_for(
            "its Deployment, Service and PDB deleted", lambda: not _objects(api, "scale"), timeout_s=60
        )


def test_red_black_rollout_and_rollback_with_no_failed_request(cluster, tmp_path):
    k8s, _ = cluster
    api = k8s.http()
    with kube_fleet(k8s, tmp_path, "redblack") as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key)
        deploy(cp, "v2")
        traffic = TrafficDriver(gw.url, key, "tiny", rate=6, phase="rollout").start()
        r = cp.wait_rollout(rollout(cp, "v2")["id"])
        cp.wait_for("v1's pod gone", lambda: not _live(cp, "v1") and len(_pods(api, "redblack")) == 1)
        # A version whose engine cannot start fails its health gate and is rolled back.
        deploy(cp, "v3", engine="sim://tiny?tokenizer=/nonexistent/tokenizer")
        back = cp.wait_rollout(rollout(cp, "v3")["id"])
        time.sleep(1)
        traffic.stop()
        assert r["status"] == "succeeded", (r, audit_messages(cp, r["id"]))
        assert back["status"] == "rolled_back", (back, audit_messages(cp, back["id"]))
        assert traffic.failures() == [], traffic.failures()[:5]
        assert len(traffic.results) > 20
        cp.wait_for("v3's pods gone", lambda: not [p for p in _pods(api, "redblack") if _version(p) == "v3"])
        deployments = _deployments(api, "redblack")
        assert {v: d["spec"].get("replicas", 0) for v, d in deployments.items()} == {
            "v1": 0,
            "v2": 1,
            "v3": 0,
        }


def _version(pod: dict) -> str:
    return (pod["metadata"].get("annotations") or {}).get("paved.dev/version", "")


def test_control_plane_killed_mid_rollout_adopts_its_pods(cluster, tmp_path):
    k8s, _ = cluster
    api = k8s.http()
    with kube_fleet(k8s, tmp_path, "restart") as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key)
        deploy(cp, "v2")
        traffic = TrafficDriver(gw.url, key, "tiny", rate=5).start()
        started = rollout(cp, "v2", interval_s=4)
        cp.wait_for(
            "the rollout's first shift",
            lambda: cp.api("GET", f"/v1/rollouts/{started['id']}")["phase"].startswith(("shift", "analysis")),
        )
        before = {p["metadata"]["uid"] for p in _pods(api, "restart")}
        cp.kill()  # a crash: the pods keep serving, the gateway keeps its routes
        time.sleep(2)
        cp.start()
        r = cp.wait_rollout(started["id"])
        traffic.stop()
        assert r["status"] == "succeeded", (r, audit_messages(cp, r["id"]))
        assert traffic.failures() == [], traffic.failures()[:5]
        kinds = [e["kind"] for e in cp.api("GET", "/v1/audit?limit=1000")["data"]]
        assert "replica.adopted" in kinds

        # No orphans: the one pod left is v2's, one of those running before the crash (adopted,
        # not replaced), and it is a member of its Deployment.
        def settled() -> list[dict]:
            pods = [p for p in _pods(api, "restart") if not p["metadata"].get("deletionTimestamp")]
            return pods if len(pods) == 1 and len(_live(cp)) == 1 else []

        (pod,) = cp.wait_for("one pod left", settled, timeout_s=90)
        assert pod["metadata"]["uid"] in before and _version(pod) == "v2"
        assert pod["metadata"]["labels"][LABEL_MEMBER] == "true"
        assert serves(gw, key)


def test_a_pod_deleted_behind_the_driver_is_replaced(cluster, tmp_path):
    """Someone deletes a serving pod by hand (or a node drains it): the replica is no longer
    alive, the control plane replaces it, traffic keeps flowing."""
    k8s, _ = cluster
    api = k8s.http()
    with kube_fleet(k8s, tmp_path, "replace") as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key)
        (before,) = _live(cp)
        (pod,) = _pods(api, "replace")
        api.request(
            "DELETE", f"/api/v1/namespaces/replace/pods/{pod['metadata']['name']}", {"gracePeriodSeconds": 5}
        )
        cp.wait_for(
            "a new ready replica",
            lambda: [r for r in _live(cp) if r["state"] == "ready" and r["id"] != before["id"]],
            timeout_s=120,
        )
        assert httpx.get(gw.url + "/health/ready", timeout=10).status_code in (200, 404)
        cp.wait_for("serving again", lambda: serves(gw, key), timeout_s=60)


def test_scale_to_zero_and_back_on_the_cluster(cluster, tmp_path):
    """An idle model's Deployment goes to 0 pods; a burst through the gateway is held, wakes it
    (the control plane scales the Deployment 0 -> 1), and every request is answered."""
    k8s, _ = cluster
    api = k8s.http()
    with kube_fleet(k8s, tmp_path, "zero") as make:
        cp, gw, key = make()
        cp.api(
            "POST",
            "/v1/deployments",
            {
                "model_id": "tiny",
                "version": "v1",
                "package_uri": tiny_package(),
                "engine": SIM,
                "min_replicas": 0,
                "replicas": 1,
                "autoscale": {"enabled": True, "scale_to_zero_after_s": 2},
            },
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded"
        cp.wait_for("no pod left", lambda: not _pods(api, "zero"), timeout_s=90)
        (deployment,) = _deployments(api, "zero").values()
        assert deployment["spec"].get("replicas", 0) == 0

        assert [status for status, _ in asyncio.run(chat_burst(gw.url, key, 12))] == [200] * 12
        pods = [p for p in _pods(api, "zero") if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1
        kinds = [e["kind"] for e in cp.api("GET", "/v1/audit?model_id=tiny&limit=1000")["data"]]
        assert "scale" in kinds
