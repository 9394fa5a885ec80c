"""The API-server tier's fixture itself: etcd + kube-apiserver + kube-controller-manager on
loopback (kube_cluster) and the played node. A Deployment of a tiny python HTTP server gets its
pods bound, started on distinct loopback IPs and reported Ready through its readinessProbe;
scaling through the scale subresource deletes one pod gracefully (preStop ran, process gone,
the final delete is the node's); a pod the node cannot take stays Pending with the scheduler's
reason; an exited process is restarted; server-side apply answers; nothing outlives a node."""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client as k8s
import pytest
from kube_cluster import (
    NODE_MARK,
    Cluster,
    KubeError,
    PlayedNode,
    expand_vars,
    kube_cluster,
    played_node,
)

from paved.procs import marked_processes

T = TypeVar("T")
WAIT_S = 90.0


def test_expand_vars_as_kubernetes() -> None:
    env = {"VAR": "val", "B": "$(VAR)", "EMPTY": ""}
    cases = {
        "$(VAR)": "val",
        "x-$(VAR)-$(VAR)": "x-val-val",
        "$$(VAR)": "$(VAR)",
        "$$$(VAR)": "$val",
        "$(UNKNOWN)": "$(UNKNOWN)",
        "$(VAR": "$(VAR",
        "$$": "$",
        "$x$": "$x$",
        "$(B)": "$(VAR)",  # one level only: values are not expanded again
        "a$(EMPTY)b": "ab",
        "": "",
    }
    for text, want in cases.items():
        assert expand_vars(text, env) == want, text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kube_cluster(tmp_path_factory.mktemp("k8s")) as c:
        yield c
    assert not any(p.alive() for p in c.procs.values())
    assert not (c.root / "state").exists()


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[PlayedNode]:
    images = {"registry.local/web": ["python", "-m", "http.server"]}
    with played_node(cluster, labels={"pool": "cpu"}, images=images) as n:
        yield n
    assert n.processes() == {}


def eventually(what: str, fn: Callable[[], T | None], node: PlayedNode, timeout_s: float = WAIT_S) -> T:
    """fn()'s first truthy value; fails naming `what` with the node's log if none comes."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(
        f"{what}: last {last!r}\n--- node log:\n{node.log_tail()}\n{node.cluster.logs_tail(1500)}"
    )


def http_get(ip: str, port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(ip, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def pods(cluster: Cluster, ns: str, selector: str = "") -> list[dict[str, Any]]:
    query = {"labelSelector": selector} if selector else None
    return list(cluster.http().get(f"/api/v1/namespaces/{ns}/pods", query=query)["items"])


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in pod["status"].get("conditions") or [] if c["type"] == kind), {})


def web_deployment(marks: Path) -> dict[str, Any]:
    # The init container writes into the emptyDir that the server then serves: init order,
    # emptyDir paths, fieldRef env and $(VAR) expansion are all visible in one GET.
    write = "import os, sys; open(sys.argv[1], 'w').write(os.environ['POD_NAME'])"
    mark = "import os, sys; open(os.path.join(sys.argv[1], os.environ['POD_NAME']), 'w').close()"
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {"pool": "cpu"},
                    "terminationGracePeriodSeconds": 20,
                    "volumes": [
                        {"name": "data", "emptyDir": {}},
                        {"name": "marks", "hostPath": {"path": str(marks)}},
                    ],
                    "initContainers": [
                        {
                            "name": "seed",
                            "image": "python:3",
                            "command": ["python", "-c", write, "/data/hello.txt"],
                            "env": env,
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ],
                    "containers": [
                        {
                            "name": "server",
                            "image": "registry.local/web:1@sha256:" + "0" * 64,
                            "args": ["--bind", "$(POD_IP)", "--directory", "/data", "8080"],
                            "env": env,
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"port": "http", "path": "/hello.txt"},
                                "periodSeconds": 1,
                            },
                            "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", mark, "/marks"]}}},
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/data"},
                                {"name": "marks", "mountPath": "/marks"},
                            ],
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                        }
                    ],
                },
            },
        },
    }


def test_deployment_ready_then_scaled_down_gracefully(
    cluster: Cluster, node: PlayedNode, marks: Path
) -> None:
    ns = cluster.namespace("web")
    with cluster.api_client() as client:
        apps = k8s.AppsV1Api(client)
        deployment = k8s.V1Deployment.from_dict(web_deployment(marks))
        assert deployment is not None
        apps.create_namespaced_deployment(ns, deployment)

        def two_ready() -> list[dict[str, Any]] | None:
            dep = cluster.http().get(f"/apis/apps/v1/namespaces/{ns}/deployments/web")
            return pods(cluster, ns, "app=web") if dep["status"].get("readyReplicas") == 2 else None

        ready = eventually("2 ready replicas", two_ready, node)
        assert len(ready) == 2
        ips = {p["status"]["podIP"] for p in ready}
        assert len(ips) == 2
        for pod in ready:
            assert pod["spec"]["nodeName"] == "node-1"
            assert pod["status"]["phase"] == "Running"
            assert pod["status"]["hostIP"] == node.host_ip
            assert pod["status"]["podIP"].startswith("127.")
            assert condition(pod, "Ready")["status"] == "True"
            assert condition(pod, "PodScheduled")["status"] == "True"
            assert pod["status"]["containerStatuses"][0]["ready"] is True
            assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
            # The server bound the pod's own address; the init container wrote the name.
            assert http_get(pod["status"]["podIP"], 8080, "/hello.txt") == (
                200,
                pod["metadata"]["name"].encode(),
            )

        apps.patch_namespaced_deployment_scale("web", ns, {"spec": {"replicas": 1}})
        left = eventually(
            "one pod left", lambda: (lambda ps: ps if len(ps) == 1 else None)(pods(cluster, ns)), node
        )
    gone = next(p for p in ready if p["metadata"]["name"] != left[0]["metadata"]["name"])
    gone_name, gone_ip = gone["metadata"]["name"], gone["status"]["podIP"]
    assert (marks / gone_name).exists(), "preStop did not run"
    assert not (marks / left[0]["metadata"]["name"]).exists()
    assert not [cmd for cmd in node.processes().values() if gone_ip in cmd]
    with pytest.raises(ConnectionRefusedError):
        http_get(gone_ip, 8080, "/hello.txt")
    assert http_get(left[0]["status"]["podIP"], 8080, "/hello.txt")[0] == 200
    assert "terminated and deleted" in node.log_tail(20000)


def test_pod_that_does_not_fit_stays_pending(cluster: Cluster, node: PlayedNode) -> None:
    ns = cluster.namespace("pending")
    api = cluster.http()
    base = {"name": "c", "image": "none", "command": ["python", "-c", "pass"]}
    gpu = dict(base, resources={"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}})
    cases = {
        "wrong-pool": ({"nodeSelector": {"pool": "gpu"}, "containers": [base]}, "didn't match node selector"),
        "gpu": ({"containers": [gpu]}, "Insufficient nvidia.com/gpu"),
    }
    for name, (spec, _) in cases.items():
        api.request("POST", f"/api/v1/namespaces/{ns}/pods", {"metadata": {"name": name}, "spec": spec})
    for name, (_, reason) in cases.items():

        def unschedulable(name: str = name) -> dict[str, Any] | None:
            pod = api.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            return pod if condition(pod, "PodScheduled").get("reason") == "Unschedulable" else None

        pod = eventually(f"{name} marked Unschedulable", unschedulable, node)
        assert reason in condition(pod, "PodScheduled")["message"]
        assert pod["status"]["phase"] == "Pending"
        assert not pod["spec"].get("nodeName")


def test_exited_process_is_restarted(cluster: Cluster, node: PlayedNode) -> None:
    ns = cluster.namespace("restart")
    # Exits 3 on its first run (the emptyDir outlives the container, as in a pod), then stays.
    script = (
        "import os, sys, time\n"
        "flag = os.path.join(sys.argv[1], 'ran')\n"
        "if not os.path.exists(flag):\n"
        "    open(flag, 'w').close(); sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    body = {
        "metadata": {"name": "flaky"},
        "spec": {
            "volumes": [{"name": "state", "emptyDir": {}}],
            "containers": [
                {
                    "name": "c",
                    "image": "python:3",
                    "command": ["python", "-c", script, "/state"],
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                }
            ],
        },
    }
    cluster.http().request("POST", f"/api/v1/namespaces/{ns}/pods", body)

    def restarted_and_ready() -> dict[str, Any] | None:
        pod = cluster.http().get(f"/api/v1/namespaces/{ns}/pods/flaky")
        statuses = pod["status"].get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount") == 1 and statuses[0].get("ready") else None

    pod = eventually("flaky restarted once and ready", restarted_and_ready, node)
    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert "running" in status["state"]
    assert pod["status"]["phase"] == "Running"


def test_startup_probe_gates_readiness_which_follows_its_probe(
    cluster: Cluster, node: PlayedNode, tmp_path: Path
) -> None:
    ns = cluster.namespace("probes")
    api = cluster.http()
    (tmp_path / "ok").write_text("ok")
    # Each startup probe leaves a line, so the test knows it ran (and failed) a few times.
    probe = (
        "import os, sys; open(sys.argv[1] + '/tries', 'a').write('x'); "
        "sys.exit(0 if os.path.exists(sys.argv[1] + '/started') else 1)"
    )
    body = {
        "metadata": {"name": "gated"},
        "spec": {
            "volumes": [{"name": "state", "hostPath": {"path": str(tmp_path)}}],
            "containers": [
                {
                    "name": "c",
                    "image": "python:3",
                    "command": [
                        "python",
                        "-m",
                        "http.server",
                        "--bind",
                        "$(IP)",
                        "--directory",
                        "/state",
                        "8080",
                    ],
                    "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                    "startupProbe": {
                        "exec": {"command": ["python", "-c", probe, "/state"]},
                        "periodSeconds": 1,
                        "failureThreshold": 1000,
                    },
                    "readinessProbe": {
                        "httpGet": {"port": 8080, "path": "/ok"},
                        "periodSeconds": 1,
                        "failureThreshold": 1,
                    },
                }
            ],
        },
    }
    api.request("POST", f"/api/v1/namespaces/{ns}/pods", body)
    tries = tmp_path / "tries"
    eventually("3 failed startup probes", lambda: tries.exists() and len(tries.read_text()) >= 3, node)

    def status() -> dict[str, Any]:
        pod = api.get(f"/api/v1/namespaces/{ns}/pods/gated")
        return dict((pod["status"].get("containerStatuses") or [{}])[0], podReady=condition(pod, "Ready"))

    # /ok answers 200 all along: only the startup probe keeps the pod from being Ready.
    assert status()["started"] is False
    assert status()["podReady"]["status"] == "False"
    assert http_get(api.get(f"/api/v1/namespaces/{ns}/pods/gated")["status"]["podIP"], 8080, "/ok")[0] == 200
    (tmp_path / "started").write_text("")
    eventually(
        "started and Ready",
        lambda: (lambda st: st["started"] and st["podReady"]["status"] == "True")(status()),
        node,
    )
    # Readiness keeps following its probe (failureThreshold 1); the container is not restarted.
    (tmp_path / "ok").unlink()
    eventually("not Ready once /ok is gone", lambda: status()["podReady"]["status"] == "False", node)
    assert status()["restartCount"] == 0
    assert status()["ready"] is False


def test_liveness_failure_kills_at_grace_end_and_restarts(cluster: Cluster, node: PlayedNode) -> None:
    ns = cluster.namespace("liveness")
    api = cluster.http()
    api.request(
        "POST",
        f"/api/v1/namespaces/{ns}/configmaps",
        {"metadata": {"name": "conf"}, "data": {"greeting": "hi"}},
    )
    # Ignores SIGTERM, so only the SIGKILL at the end of the grace period ends it (exit 137).
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print(os.environ['GREETING'], open(sys.argv[1]).read(), flush=True)\n"
        "time.sleep(600)\n"
    )
    body = {
        "metadata": {"name": "stubborn"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "conf", "configMap": {"name": "conf"}}],
            "containers": [
                {
                    "name": "c",
                    "image": "python:3",
                    "command": ["python", "-c", script, "/conf/greeting"],
                    "env": [
                        {
                            "name": "GREETING",
                            "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "greeting"}},
                        }
                    ],
                    "volumeMounts": [{"name": "conf", "mountPath": "/conf"}],
                    # Nothing listens on the pod's port 9: the probe fails.
                    "livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2},
                }
            ],
        },
    }
    api.request("POST", f"/api/v1/namespaces/{ns}/pods", body)

    def killed_once() -> dict[str, Any] | None:
        pod = api.get(f"/api/v1/namespaces/{ns}/pods/stubborn")
        status = (pod["status"].get("containerStatuses") or [{}])[0]
        return status if status.get("restartCount", 0) >= 1 else None

    status = eventually("stubborn killed by its liveness probe", killed_once, node)
    assert status["lastState"]["terminated"]["exitCode"] == 137
    assert "hi hi" in node.log_path(ns, "stubborn", "c").read_text()
    api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/stubborn")

    def deleted() -> bool:
        try:
            api.get(f"/api/v1/namespaces/{ns}/pods/stubborn")
        except KubeError as e:
            return e.status == 404
        return False

    eventually("stubborn deleted by the node", deleted, node)
    assert not [cmd for cmd in node.processes().values() if "SIG_IGN" in cmd]


def test_server_side_apply(cluster: Cluster) -> None:
    ns = cluster.namespace("apply")
    with cluster.api_client() as client:
        core = k8s.CoreV1Api(client)
        for value in ("1", "2"):
            manifest = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "cfg"},
                "data": {"v": value},
            }
            core.patch_namespaced_config_map(
                "cfg", ns, manifest, field_manager="paved", _content_type="application/apply-patch+yaml"
            )
    cm = cluster.http().get(f"/api/v1/namespaces/{ns}/configmaps/cfg")
    assert cm["data"] == {"v": "2"}
    assert [(m["manager"], m["operation"]) for m in cm["metadata"]["managedFields"]] == [("paved", "Apply")]
    # Another manager changing a field "paved" owns is a conflict, as for a real cluster.
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"v": "3"}}
    with pytest.raises(KubeError) as conflict:
        cluster.http().request(
            "PATCH",
            f"/api/v1/namespaces/{ns}/configmaps/cfg",
            other,
            query={"fieldManager": "someone-else"},
            content_type="application/apply-patch+yaml",
        )
    assert conflict.value.status == 409


def test_tainted_node_and_cleanup_leave_no_process(cluster: Cluster, node: PlayedNode) -> None:
    ns = cluster.namespace("tainted")
    # The container's child starts a session of its own (as the launcher's engines do): only
    # the marker finds it once the node stops.
    spawn = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    taint = {"key": "dedicated", "value": "test", "effect": "NoSchedule"}
    with played_node(cluster, name="node-2", labels={"pool": "tainted"}, taints=[taint]) as node2:
        spec = {
            "nodeSelector": {"pool": "tainted"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "test", "effect": "NoSchedule"}
            ],
            "containers": [{"name": "c", "image": "python:3", "command": ["python", "-c", spawn]}],
        }
        cluster.http().request(
            "POST", f"/api/v1/namespaces/{ns}/pods", {"metadata": {"name": "p"}, "spec": spec}
        )

        def two_processes() -> dict[int, str] | None:
            procs = node2.processes()
            return procs if len(procs) == 2 else None

        eventually("the pod's process and its child", two_processes, node2)
        pod = cluster.http().get(f"/api/v1/namespaces/{ns}/pods/p")
        assert pod["spec"]["nodeName"] == "node-2"
        assert pod["status"]["podIP"].split(".")[1] == node2.host_ip.split(".")[1]
        node_obj = cluster.http().get("/api/v1/nodes/node-2")
        assert node_obj["spec"]["taints"] == [taint]
        assert condition(node_obj, "Ready")["status"] == "True"
    assert marked_processes(NODE_MARK, node2.id) == {}
