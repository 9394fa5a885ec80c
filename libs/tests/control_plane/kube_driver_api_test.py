"""KubeDriver called directly against a real API server (Debian's kube-apiserver 1.20 with etcd
and the controller-manager, kube_cluster.py) and no node: the ReplicaSets' pods stay Pending,
which is all the driver needs to claim, release and delete them. Covers what the API server
does to the driver when it misbehaves: a stop an outage interrupted is finished afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from kube_cluster import Cluster, kube_cluster

from paved.control_plane.driver import ReplicaRequest
from paved.control_plane.kube_driver import KubeDriver, KubeError
from paved.control_plane.kube_objects import KubeSettings
from paved.control_plane.types import Replica

IMAGE = "registry.test/paved/launcher@sha256:" + "0" * 64
WAIT_S = 60.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kube_cluster(tmp_path_factory.mktemp("k8s")) as c:
        yield c


def eventually(what: str, fn: Callable[[], T], timeout_s: float = WAIT_S) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        last = fn()
        if last or time.monotonic() > deadline:
            assert last, f"{what}: still {last!r} after {timeout_s} s"
            return last
        time.sleep(0.2)


def driver(cluster: Cluster, namespace: str, *, timeout_s: float = 10.0) -> KubeDriver:
    settings = KubeSettings(namespace=cluster.namespace(namespace), image=IMAGE, gpu_resource="")
    return KubeDriver("r1", client=cluster.api_client(), settings=settings, request_timeout_s=timeout_s)


def request(replica_id: str) -> ReplicaRequest:
    return ReplicaRequest(
        replica_id=replica_id,
        deployment_id="dep_0123456789abcdef",
        model_id="tiny",
        version="v1",
        package_uri="s3://bucket/tiny",
        region="r1",
    )


async def claimed(d: KubeDriver, r: Replica) -> Replica:
    """`r` once it holds a pod (the ReplicaSet made one, the driver annotated it)."""
    for _ in range(int(WAIT_S / 0.1)):
        r = await d.locate(r)
        if r.driver_ref and r.driver_ref.get("pod"):
            return r
        await asyncio.sleep(0.1)
    raise AssertionError(f"replica {r.id} never claimed a pod: {r.driver_ref}")


async def reason_settles(d: KubeDriver, r: Replica, want: str) -> str | None:
    """`d.exit_reason(r)` once it is `want` (the driver's watch has caught up), or the last
    answer after WAIT_S."""
    for _ in range(int(WAIT_S / 0.1)):
        if (got := await d.exit_reason(r)) == want:
            return got
        await asyncio.sleep(0.1)
    return await d.exit_reason(r)


@contextlib.contextmanager
def api_server_frozen(cluster: Cluster) -> Iterator[None]:
    """The API server stops answering (SIGSTOP) until the block ends; what it had read is served
    afterwards, as after a long GC pause or a partition that heals."""
    pid = cluster.procs["kube-apiserver"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def live_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    items = cluster.http().get(f"/api/v1/namespaces/{namespace}/pods")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def scale_of(cluster: Cluster, namespace: str, name: str) -> int:
    scale = cluster.http().get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale")
    return int(scale["spec"].get("replicas", 0))


@pytest.mark.parametrize("how", ["delete", "drain"])
def test_a_stop_an_api_outage_interrupted_is_finished_afterwards(cluster: Cluster, how: str) -> None:
    """The controller marks a replica stopped whether or not the driver's stop succeeded and
    never asks again: a stop that failed half-way (here the pod was released, so its
    ReplicaSet made a replacement, but the scale was never lowered nor the pod deleted) must
    still end with no pod and a scale of 0, not two pods running for no replica."""
    namespace = f"outage-{how}"

    async def go() -> str:
        d = driver(cluster, namespace, timeout_s=2.0)
        try:
            await d.adopt([])
            r = await claimed(d, await d.create(request("rep_a")))
            with api_server_frozen(cluster), pytest.raises(KubeError):
                if how == "delete":
                    await d.delete(r)
                else:
                    await d.drain(r, timeout_s=1.0)
            name = r.driver_ref["deployment"]
            eventually(
                "the replica's pod deleted and its Deployment scaled to 0",
                lambda: not live_pods(cluster, namespace) and scale_of(cluster, namespace, name) == 0,
            )
            return name
        finally:
            await d.close()

    asyncio.run(go())


def test_exit_reason_is_the_containers_last_termination_as_the_kubelet_reports_it(cluster: Cluster) -> None:
    """No scheduler and no node here: the test writes the pod status they would (unschedulable,
    then a launcher in a crash loop, its log tail the termination message under
    FallbackToLogsOnError) through the status subresource; the driver reads it from its watch."""
    namespace = "exit-reason"
    http = cluster.http()

    async def go() -> None:
        d = driver(cluster, namespace)
        try:
            await d.adopt([])
            r = await claimed(d, await d.create(request("rep_x")))
            assert await d.exit_reason(r) is None  # Pending: nothing of it has run
            path = f"/api/v1/namespaces/{cluster.namespace(namespace)}/pods/{r.driver_ref['pod']}/status"
            failure = "start failed: engine exited 1: no tokenizer"
            # First no node can take it (what the scheduler writes) ...
            unschedulable = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
            http.patch(path, {"status": {"phase": "Pending", "conditions": [unschedulable]}}, kind="merge")
            want = f"pod Unschedulable: {unschedulable['message']}"
            assert await reason_settles(d, r, want) == want
            # ... then it runs, and its launcher crash-loops.
            status = {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "launcher",
                        "image": IMAGE,
                        "imageID": "",
                        "ready": False,
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": f"fetching\nlauncher: {failure}\n",
                            }
                        },
                    }
                ],
            }
            http.patch(path, {"status": status}, kind="merge")
            want = f"container launcher Error (exit 1): {failure}"
            assert await reason_settles(d, r, want) == want
            assert await d.alive(r)  # a crash loop keeps the pod: the reason comes while it lives
            http.request("DELETE", path.removesuffix("/status"), query={"gracePeriodSeconds": "0"})
            for _ in range(int(WAIT_S / 0.1)):
                if not await d.alive(r):
                    break
                await asyncio.sleep(0.1)
            gone = await d.exit_reason(r)
            assert gone in (want, f"its pod {r.driver_ref['pod']} is gone"), gone
            foreign = Replica("rep_y", "d", "r1", "starting", "", "", driver_ref={"pid": 1})
            assert (await d.exit_reason(foreign) or "").startswith("not a pod of namespace")
        finally:
            await d.close()

    asyncio.run(go())
