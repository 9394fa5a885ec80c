"""The per-deployment Kubernetes objects (paved.control_plane.kube_objects) and the Kubernetes
driver's input checks, without a cluster (the API-server tier is kube_driver_test.py)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_validate import latest_version, validate

from paved.control_plane.driver import ReplicaRequest
from paved.control_plane.errors import BadRequest
from paved.control_plane.kube_driver import KubeDriver, why_not_serving
from paved.control_plane.kube_objects import (
    CACHE_MOUNT,
    LABEL_MEMBER,
    PORTS,
    KubeSettings,
    object_name,
    replica_objects,
)
from paved.control_plane.store import validate_placement
from paved.control_plane.types import Replica

IMAGE = "registry.test/paved/launcher@sha256:" + "ab" * 32


def objects(**kw):
    base = dict(
        deployment_id="dep_0123456789abcdef",
        model_id="org/Tiny-Model",
        version="v1.2",
        region="us-east",
        package_uri="s3://models/tiny.tar",
        engine="package",
        settings=KubeSettings(namespace="serving", image=IMAGE, model_cache="pvc:model-cache"),
    )
    return replica_objects(**{**base, **kw})


def test_objects_are_named_labelled_and_stable():
    deployment, service, pdb = objects()
    name = deployment["metadata"]["name"]
    assert name == object_name("dep_0123456789abcdef", "us-east") == objects()[0]["metadata"]["name"]
    assert len(name) <= 63 and name.startswith("paved-dep-0123456789abcdef-")
    assert name != object_name("dep_0123456789abcdef", "eu-west")  # one per region
    match = deployment["spec"]["selector"]["matchLabels"]
    assert match[LABEL_MEMBER] == "true"
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= match.items()
    assert service["spec"]["selector"] == match and pdb["spec"]["selector"]["matchLabels"] == match
    # A model id with a slash is not a label value: it travels as an annotation.
    assert deployment["metadata"]["annotations"]["paved.dev/model"] == "org/Tiny-Model"
    # The scale subresource owns the count: re-applying never resizes.
    assert "replicas" not in deployment["spec"]


def test_the_pod_runs_the_launcher_on_its_own_ip_with_probes_and_a_drain():
    settings = KubeSettings(namespace="serving", image=IMAGE, drain_timeout_s=45, pre_stop_s=4)
    deployment, service, _ = objects(settings=settings, kserve=True, engine="sim://org%2FTiny-Model")
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == IMAGE
    args = c["args"]
    assert args[0] == "s3://models/tiny.tar"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert args[args.index("--port") + 1] == str(PORTS["http"])
    assert args[args.index("--grpc-port") + 1] == str(PORTS["grpc"])
    assert args[args.index("--cache-dir") + 1] == CACHE_MOUNT
    assert {e["name"] for e in c["env"]} >= {"POD_IP"}
    assert {p["name"] for p in c["ports"]} == {"http", "admin", "metrics", "grpc"}
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "admin", "metrics", "grpc"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "4"]
    # A failed launcher's last lines (its failure) become the status the driver reports.
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["terminationGracePeriodSeconds"] >= 4 + 45
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["model-cache"] and "emptyDir" in volumes["metrics"]


def test_gpus_node_selectors_and_tolerations_reach_the_pod():
    settings = KubeSettings(
        namespace="serving",
        image=IMAGE,
        model_cache="host:/var/lib/paved/models",
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    )
    placement = {
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [
            {"key": "spot", "operator": "Exists", "toleration_seconds": 30, "effect": "NoExecute"}
        ],
    }
    pod = objects(settings=settings, gpus=4, placement=placement)[0]["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    keys = {t.get("key") for t in pod["tolerations"]}
    assert keys == {"dedicated", "spot", "nvidia.com/gpu"}
    assert {"key": "spot", "operator": "Exists", "tolerationSeconds": 30, "effect": "NoExecute"} in pod[
        "tolerations"
    ]
    assert pod["volumes"][0]["hostPath"] == {"path": "/var/lib/paved/models", "type": "DirectoryOrCreate"}
    # A CPU cluster requests no accelerator whatever the package says.
    cpu = objects(settings=KubeSettings(namespace="serving", image=IMAGE, gpu_resource=""), gpus=2)
    assert (
        "nvidia.com/gpu" not in cpu[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    )


@pytest.mark.parametrize("version", ["1.25.0", latest_version()])
@pytest.mark.parametrize("gpus", [0, 2])
def test_the_objects_validate_against_the_official_schemas(version, gpus):
    settings = KubeSettings(namespace="serving", image=IMAGE, model_cache="pvc:cache", tolerations=[])
    for obj in objects(settings=settings, gpus=gpus, kserve=True, placement={"node_selector": {"a": "b"}}):
        validate(obj, version, strict=True)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("image", "registry.test/paved/launcher:latest", "pinned by digest"),
        ("image", "", "pinned by digest"),
        ("namespace", "Not_A_Label", "namespace"),
        ("model_cache", "nfs:server", "model_cache"),
        ("model_cache", "host:relative", "model_cache"),
        ("drain_timeout_s", float("nan"), "drain_timeout_s"),
        ("drain_timeout_s", 0, "drain_timeout_s"),
        ("pre_stop_s", -1, "pre_stop_s"),
        ("cpu", "two", "cpu"),
        ("memory", "8 GB", "memory"),
        ("node_selector", {"bad key!": "x"}, "node_selector"),
        ("tolerations", [{"operator": "Equal"}], "empty key"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field, value, message):
    kw = {"namespace": "serving", "image": IMAGE, field: value}
    with pytest.raises(BadRequest, match=message):
        KubeSettings(**kw).validate()


@pytest.mark.parametrize(
    "placement",
    [
        [],
        {"zone": "a"},
        {"node_selector": {"k": "v" * 64}},
        {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        {"tolerations": [{"key": "k", "effect": "Sometimes"}]},
        {"tolerations": [{"key": "k", "toleration_seconds": -5}]},
        {"tolerations": [{"key": "k", "toleration_seconds": True}]},
        {"tolerations": [{"key": "k", "toleration_seconds": 30}]},
        {"tolerations": [{"key": "k", "toleration_seconds": 30, "effect": "NoSchedule"}]},
        {"tolerations": [{"key": "k", "toleration_seconds": 2**70, "effect": "NoExecute"}]},
        {"tolerations": "all"},
    ],
)
def test_a_placement_the_api_server_would_refuse_is_refused_at_registration(placement):
    with pytest.raises(BadRequest, match="placement"):
        validate_placement(placement)


def test_the_driver_refuses_foreign_replicas_and_requests():
    driver = KubeDriver("us-east", client=object(), settings=KubeSettings(namespace="serving", image=IMAGE))
    local = Replica(
        id="rep_1", deployment_id="d", region="us-east", state="ready", url="", admin_url="",
        driver_ref={"pid": 1, "start_time": 2, "ports": {}, "marker": "m"},
    )  # fmt: skip

    async def main() -> None:
        assert await driver.alive(local) is False  # not one of its pods: never "alive"
        with pytest.raises(BadRequest, match="not a pod"):
            await driver.drain(local)
        with pytest.raises(BadRequest, match="region"):
            await driver.create(
                ReplicaRequest(
                    replica_id="rep_2",
                    deployment_id="d",
                    model_id="m",
                    version="v",
                    package_uri="/p",
                    region="eu-west",
                )
            )
        with pytest.raises(BadRequest, match="gpus"):
            await driver.create(
                ReplicaRequest(
                    replica_id="rep_2",
                    deployment_id="d",
                    model_id="m",
                    version="v",
                    package_uri="/p",
                    region="us-east",
                    gpus=-1,
                )
            )

    asyncio.run(main())
    with pytest.raises(BadRequest, match="pinned by digest"):
        KubeDriver("r", client=object(), settings=KubeSettings(image="launcher:latest"))


def _pod(status: dict) -> dict:
    return {"metadata": {"name": "p", "uid": "u"}, "status": status}


def _container(**states) -> dict:
    return {"name": "launcher", "ready": False, "restartCount": 1, **states}


LOG_TAIL = (
    "engine: loading\nlauncher: engine failed: tokenizer /x not found\n"
    "Traceback (most recent call last):\n  boom\n"
)


def test_why_not_serving_names_the_launchers_failure_line_else_the_last_line():
    # A crash loop: waiting now, the last termination in lastState.
    crash = _container(
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": LOG_TAIL}},
    )
    assert why_not_serving(_pod({"phase": "Running", "containerStatuses": [crash]})) == (
        "container launcher Error (exit 1): engine failed: tokenizer /x not found"
    )
    # Ended for good (restartPolicy Never), a message without the launcher's line: its last line.
    ended = {"exitCode": 137, "reason": "OOMKilled", "message": "a\nkilled\n\n", "finishedAt": "T1"}
    oom = _container(state={"terminated": ended})
    assert why_not_serving(_pod({"phase": "Failed", "containerStatuses": [oom]})) == (
        "container launcher OOMKilled (exit 137) at T1: killed"
    )
    long = _container(state={"terminated": {"exitCode": 2, "message": "x" * 5000}})
    why = why_not_serving(_pod({"containerStatuses": [long]}))
    assert why is not None and why.startswith("container launcher terminated (exit 2): x") and len(why) < 600
    bare = _container(lastState={"terminated": {"exitCode": 1, "reason": "Error"}})
    assert why_not_serving(_pod({"containerStatuses": [bare]})) == "container launcher Error (exit 1)"
    # No container ended: the pod's own reason (an eviction), else nothing.
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."}
    assert why_not_serving(_pod(evicted)) == "pod Evicted: The node was low on memory."
    # Its containers' ends are the eviction's doing: the pod's reason comes first.
    killed = _container(state={"terminated": {"exitCode": 137, "reason": "Error"}})
    assert why_not_serving(_pod({**evicted, "containerStatuses": [killed]})) == (
        "pod Evicted: The node was low on memory."
    )
    assert why_not_serving(_pod({"phase": "Failed", "reason": "Evicted"})) == "pod Evicted"
    # A container stuck waiting (not merely starting); a pod no node can take.
    pulling = _container(
        state={"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image x"}}
    )
    assert why_not_serving(_pod({"phase": "Pending", "containerStatuses": [pulling]})) == (
        "container launcher ImagePullBackOff: Back-off pulling image x"
    )
    creating = _container(state={"waiting": {"reason": "ContainerCreating"}})
    assert why_not_serving(_pod({"phase": "Pending", "containerStatuses": [creating]})) is None
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes: gpu",
            }
        ],
    }
    assert why_not_serving(_pod(unschedulable)) == "pod Unschedulable: 0/3 nodes: gpu"
    scheduled = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    assert why_not_serving(_pod(scheduled)) is None
    running = _container(state={"running": {"startedAt": "t"}})
    assert why_not_serving(_pod({"phase": "Running", "containerStatuses": [running]})) is None
    assert why_not_serving({"metadata": {}}) is None
