"""Replicas as pods of a Kubernetes Deployment, one Deployment (+ Service + PodDisruptionBudget,
paved.control_plane.kube_objects) per (deployment, region), applied server-side with field
manager "paved" and sized through the `scale` subresource.

How a paved replica maps to a pod (the Driver protocol is per replica; a Deployment is not):
- `create` applies the objects, adds the replica to the Deployment's members and sets the scale
  to the member count. The replica starts with no address.
- `locate` claims a pod for a replica that has none: the oldest serving pod of its Deployment
  that no replica holds, annotated `paved.dev/replica=<id>` with a resourceVersion precondition
  (two claimers never get one pod). Once the pod has an IP the replica's urls are the pod's.
- `alive` is true while the claimed pod (same uid) exists, is not being deleted and has not
  failed; before a claim, while the replica is a member of an existing Deployment.
- `drain` takes exactly its pod out: the pod's `paved.dev/member` label becomes "released" (the
  ReplicaSet lets go of it and the Service stops selecting it), the scale drops by one (the
  ReplicaSet's replacement for the released pod is the newest and unassigned, so the one it
  deletes), then the pod is deleted with a grace period of preStop + the drain timeout: the
  kubelet runs preStop, SIGTERMs the launcher (which drains) and kills what is left at the end.
- A stop (`drain`, `delete`) an API failure interrupted raises, and a background thread
  finishes it: the controller counts the replica as stopped either way and never asks again.
- `adopt` rebuilds the members from the store's replicas and the pods' claims, sets every
  Deployment's scale to its member count (level-triggered: drift from a crash is corrected), and
  deletes pods a crash left released or claimed by a replica the store no longer runs.

State comes from a watch on the namespace's paved pods (list, then watch from its
resourceVersion, relist on 410 Gone), never from polling loops. Every API call has a deadline.
Kubernetes 1.20 is the oldest server supported (server-side apply is beta there, and
PodDisruptionBudget is policy/v1beta1 before 1.21: detected at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from dataclasses import replace
from typing import Any

from paved.control_plane.driver import ReplicaRequest, launcher_failure
from paved.control_plane.errors import BadRequest, ControlError
from paved.control_plane.kube_objects import (
    ANNOTATION_REPLICA,
    LABEL_MEMBER,
    LABEL_REGION,
    MANAGED_BY,
    PORTS,
    KubeSettings,
    label_value,
    object_name,
    replica_objects,
)
from paved.control_plane.types import Replica

log = logging.getLogger(__name__)

FIELD_MANAGER = "paved"
_PLURALS = {"Deployment": "deployments", "Service": "services", "PodDisruptionBudget": "poddisruptionbudgets"}
_WATCH_S = 50  # a watch is renewed this often (the server closes idle ones anyway)
_SCALE_RETRIES = 8  # optimistic-concurrency retries of one scale update
_REAP_S = 5.0  # how often a stop an API failure interrupted is tried again
_REASON_CHARS = 500  # of a termination message in an audit reason (the kubelet keeps 4 KiB)
# A container waiting for these is starting as it should, not stuck.
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})


class KubeError(ControlError):
    """The API server refused or could not be reached (the message names the call)."""

    def __init__(self, message: str):
        super().__init__(503, message, code="kubernetes_unavailable", headers={"Retry-After": "5"})


def api_client(*, context: str | None = None, kubeconfig: str | None = None) -> Any:
    """An ApiClient for a kube context (from `kubeconfig` or the default file), or the pod's
    in-cluster config when context is "in-cluster"."""
    from kubernetes import client, config

    if context == "in-cluster":
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    try:
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    except Exception as e:  # noqa: BLE001 - the client raises several types for a bad file or context
        raise BadRequest(f"kube context {context!r} from {kubeconfig or '~/.kube/config'}: {e}") from None


class KubeDriver:
    """The `Driver` of one region on one cluster (see paved.control_plane.driver)."""

    def __init__(self, region: str, *, client: Any, settings: KubeSettings, request_timeout_s: float = 10.0):
        if not isinstance(region, str) or not region:
            raise BadRequest("region must be a non-empty string")
        if not (isinstance(request_timeout_s, int | float) and 0 < request_timeout_s <= 120):
            raise BadRequest(f"request_timeout_s must be in (0, 120], got {request_timeout_s!r}")
        self.region = region
        self.settings = settings.validate()
        self.namespace = settings.namespace
        self.timeout_s = float(request_timeout_s)
        self._api = client
        # Only this region's objects: regions may share a namespace, and adopt scales whatever
        # it lists to its member count.
        self._selector = f"app.kubernetes.io/managed-by={MANAGED_BY},{LABEL_REGION}={label_value(region)}"
        self._lock = threading.Lock()  # guards everything below (watch thread + worker threads)
        self._pods: dict[str, dict[str, Any]] = {}  # pod name -> pod (as the API serves it)
        self._members: dict[str, set[str]] = {}  # Deployment name -> replica ids
        self._claims: dict[str, str] = {}  # pod name -> replica id (ours, before the watch says so)
        self._synced = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._pdb_api: str | None = None
        self._watcher: threading.Thread | None = None
        # Stops an API failure interrupted: replica id -> (its ref, the drain's timeout). The
        # controller never asks twice (the replica is stopped in its store whatever happens
        # here), so the reaper thread finishes them; left alone, the pod would keep running,
        # and holding its node's GPUs, until the next control plane adopts.
        self._unfinished: dict[str, tuple[dict[str, Any], float | None]] = {}
        self._reaper: threading.Thread | None = None
        self._raw: Any = None  # the watch's open response (close() shuts it to end the watch)

    # -- REST ----------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (200, 201),
    ) -> tuple[int, Any]:
        """(status, decoded body); KubeError when the status is not in `ok` (or the call fails)."""
        try:
            m, url, headers, data, post = self._api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(m, url, headers, data, post, _request_timeout=self.timeout_s)
            response.read()
            status = response.status
            decoded = json.loads(response.data) if response.data else None
        except Exception as e:  # noqa: BLE001 - urllib3 and the client raise many types; all mean "unreachable"
            raise KubeError(f"{method} {path}: {type(e).__name__}: {e}") from None
        if status not in ok:
            message = decoded.get("message") if isinstance(decoded, dict) else None
            raise KubeError(f"{method} {path}: {status} {message or ''}".rstrip())
        return status, decoded

    def _ns_path(self, api_version: str, plural: str, name: str = "") -> str:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        return f"{base}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else "")

    def _pdb(self) -> str:
        if self._pdb_api is None:
            status, _ = self._request("GET", "/apis/policy/v1", ok=(200, 404))
            self._pdb_api = "policy/v1" if status == 200 else "policy/v1beta1"
        return self._pdb_api

    def _apply(self, obj: dict[str, Any]) -> None:
        path = self._ns_path(obj["apiVersion"], _PLURALS[obj["kind"]], obj["metadata"]["name"])
        self._request(
            "PATCH",
            path,
            body=obj,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def _set_scale(self, name: str) -> None:
        """Scale Deployment `name` to its member count (read, then replace with the read's
        resourceVersion; a concurrent writer makes it retry)."""
        path = self._ns_path("apps/v1", "deployments", name) + "/scale"
        for _ in range(_SCALE_RETRIES):
            with self._lock:
                want = len(self._members.get(name, ()))
            status, scale = self._request("GET", path, ok=(200, 404))
            if status == 404:
                return  # deleted by someone else: nothing runs
            if scale["spec"].get("replicas", 0) == want:
                return
            scale["spec"]["replicas"] = want
            status, _ = self._request("PUT", path, body=scale, ok=(200, 409))
            if status == 200:
                return
        raise KubeError(f"scale of deployment {name}: {_SCALE_RETRIES} conflicting updates in a row")

    # -- the pod watch -------------------------------------------------------------------------
    def _start(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"kube-watch-{self.region}", daemon=True
            )
            self._watcher.start()
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name=f"kube-reap-{self.region}", daemon=True)
            self._reaper.start()
        if not self._synced.wait(self.timeout_s * 3):
            raise KubeError(f"could not list pods in namespace {self.namespace} (region {self.region})")

    def _relist(self) -> str:
        _, listing = self._request(
            "GET", self._ns_path("v1", "pods"), query=[("labelSelector", self._selector)]
        )
        with self._changed:
            self._pods = {p["metadata"]["name"]: p for p in listing.get("items", [])}
            self._changed.notify_all()
        self._synced.set()
        return str(listing["metadata"]["resourceVersion"])

    def _watch(self) -> None:
        delay = 0.2
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._follow(version)
                delay = 0.2
            except Exception as e:  # noqa: BLE001 - a broken watch is retried from a fresh list
                if self._stop.is_set():
                    return
                log.warning("region %s: pod watch failed (%s); relisting", self.region, e)
                version = None
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)

    def _follow(self, version: str) -> str | None:
        """Apply watch events from `version` until the server ends the watch; the version to
        continue from, or None when it expired (410: relist)."""
        m, url, headers, _, _ = self._api.param_serialize(
            method="GET",
            resource_path=self._ns_path("v1", "pods"),
            query_params=[
                ("labelSelector", self._selector),
                ("watch", "true"),
                ("resourceVersion", version),
                ("timeoutSeconds", str(_WATCH_S)),
                ("allowWatchBookmarks", "true"),
            ],
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self._api.rest_client.request(
            m, url, headers=headers, _request_timeout=(self.timeout_s, _WATCH_S + self.timeout_s)
        )
        raw = response.response
        self._raw = raw
        try:
            if raw.status != 200:
                raise KubeError(f"watch pods: {raw.status}")
            buffer = b""
            for chunk in raw.stream(64 * 1024, decode_content=True):
                if self._stop.is_set():
                    return version
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise KubeError(f"watch pods: {obj.get('message')}")
                    version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    with self._changed:
                        if kind == "DELETED":
                            self._pods.pop(name, None)
                            self._claims.pop(name, None)
                        else:
                            self._pods[name] = obj
                        self._changed.notify_all()
        finally:
            raw.release_conn()
        return version

    # -- refs ----------------------------------------------------------------------------------
    def _ref(self, replica: Replica) -> dict[str, Any]:
        ref = replica.driver_ref or {}
        if (
            ref.get("kind") != "kubernetes"
            or ref.get("namespace") != self.namespace
            or not ref.get("deployment")
        ):
            raise BadRequest(
                f"replica {replica.id} is not a pod of namespace {self.namespace} (driver_ref {ref})"
            )
        return ref

    @staticmethod
    def _serving(pod: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        return (
            not meta.get("deletionTimestamp")
            and (meta.get("labels") or {}).get(LABEL_MEMBER) == "true"
            and (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded")
        )

    def _holder(self, pod: dict[str, Any]) -> str | None:
        name = pod["metadata"]["name"]
        return self._claims.get(name) or (pod["metadata"].get("annotations") or {}).get(ANNOTATION_REPLICA)

    def _pods_of(self, deployment: str) -> list[dict[str, Any]]:
        """The pods of one of our Deployments (its ReplicaSets' pods carry its selector labels,
        the object name is their generateName's prefix)."""
        return [p for p in self._pods.values() if p["metadata"]["name"].startswith(deployment + "-")]

    # -- create --------------------------------------------------------------------------------
    async def create(self, req: ReplicaRequest) -> Replica:
        req.validate()
        if req.region != self.region:
            raise BadRequest(
                f"replica {req.replica_id} is for region {req.region!r}, this driver runs {self.region!r}"
            )
        return await asyncio.to_thread(self._create, req)

    def _create(self, req: ReplicaRequest) -> Replica:
        self._start()
        objects = replica_objects(
            deployment_id=req.deployment_id,
            model_id=req.model_id,
            version=req.version,
            region=req.region,
            package_uri=req.package_uri,
            engine=req.engine,
            kserve=req.kserve,
            kind=req.kind,
            gpus=req.gpus,
            placement=req.placement,
            settings=self.settings,
            pdb_api=self._pdb(),
        )
        name = objects[0]["metadata"]["name"]
        for obj in objects:
            self._apply(obj)
        with self._lock:
            self._members.setdefault(name, set()).add(req.replica_id)
        try:
            self._set_scale(name)
        except BaseException:
            with self._lock:
                self._members[name].discard(req.replica_id)
            raise
        log.info(
            "replica %s (%s@%s): a pod of deployment %s/%s",
            req.replica_id,
            req.model_id,
            req.version,
            self.namespace,
            name,
        )
        return Replica(
            id=req.replica_id,
            deployment_id=req.deployment_id,
            region=self.region,
            state="starting",
            url="",
            admin_url="",
            driver_ref={
                "kind": "kubernetes",
                "namespace": self.namespace,
                "deployment": name,
                "pod": None,
                "uid": None,
                "kserve": req.kserve,
                "kserve_http": req.kind == "kserve" or req.kserve,
            },
        )

    # -- locate --------------------------------------------------------------------------------
    async def locate(self, replica: Replica) -> Replica:
        ref = self._ref(replica)
        return await asyncio.to_thread(self._locate, replica, ref)

    def _locate(self, replica: Replica, ref: dict[str, Any]) -> Replica:
        self._start()
        if not ref.get("pod"):
            claimed = self._claim(replica.id, ref["deployment"])
            if claimed is None:
                return replica
            ref = {**ref, "pod": claimed["metadata"]["name"], "uid": claimed["metadata"]["uid"]}
            replica = replace(replica, driver_ref=ref)
        with self._lock:
            pod = self._pods.get(ref["pod"])
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if not ip or replica.admin_url:
            return replica
        http = f"http://{ip}:{PORTS['http']}"
        return replace(
            replica,
            url=http,
            admin_url=f"http://{ip}:{PORTS['admin']}",
            kserve_grpc=f"{ip}:{PORTS['grpc']}" if ref.get("kserve") else None,
            kserve_http=http if ref.get("kserve_http") else None,
            metrics_url=f"http://{ip}:{PORTS['metrics']}/metrics",
        )

    def _claim(self, replica_id: str, deployment: str) -> dict[str, Any] | None:
        """Annotate the oldest unclaimed serving pod of `deployment` as `replica_id`'s; None
        when there is none yet (the ReplicaSet has not made it) or another claimer won."""
        with self._lock:
            mine = [p for p in self._pods_of(deployment) if self._holder(p) == replica_id]
            if mine:
                return mine[0]
            free = sorted(
                (p for p in self._pods_of(deployment) if self._serving(p) and self._holder(p) is None),
                key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]),
            )
            if not free:
                return None
            pod = free[0]
            self._claims[pod["metadata"]["name"]] = replica_id
        meta = pod["metadata"]
        patch = {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "annotations": {ANNOTATION_REPLICA: replica_id},
            }
        }
        try:
            status, updated = self._request(
                "PATCH",
                self._ns_path("v1", "pods", meta["name"]),
                body=patch,
                content_type="application/merge-patch+json",
                ok=(200, 404, 409),
            )
        except BaseException:
            with self._lock:
                self._claims.pop(meta["name"], None)
            raise
        with self._changed:
            if status != 200:  # changed or gone since our view of it: try again next pass
                self._claims.pop(meta["name"], None)
                return None
            self._pods[meta["name"]] = updated
            self._changed.notify_all()
        return updated

    # -- liveness ------------------------------------------------------------------------------
    async def alive(self, replica: Replica) -> bool:
        try:
            ref = self._ref(replica)
        except BadRequest:
            return False
        return await asyncio.to_thread(self._alive, replica.id, ref)

    def _alive(self, replica_id: str, ref: dict[str, Any]) -> bool:
        self._start()
        with self._lock:
            if not ref.get("pod"):
                return replica_id in self._members.get(ref["deployment"], ())
            pod = self._pods.get(ref["pod"])
            return pod is not None and pod["metadata"].get("uid") == ref.get("uid") and self._serving(pod)

    async def exit_reason(self, replica: Replica) -> str | None:
        try:
            ref = self._ref(replica)
        except BadRequest:
            return f"not a pod of namespace {self.namespace}"
        return await asyncio.to_thread(self._exit_reason, replica.id, ref)

    def _exit_reason(self, replica_id: str, ref: dict[str, Any]) -> str | None:
        if not ref.get("pod"):
            return None  # no pod claimed yet: nothing of it has run
        self._start()
        with self._lock:
            pod = self._pods.get(ref["pod"])
        if pod is None or pod["metadata"].get("uid") != ref.get("uid"):
            return f"its pod {ref['pod']} is gone"
        # Asked of a live pod too: a crash-looping container's, or a stuck one's, is still news.
        why = why_not_serving(pod)
        if why is None and pod["metadata"].get("deletionTimestamp"):
            return f"its pod {ref['pod']} is being deleted"
        return why

    # -- stop ----------------------------------------------------------------------------------
    async def drain(self, replica: Replica, timeout_s: float = 30.0) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise BadRequest(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        ref = self._ref(replica)
        await asyncio.to_thread(self._stop_pod, replica.id, ref, float(timeout_s))

    async def delete(self, replica: Replica) -> None:
        ref = self._ref(replica)
        await asyncio.to_thread(self._stop_pod, replica.id, ref, None)

    def _stop_pod(self, replica_id: str, ref: dict[str, Any], timeout_s: float | None) -> None:
        try:
            self._start()
            self._stop_once(replica_id, ref, timeout_s, wait=True)
        except Exception:
            with self._lock:
                self._unfinished[replica_id] = (ref, timeout_s)
            raise

    def _reap(self) -> None:
        """Retry the unfinished stops until each succeeds (or the driver closes)."""
        while not self._stop.wait(_REAP_S):
            if not self._synced.is_set():
                continue  # a stop needs the pods: which one is the replica's
            with self._lock:
                pending = list(self._unfinished.items())
            for replica_id, (ref, timeout_s) in pending:
                if self._stop.is_set():
                    return
                try:
                    self._stop_once(replica_id, ref, timeout_s, wait=False)
                except Exception as e:  # noqa: BLE001 - tried again at the next round
                    log.warning("region %s: stopping replica %s failed again: %s", self.region, replica_id, e)
                    continue
                with self._lock:
                    self._unfinished.pop(replica_id, None)
                log.info("region %s: finished stopping replica %s", self.region, replica_id)

    def _stop_once(
        self, replica_id: str, ref: dict[str, Any], timeout_s: float | None, *, wait: bool
    ) -> None:
        deployment = ref["deployment"]
        with self._lock:
            self._members.get(deployment, set()).discard(replica_id)
            pod = self._pods.get(ref["pod"]) if ref.get("pod") else None
            if pod is None:  # claimed nothing yet: a pod the ReplicaSet may still make
                pod = next((p for p in self._pods_of(deployment) if self._holder(p) == replica_id), None)
        if pod is not None and ref.get("uid") not in (None, pod["metadata"].get("uid")):
            pod = None  # the claimed pod is gone; this one is someone else's
        if pod is not None:
            self._release(pod["metadata"]["name"])
        self._set_scale(deployment)
        if pod is not None:
            grace = None if timeout_s is None else self.settings.pre_stop_s + math.ceil(timeout_s)
            self._delete_pod(
                pod["metadata"]["name"], pod["metadata"]["uid"], grace, wait=wait and grace is not None
            )

    def _release(self, pod_name: str) -> None:
        """Take the pod out of its ReplicaSet and its Service before it is deleted."""
        self._request(
            "PATCH",
            self._ns_path("v1", "pods", pod_name),
            body={"metadata": {"labels": {LABEL_MEMBER: "released"}}},
            content_type="application/merge-patch+json",
            ok=(200, 404),
        )

    def _delete_pod(self, name: str, uid: str, grace_s: int | None, *, wait: bool) -> None:
        """Delete the pod (uid-guarded) with `grace_s` (None: now); with `wait`, until the
        kubelet has removed it (its processes are gone), forcing it after the grace period."""
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": grace_s or 0,
            "preconditions": {"uid": uid},
        }
        self._request("DELETE", self._ns_path("v1", "pods", name), body=body, ok=(200, 202, 404, 409))
        if not wait:
            return
        deadline = time.monotonic() + (grace_s or 0) + 10
        with self._changed:
            while name in self._pods and self._pods[name]["metadata"].get("uid") == uid:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 1.0))
            else:
                return
        log.warning("pod %s/%s outlived its grace period: deleting it now", self.namespace, name)
        body["gracePeriodSeconds"] = 0
        self._request("DELETE", self._ns_path("v1", "pods", name), body=body, ok=(200, 202, 404, 409))

    # -- restart -------------------------------------------------------------------------------
    async def adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        wrong = [r.id for r in replicas if r.region != self.region]
        if wrong:
            raise BadRequest(f"replicas {wrong} are not in region {self.region!r}")
        return await asyncio.to_thread(self._adopt, list(replicas))

    def _adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        self._start()
        self._relist()
        _, listing = self._request(
            "GET", self._ns_path("apps/v1", "deployments"), query=[("labelSelector", self._selector)]
        )
        deployments = {d["metadata"]["name"] for d in listing.get("items", [])}
        adopted: list[Replica] = []
        gone: list[Replica] = []
        members: dict[str, set[str]] = {name: set() for name in deployments}
        with self._lock:
            for r in replicas:
                ref = r.driver_ref or {}
                name = ref.get("deployment")
                if (
                    ref.get("kind") != "kubernetes"
                    or ref.get("namespace") != self.namespace
                    or name not in deployments
                ):
                    gone.append(r)
                    continue
                if ref.get("pod"):
                    pod = self._pods.get(ref["pod"])
                    if pod is None or pod["metadata"].get("uid") != ref.get("uid") or not self._serving(pod):
                        gone.append(r)
                        continue
                members[str(name)].add(r.id)
                adopted.append(r)
            self._members = members
            kept = {r.id for r in adopted}
            stale = [
                (p["metadata"]["name"], p["metadata"]["uid"])
                for p in self._pods.values()
                if not p["metadata"].get("deletionTimestamp")
                and (
                    (p["metadata"].get("labels") or {}).get(LABEL_MEMBER) == "released"
                    or (self._holder(p) is not None and self._holder(p) not in kept)
                )
            ]
        for name in deployments:
            self._set_scale(name)
        for pod_name, uid in stale:
            # A drain a crash interrupted, or a pod whose replica the store gave up on.
            self._release(pod_name)
            grace = self.settings.pre_stop_s + math.ceil(self.settings.drain_timeout_s)
            self._delete_pod(pod_name, uid, grace, wait=False)
        return adopted, gone

    async def retire(self, deployment_id: str) -> None:
        """Delete the deployment's Deployment, Service and PodDisruptionBudget in this region
        (a scaled-to-zero deployment keeps them: a wake is then one scale call)."""
        await asyncio.to_thread(self._retire, deployment_id)

    def _retire(self, deployment_id: str) -> None:
        name = object_name(deployment_id, self.region)
        with self._lock:
            self._members.pop(name, None)
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        for api_version, plural in (
            ("apps/v1", "deployments"),
            ("v1", "services"),
            (self._pdb(), "poddisruptionbudgets"),
        ):
            self._request("DELETE", self._ns_path(api_version, plural, name), body=body, ok=(200, 202, 404))

    async def close(self) -> None:
        """Stop watching; the pods keep running (a new driver adopts them)."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._raw.shutdown()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await asyncio.to_thread(watcher.join, _WATCH_S + self.timeout_s + 1)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            # It checks for the stop between replicas; a stop in progress ends its calls first.
            await asyncio.to_thread(reaper.join, 4 * self.timeout_s + 1)
        with contextlib.suppress(Exception):
            self._api.close()


def why_not_serving(pod: dict[str, Any]) -> str | None:
    """Why a pod's launcher is not serving, from the pod's status, the likeliest cause first:
    - the pod's own reason: "pod Evicted: <message>" (its containers' ends are the eviction's);
    - its container's last end: "container launcher Error (exit 1) at T: <the launcher's
      failure line, or the message's last line>" (a crash loop's lastState included);
    - a container stuck waiting: "container launcher ImagePullBackOff: <message>";
    - not scheduled: "pod Unschedulable: 0/3 nodes are available: ... nvidia.com/gpu";
    None when the status says none of these (a pod starting normally)."""
    status = pod.get("status") or {}
    if status.get("reason") or status.get("message"):
        return _said(f"pod {status.get('reason') or status.get('phase')}", status.get("message"))
    containers = status.get("containerStatuses") or []
    for c in containers:
        for key in ("state", "lastState"):
            ended = (c.get(key) or {}).get("terminated")
            if not ended:
                continue
            how = ended.get("reason") or "terminated"
            # When: a lastState may be an old crash of a pod that has served since.
            at = f" at {ended['finishedAt']}" if ended.get("finishedAt") else ""
            why = f"container {c.get('name')} {how} (exit {ended.get('exitCode')}){at}"
            message = str(ended.get("message") or "")
            last = launcher_failure(message) or next(
                (line.strip() for line in reversed(message.splitlines()) if line.strip()), ""
            )
            return f"{why}: {last[:_REASON_CHARS]}" if last else why
    for c in containers:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in _STARTING:
            return _said(f"container {c.get('name')} {waiting['reason']}", waiting.get("message"))
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return _said(f"pod {condition.get('reason') or 'Unscheduled'}", condition.get("message"))
    return None


def _said(what: str, message: Any) -> str:
    message = str(message or "")[:_REASON_CHARS]
    return f"{what}: {message}" if message else what
