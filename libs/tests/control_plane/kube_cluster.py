"""A real Kubernetes API server on loopback for tests, and a played node instead of a kubelet.

`kube_cluster(tmp_path)` starts etcd, kube-apiserver and kube-controller-manager (built from
Debian's source package by tools/k8s/build_apiserver.sh; `find_kube_bin`) on random loopback
ports and yields a `Cluster`: its URL, an admin token, a kubeconfig with the context
`paved-test`, and clients for it. Deployments get ReplicaSets and Pods, garbage collection,
PodDisruptionBudget status and ServiceAccounts work as in a cluster; there is no scheduler and
no kubelet.

`played_node(cluster, ...)` does what the scheduler and the kubelet would do for the pods that
fit one node, with local processes on loopback:
- a Node object (Ready, capacity = allocatable, labels, taints; status heartbeat every 10 s;
  the controller-manager runs without its node lifecycle controller, so a late heartbeat never
  taints the node or evicts pods);
- binds each unscheduled pod whose nodeSelector / required node affinity match its labels,
  whose tolerations tolerate its NoSchedule/NoExecute taints and whose requests fit what the
  pods already bound to it leave of its allocatable (nvidia.com/gpu included; a resource the
  node lacks fits only a request of 0); a pod that does not fit stays Pending with
  PodScheduled=False, reason Unschedulable and a scheduler-style message (with several played
  nodes, each writes its own reason and the last one stands; a pod bound meanwhile keeps
  PodScheduled=True); two nodes racing for a pod: the API server lets one binding win;
- gives each pod its own loopback address 127.<node's octet>.<i>.<j>, so pods bind fixed ports
  as in a cluster, and parallel tests (other nodes) use other addresses;
- runs init containers in order, then each container as a process in its own session:
  argv = container.command, or the entrypoint given for the image in `images` (matched by the
  full reference, then without its digest, then without its tag), then container.args;
  `$(VAR)` in command and args expanded from the container's env exactly as Kubernetes does
  (`$$` escapes, unknown names kept); env values may use earlier ones; env from `value`,
  `fieldRef` (metadata.name/namespace/uid/labels['k']/annotations['k'], spec.nodeName,
  spec.serviceAccountName, status.podIP/podIPs/hostIP), `resourceFieldRef`,
  `configMapKeyRef`, `secretKeyRef`, `envFrom`; argv[0] `python`/`python3` -> sys.executable;
  process env = this process's env + `env` of the node + PYTHONPATH covering sys.path + the
  container's env;
- volumes: emptyDir -> a per-pod directory (removed with the pod); hostPath -> the path itself;
  persistentVolumeClaim -> `<node root>/pvc/<namespace>/<claim>` (kept across pods; the claim
  object is not checked); configMap / secret -> their keys written as files. Processes see no
  mount namespace, so a volumeMount's mountPath is honoured by rewriting: every arg, env value,
  the value part of an `--opt=value` arg, exec-hook/probe argv and workingDir that equals a
  mountPath or starts with mountPath + "/" is rewritten to the local directory (+ subPath);
- a pod's status as a kubelet reports it: phase, hostIP, podIP(s), startTime, containerStatuses
  (state, lastState, ready, started, restartCount, containerID `played://<pid>`; a failed
  container's log tail as its message under terminationMessagePolicy FallbackToLogsOnError), conditions
  PodScheduled/Initialized/ContainersReady/Ready (readinessGates respected). Probes (httpGet
  on the pod IP with a numeric or named port, tcpSocket, exec) with initialDelaySeconds,
  failureThreshold and successThreshold as given and periodSeconds capped at
  `probe_period_cap_s`; a startupProbe gates the others; a liveness or startup failure kills
  the container (preStop, SIGTERM, grace, SIGKILL) and restarts it; an exited container is
  restarted per restartPolicy with a short exponential backoff (waiting CrashLoopBackOff);
- deletion as a kubelet: on deletionTimestamp the pod turns not Ready, preStop hooks run
  (exec locally, httpGet against the pod IP), then SIGTERM to each container's main process,
  SIGKILL for whatever is left at the end of deletionGracePeriodSeconds, then the final
  `DELETE` with gracePeriodSeconds=0 and the pod's UID as precondition.

Like a container runtime, SIGTERM goes to the container's main process only; once that process
has exited every other process of the container is killed (as the end of its PID namespace
would), found through the marker variables PAVED_PLAYED_NODE / PAVED_PLAYED_CONTAINER
(`paved.procs.marked_processes`).

Not played: image pulls, service networking (ClusterIPs do not route; EndpointSlices list the
pods' loopback IPs, while v1 Endpoints stay empty: their validation refuses loopback addresses,
so the controller-manager logs FailedToUpdateEndpoint), resource limits, security contexts,
postStart hooks, projected/downwardAPI volumes, pod eviction, node affinity preferences, pod
(anti-)affinity, topology spread, priority and preemption, image CMD (only an entrypoint).

Invariants callers rely on: every wait is bounded; on exit of `played_node` no process it
started is alive (pods are left as they are in the API); on exit of `kube_cluster` etcd, the
API server and the controller-manager have exited and their data and certificates are removed,
while every process's log stays under tmp_path (named in failure messages).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.utils.quantity import parse_quantity

from paved.procs import marked_processes

__all__ = [
    "Cluster",
    "KubeError",
    "KubeHttp",
    "PlayedNode",
    "expand_vars",
    "find_kube_bin",
    "kube_cluster",
    "played_node",
]

BIN_ENV = "PAVED_KUBE_BIN"
BUILD_SCRIPT = "tools/k8s/build_apiserver.sh"
CONTEXT = "paved-test"
NODE_MARK = "PAVED_PLAYED_NODE"
CONTAINER_MARK = "PAVED_PLAYED_CONTAINER"
_BINARIES = ("kube-apiserver", "kube-controller-manager")


# --- finding the binaries ---------------------------------------------------------------------


def _has_binaries(folder: Path) -> bool:
    return all(os.access(folder / b, os.X_OK) for b in _BINARIES)


def _build_script() -> Path | None:
    here = Path(__file__).resolve()
    roots = [p for p in here.parents if (p / BUILD_SCRIPT).is_file()]
    for env in ("RUNFILES_DIR", "TEST_SRCDIR", "BUILD_WORKSPACE_DIRECTORY"):
        if os.environ.get(env):
            roots += [Path(os.environ[env]) / "paved", Path(os.environ[env])]
    for root in roots:
        if (root / BUILD_SCRIPT).is_file():
            return root / BUILD_SCRIPT
    return None


def find_kube_bin(*, build_timeout_s: float = 1800.0) -> Path:
    """The folder holding kube-apiserver and kube-controller-manager.

    $PAVED_KUBE_BIN when set (tools/bazel passes it to every test); otherwise, outside
    `bazel test`, the output of tools/k8s/build_apiserver.sh (well under a second once cached;
    minutes the first time on a machine). Never returns a folder without both binaries: raises
    RuntimeError naming the command to run instead."""
    hint = f"run `{BUILD_SCRIPT}` (it prints the folder) and set {BIN_ENV} to that folder"
    env = os.environ.get(BIN_ENV)
    if env:
        if _has_binaries(Path(env)):
            return Path(env)
        raise RuntimeError(f"{BIN_ENV}={env} lacks {' or '.join(_BINARIES)}: {hint}")
    if os.environ.get("TEST_TMPDIR"):
        # Under `bazel test` HOME is the test's own temp dir: a build here would not hit the
        # machine's cache and would take minutes in every test. tools/bazel passes the folder.
        raise RuntimeError(f"{BIN_ENV} is not set in this test's environment (tools/bazel sets it): {hint}")
    script = _build_script()
    if script is None:
        raise RuntimeError(f"{BIN_ENV} is not set and {BUILD_SCRIPT} was not found: {hint}")
    try:
        done = subprocess.run(
            ["bash", str(script)],
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            timeout=build_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{script} did not finish in {build_timeout_s:.0f} s: {hint}") from e
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    folder = Path(lines[-1]) if lines else None
    if done.returncode != 0 or folder is None or not _has_binaries(folder):
        raise RuntimeError(f"{script} failed (exit {done.returncode}): {hint}")
    return folder


def _etcd_binary() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if not found:
        raise RuntimeError("etcd not found: `sudo apt-get install -y etcd-server` (tools/bazel installs it)")
    return found


# --- a small REST client (dicts in, dicts out, a deadline on every call) ------------------------


class KubeError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, body: bytes, what: str):
        self.status = status
        try:
            self.body: Any = json.loads(body)
        except ValueError:
            self.body = body.decode(errors="replace")
        msg = self.body.get("message") if isinstance(self.body, dict) else self.body
        super().__init__(f"{what}: HTTP {status}: {msg}")


class KubeHttp:
    """JSON over HTTPS to the API server with a bearer token; thread-safe (one urllib3 pool)."""

    def __init__(self, url: str, token: str, ca_file: Path, *, pool_size: int = 16):
        self.url = url
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._pool = urllib3.PoolManager(
            num_pools=2, maxsize=pool_size, cert_reqs="CERT_REQUIRED", ca_certs=str(ca_file)
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = dict(self._headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = self._pool.request(
            method,
            url,
            body=data,
            headers=headers,
            timeout=urllib3.Timeout(connect=5.0, read=timeout_s),
            retries=False,
        )
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, resp.data, f"{method} {path}")
        return json.loads(resp.data) if resp.data else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def patch(self, path: str, body: Any, *, kind: str = "strategic-merge", **kw: Any) -> Any:
        return self.request("PATCH", path, body, content_type=f"application/{kind}-patch+json", **kw)

    def watch(
        self,
        path: str,
        resource_version: str,
        *,
        timeout_s: int = 30,
        on_response: Callable[[Any], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Watch events from `resource_version` on until the server ends the watch (after
        about `timeout_s`); raises KubeError(410) when that version is too old. `on_response`
        gets the open response: its shutdown() ends a blocked read from another thread."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        resp = self._pool.request(
            "GET",
            self.url + path + "?" + urllib.parse.urlencode(query),
            headers=self._headers,
            timeout=urllib3.Timeout(connect=5.0, read=timeout_s + 15.0),
            retries=False,
            preload_content=False,
        )
        if on_response is not None:
            on_response(resp)
        try:
            if resp.status != 200:
                raise KubeError(resp.status, resp.read(), f"watch {path}")
            buf = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise KubeError(int(obj.get("code") or 500), line, f"watch {path}")
                    yield event
        finally:
            resp.release_conn()
            resp.close()


# --- the cluster --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


class _Proc:
    """A server process in its own session (so its whole group can be signalled), log to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str] | None = None):
        self.name = name
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(env) if env is not None else None,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def failure(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what}; {self.name} log {self.log}:\n{_tail(self.log)}")


@dataclass
class Cluster:
    """A running etcd + kube-apiserver + kube-controller-manager on loopback.

    `kubeconfig` is a file with one context, `paved-test` (also the current one), holding the
    API server's CA and the admin token (group system:masters)."""

    url: str
    token: str
    kubeconfig: Path
    ca_file: Path
    root: Path
    log_dir: Path
    bin_dir: Path
    context: str = CONTEXT
    procs: dict[str, _Proc] = field(default_factory=dict, repr=False)

    def api_client(self) -> kubernetes.client.ApiClient:
        """A new official-client ApiClient for this cluster (the caller closes it)."""
        return kubernetes.config.new_client_from_config(
            config_file=str(self.kubeconfig), context=self.context
        )

    def http(self) -> KubeHttp:
        """A small JSON client (what the played node uses): dicts in and out."""
        return KubeHttp(self.url, self.token, self.ca_file)

    def namespace(self, name: str, *, timeout_s: float = 60.0) -> str:
        """Creates namespace `name` (fine if it exists) and returns it once its `default`
        ServiceAccount has its token, so pods created in it are admitted at once."""
        api = self.http()
        try:
            api.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        except KubeError as e:
            if e.status != 409:
                raise
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                sa = api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
                if sa.get("secrets"):
                    return name
            except KubeError as e:
                if e.status != 404:
                    raise
            time.sleep(0.1)
        raise TimeoutError(
            f"namespace {name}: no default ServiceAccount token after {timeout_s} s\n{self.logs_tail()}"
        )

    def logs_tail(self, n: int = 2000) -> str:
        return "\n".join(f"--- {p.name} ({p.log}):\n{_tail(p.log, n)}" for p in self.procs.values())


def _wait(what: str, check: Callable[[], bool], deadline: float, procs: Sequence[_Proc]) -> None:
    while True:
        for p in procs:
            if not p.alive():
                raise p.failure(f"{p.name} exited (code {p.proc.returncode}) while waiting for {what}")
        with contextlib.suppress(
            OSError, ssl.SSLError, http.client.HTTPException, urllib3.exceptions.HTTPError
        ):
            if check():
                return
        if time.monotonic() > deadline:
            raise procs[-1].failure(f"timed out waiting for {what}")
        time.sleep(0.1)


def _http_ok(url: str, *, token: str = "", ca_file: Path | None = None, expect: bytes = b"") -> bool:
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        ctx = ssl.create_default_context(cafile=str(ca_file)) if ca_file else ssl._create_unverified_context()  # noqa: S323
        conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=2.0, context=ctx)
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=2.0)
    try:
        conn.request("GET", parts.path or "/", headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status == 200 and expect in resp.read()
    finally:
        conn.close()


def _write_kubeconfig(path: Path, url: str, token: str, ca_pem: bytes) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": url, "certificate-authority-data": base64.b64encode(ca_pem).decode()},
            }
        ],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [
            {"name": CONTEXT, "context": {"cluster": CONTEXT, "user": "admin", "namespace": "default"}}
        ],
        "current-context": CONTEXT,
    }
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    path.chmod(0o600)


@contextlib.contextmanager
def kube_cluster(tmp_path: Path | str, *, start_timeout_s: float = 180.0) -> Iterator[Cluster]:
    """etcd + kube-apiserver + kube-controller-manager on free loopback ports, under
    `tmp_path`/kube. Yields once /readyz answers ok and the controller-manager has created the
    `default` namespace's ServiceAccount token (it is running). Raises RuntimeError with the
    failing process's log tail if one does not come up within `start_timeout_s`."""
    bin_dir = find_kube_bin()
    etcd = _etcd_binary()
    base = Path(tmp_path) / "kube"
    log_dir = base / "logs"
    state = base / "state"  # removed on exit; logs stay
    log_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    procs: dict[str, _Proc] = {}
    deadline = time.monotonic() + start_timeout_s
    try:
        # A probed free port can be taken before the server binds it: the server then exits
        # and the start is tried again on new ports.
        for attempt in range(3):
            client, peer = _free_port(), _free_port()
            data = state / f"etcd-{attempt}"
            procs["etcd"] = _Proc(
                "etcd",
                [
                    etcd,
                    "--name=default",
                    f"--data-dir={data}",
                    f"--listen-client-urls=http://127.0.0.1:{client}",
                    f"--advertise-client-urls=http://127.0.0.1:{client}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer}",
                    "--log-level=warn",
                    "--logger=zap",
                ],
                log_dir / "etcd.log",
            )
            try:
                _wait(
                    "etcd /health",
                    lambda c=client: _http_ok(f"http://127.0.0.1:{c}/health", expect=b"true"),  # type: ignore[misc]
                    deadline,
                    [procs["etcd"]],
                )
                break
            except RuntimeError:
                if attempt == 2 or procs["etcd"].alive():
                    raise
        etcd_url = f"http://127.0.0.1:{client}"

        certs = state / "certs"
        certs.mkdir()
        sa_key = state / "sa.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(sa_key), "2048"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        token = uuid.uuid4().hex
        token_file = state / "tokens.csv"
        token_file.write_text(f'{token},admin,admin,"system:masters"\n')
        token_file.chmod(0o600)
        ca_file = certs / "apiserver.crt"
        for attempt in range(3):
            port = _free_port()
            procs["kube-apiserver"] = _Proc(
                "kube-apiserver",
                [
                    str(bin_dir / "kube-apiserver"),
                    f"--etcd-servers={etcd_url}",
                    f"--etcd-prefix=/registry-{attempt}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--insecure-port=0",
                    f"--cert-dir={certs}",
                    f"--token-auth-file={token_file}",
                    "--authorization-mode=RBAC",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={sa_key}",
                    f"--service-account-signing-key-file={sa_key}",
                    # Only an allocation range: no traffic ever goes there.
                    "--service-cluster-ip-range=10.96.0.0/24",
                    "--enable-priority-and-fairness=false",
                    "--profiling=false",
                    "--v=1",
                ],
                log_dir / "kube-apiserver.log",
            )
            url = f"https://127.0.0.1:{port}"
            try:
                _wait(
                    "the apiserver's serving certificate",
                    ca_file.is_file,
                    deadline,
                    [procs["kube-apiserver"]],
                )
                _wait(
                    "kube-apiserver /readyz",
                    lambda u=url: _http_ok(f"{u}/readyz", token=token, ca_file=ca_file, expect=b"ok"),  # type: ignore[misc]
                    deadline,
                    [procs["etcd"], procs["kube-apiserver"]],
                )
                break
            except RuntimeError:
                if attempt == 2 or procs["kube-apiserver"].alive():
                    raise
        kubeconfig = base / "kubeconfig"
        _write_kubeconfig(kubeconfig, url, token, ca_file.read_bytes())
        procs["kube-controller-manager"] = _Proc(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                # No node lifecycle controller: the played node's heartbeat may pause (a loaded
                # machine, a debugger) without its pods being tainted away or evicted.
                "--controllers=*,-nodelifecycle",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={ca_file}",
                "--use-service-account-credentials=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "--port=0",
                "--v=1",
            ],
            log_dir / "kube-controller-manager.log",
        )
        cluster = Cluster(
            url=url,
            token=token,
            kubeconfig=kubeconfig,
            ca_file=ca_file,
            root=base,
            log_dir=log_dir,
            bin_dir=bin_dir,
            procs=procs,
        )
        api = cluster.http()

        def default_sa_ready() -> bool:
            try:
                return bool(api.get("/api/v1/namespaces/default/serviceaccounts/default").get("secrets"))
            except KubeError:
                return False

        _wait(
            "the controller-manager (default ServiceAccount token)",
            default_sa_ready,
            deadline,
            list(procs.values()),
        )
        yield cluster
    finally:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            if name in procs:
                procs[name].stop()
        shutil.rmtree(state, ignore_errors=True)


# --- $(VAR) expansion, exactly as Kubernetes (third_party/forked/golang/expansion) -------------


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values: `$(NAME)` becomes env[NAME] when
    NAME is defined and stays as written otherwise; `$$` is one `$`; any other `$` is kept."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            if rest[0] == "$":
                out.append("$")
                advance = 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = rest[1:close]
                    out.append(env.get(name, f"$({name})"))
                    advance = close + 1
            else:
                out.append("$" + rest[0])
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


# --- the played node ----------------------------------------------------------------------------


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The scheduler's view: the sum over containers, at least the largest init container."""
    spec = pod.get("spec") or {}

    def of(c: Mapping[str, Any]) -> dict[str, Decimal]:
        return {k: parse_quantity(v) for k, v in ((c.get("resources") or {}).get("requests") or {}).items()}

    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def _selector_term_matches(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    for expr in term.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        have = labels.get(key)
        if op == "In" and have not in values:
            return False
        if op == "NotIn" and have in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op in ("Gt", "Lt"):
            try:
                a, b = int(have or ""), int(values[0])
            except (ValueError, IndexError):
                return False
            if (op == "Gt" and not a > b) or (op == "Lt" and not a < b):
                return False
    for expr in term.get("matchFields") or []:
        if expr.get("key") == "metadata.name":
            inside = name in (expr.get("values") or [])
            if (expr.get("operator") == "In") != inside:
                return False
    return True


def _tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _image_entrypoint(image: str, images: Mapping[str, Sequence[str]]) -> list[str] | None:
    no_digest = image.split("@", 1)[0]
    slash = no_digest.rfind("/")
    colon = no_digest.rfind(":")
    no_tag = no_digest[:colon] if colon > slash else no_digest
    for key in (image, no_digest, no_tag):
        if key in images:
            return list(images[key])
    return None


@dataclass
class _Probe:
    spec: dict[str, Any]
    next_at: float
    successes: int = 0
    failures: int = 0


class _Container:
    def __init__(self, spec: dict[str, Any], init: bool):
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""
        self.restart_count = 0
        self.started_at = ""
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.ready = False
        self.started = False
        self.next_start = 0.0
        self.done = False  # terminated and not to be restarted
        self.probes: dict[str, _Probe] = {}
        self.env: dict[str, str] = {}

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class _PodWorker:
    """One pod on the node: its processes, probes and status, in a thread of its own."""

    TICK_S = 0.1

    def __init__(self, node: PlayedNode, pod: dict[str, Any]):
        self.node = node
        self._pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.name: str = meta["name"]
        self.ip = node._allocate_ip()
        self.dir = node.root / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._gone = threading.Event()
        self.start_time = _now()
        spec = pod.get("spec") or {}
        self.init = [_Container(c, True) for c in spec.get("initContainers") or []]
        self.main = [_Container(c, False) for c in spec.get("containers") or []]
        self.initialized = not self.init
        self._sent: str = ""
        self._transitions: dict[str, tuple[str, str]] = {
            c["type"]: (c["status"], c["lastTransitionTime"])
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("lastTransitionTime")
        }
        self.mounts: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self._run, name=f"played-pod-{self.name}", daemon=True)

    # Called from the watch thread.
    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone.set()
        self._wake.set()

    @property
    def pod(self) -> dict[str, Any]:
        with self._lock:
            return self._pod

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.ns}/pods/{self.name}"

    def _deleting(self) -> bool:
        return self._gone.is_set() or bool(self.pod["metadata"].get("deletionTimestamp"))

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        try:
            self._live()
        except Exception:  # noqa: BLE001 (a worker must never die silently: the node logs it)
            self.node._log(f"pod {self.ns}/{self.name}: worker failed:\n{traceback.format_exc()}")
        finally:
            self._kill_all(grace_s=0.0 if self.node._stopping.is_set() else 2.0, pre_stop=False)
            if not self.node._stopping.is_set():
                shutil.rmtree(self.dir, ignore_errors=True)
            self.node._worker_done(self.uid)

    def _live(self) -> None:
        node = self.node
        while not self._prepare_volumes():
            if self._deleting() or node._stopping.is_set():
                break
            self._report()
            self._sleep(1.0)
        while not node._stopping.is_set() and not self._deleting():
            if not self.initialized:
                self._step_init()
            else:
                for c in self.main:
                    self._step(c)
            self._report()
            self._sleep(self.TICK_S)
        if node._stopping.is_set():
            return
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        grace_s = 2.0 if self._gone.is_set() or grace is None else float(grace)
        for c in self.init + self.main:
            c.ready = False
        self._report()
        self._kill_all(grace_s=grace_s, pre_stop=True)
        self._report(final=True)
        if not self._gone.is_set():
            body = {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": self.uid},
            }
            try:
                node.api.request("DELETE", self.path, body)
            except KubeError as e:
                if e.status not in (404, 409):
                    node._log(f"pod {self.ns}/{self.name}: final delete: {e}")
        node._log(f"pod {self.ns}/{self.name}: terminated and deleted")

    # --- volumes and env ---

    def _prepare_volumes(self) -> bool:
        """Local directories for the pod's volumes; False while a configMap/secret is missing."""
        spec = self.pod.get("spec") or {}
        local: dict[str, str] = {}
        for vol in spec.get("volumes") or []:
            name = vol["name"]
            vdir = self.dir / "volumes" / name
            if "hostPath" in vol:
                local[name] = vol["hostPath"]["path"]
                if (vol["hostPath"].get("type") or "") == "DirectoryOrCreate":
                    os.makedirs(local[name], exist_ok=True)
            elif "persistentVolumeClaim" in vol:
                pvc = self.node.root / "pvc" / self.ns / vol["persistentVolumeClaim"]["claimName"]
                pvc.mkdir(parents=True, exist_ok=True)
                local[name] = str(pvc)
            elif "configMap" in vol or "secret" in vol:
                src = vol.get("configMap") or vol.get("secret") or {}
                is_secret = "secret" in vol
                obj_name = src.get("secretName") if is_secret else src.get("name")
                kind = "secrets" if is_secret else "configmaps"
                try:
                    obj = self.node.api.get(f"/api/v1/namespaces/{self.ns}/{kind}/{obj_name}")
                except KubeError as e:
                    if e.status == 404 and src.get("optional"):
                        obj = {}
                    elif e.status == 404:
                        self.node._log(
                            f"pod {self.ns}/{self.name}: volume {name}: {kind} {obj_name} not found yet"
                        )
                        return False
                    else:
                        raise
                files: dict[str, bytes] = {}
                for k, v in (obj.get("data") or {}).items():
                    files[k] = base64.b64decode(v) if is_secret else v.encode()
                for k, v in (obj.get("binaryData") or {}).items():
                    files[k] = base64.b64decode(v)
                items = src.get("items")
                if items:
                    files = {it["path"]: files[it["key"]] for it in items if it["key"] in files}
                vdir.mkdir(parents=True, exist_ok=True)
                for rel, content in files.items():
                    target = vdir / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                local[name] = str(vdir)
            else:  # emptyDir, and what is not played (an empty directory stands in)
                vdir.mkdir(parents=True, exist_ok=True)
                local[name] = str(vdir)
        self._volumes = local
        return True

    def _mounts_of(self, c: _Container) -> list[tuple[str, str]]:
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            base = self._volumes.get(m["name"])
            if base is None:
                continue
            target = os.path.join(base, m["subPath"]) if m.get("subPath") else base
            if m.get("subPath"):
                os.makedirs(target, exist_ok=True)
            mounts.append((m["mountPath"].rstrip("/") or "/", target))
        return sorted(mounts, key=lambda m: -len(m[0]))

    @staticmethod
    def _map(value: str, mounts: Sequence[tuple[str, str]]) -> str:
        """A path inside a mount, rewritten to the local directory behind it."""
        for mount, local in mounts:
            if value == mount:
                return local
            if value.startswith(mount + "/"):
                return local + value[len(mount) :]
        if value.startswith("--") and "=" in value:
            opt, rest = value.split("=", 1)
            mapped = _PodWorker._map(rest, mounts)
            if mapped != rest:
                return f"{opt}={mapped}"
        return value

    def _field(self, path: str) -> str:
        pod = self.pod
        meta = pod["metadata"]
        simple = {
            "metadata.name": meta.get("name", ""),
            "metadata.namespace": meta.get("namespace", ""),
            "metadata.uid": meta.get("uid", ""),
            "spec.nodeName": self.node.name,
            "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", ""),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.node.host_ip,
        }
        if path in simple:
            return simple[path]
        for prefix, key in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
            if path.startswith(prefix + "['") and path.endswith("']"):
                return (meta.get(key) or {}).get(path[len(prefix) + 2 : -2], "")
        raise ValueError(f"fieldRef {path} is not played")

    def _resource(self, c: _Container, ref: Mapping[str, Any]) -> str:
        kind, _, res = ref["resource"].partition(".")
        value = ((c.spec.get("resources") or {}).get(kind) or {}).get(res)
        if value is None:
            value = self.node.capacity.get(res, "0")
        divisor = parse_quantity(ref.get("divisor") or "1")
        return str(int(-(-parse_quantity(value) // divisor)))  # ceiling, as the kubelet

    def _key_ref(self, kind: str, ref: Mapping[str, Any]) -> str | None:
        try:
            obj = self.node.api.get(f"/api/v1/namespaces/{self.ns}/{kind}/{ref['name']}")
        except KubeError as e:
            if e.status == 404 and ref.get("optional"):
                return None
            raise
        raw = (obj.get("data") or {}).get(ref["key"])
        if raw is None:
            if ref.get("optional"):
                return None
            raise ValueError(f"{kind} {ref['name']} has no key {ref['key']}")
        return base64.b64decode(raw).decode() if kind == "secrets" else raw

    def _env(self, c: _Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in c.spec.get("envFrom") or []:
            ref = src.get("configMapRef") or src.get("secretRef") or {}
            kind = "configmaps" if "configMapRef" in src else "secrets"
            try:
                obj = self.node.api.get(f"/api/v1/namespaces/{self.ns}/{kind}/{ref['name']}")
            except KubeError as e:
                if e.status == 404 and ref.get("optional"):
                    continue
                raise
            for k, v in (obj.get("data") or {}).items():
                env[src.get("prefix", "") + k] = base64.b64decode(v).decode() if kind == "secrets" else v
        for var in c.spec.get("env") or []:
            value: str | None
            if "valueFrom" in var:
                vf = var["valueFrom"]
                if "fieldRef" in vf:
                    value = self._field(vf["fieldRef"]["fieldPath"])
                elif "resourceFieldRef" in vf:
                    value = self._resource(c, vf["resourceFieldRef"])
                elif "configMapKeyRef" in vf:
                    value = self._key_ref("configmaps", vf["configMapKeyRef"])
                else:
                    value = self._key_ref("secrets", vf["secretKeyRef"])
                if value is None:
                    continue
            else:
                value = expand_vars(var.get("value") or "", env)
            env[var["name"]] = value
        return env

    # --- processes ---

    def _start(self, c: _Container) -> None:
        node = self.node
        c.env = self._env(c)
        command = c.spec.get("command")
        entry = list(command) if command else _image_entrypoint(c.spec.get("image", ""), node.images)
        if entry is None:
            c.state = {
                "waiting": {
                    "reason": "ErrImagePull",
                    "message": f"the played node has no entrypoint for image {c.spec.get('image')!r}",
                }
            }
            c.next_start = time.monotonic() + 1.0
            return
        mounts = self._mounts_of(c)
        argv = [self._map(expand_vars(a, c.env), mounts) for a in entry + list(c.spec.get("args") or [])]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        c.token = f"{node.id}/{self.uid}/{c.name}/{c.restart_count}"
        proc_env = self._proc_env(c, mounts)
        workdir = self.dir / "work" / c.name
        workdir.mkdir(parents=True, exist_ok=True)
        cwd = self._map(c.spec["workingDir"], mounts) if c.spec.get("workingDir") else str(workdir)
        log = node.log_path(self.ns, self.name, c.name)
        with open(log, "ab") as out:
            out.write(f"--- {_now()} start #{c.restart_count}: {argv}\n".encode())
            out.flush()
            try:
                c.proc = subprocess.Popen(
                    argv,
                    env=proc_env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                out.write(f"--- cannot start: {e}\n".encode())
                c.proc = None
                self._exited(c, 128, "StartError", str(e), _now())
                return
        c.started_at = _now()
        c.state = {"running": {"startedAt": c.started_at}}
        now = time.monotonic()
        delay_cap = node.initial_delay_cap_s
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = c.spec.get(kind)
            if spec and not c.init:
                delay = float(spec.get("initialDelaySeconds") or 0)
                if delay_cap is not None:
                    delay = min(delay, delay_cap)
                c.probes[kind] = _Probe(spec, now + delay)
        c.started = "startupProbe" not in c.probes
        c.ready = c.started and "readinessProbe" not in c.probes and not c.init
        node._log(
            f"pod {self.ns}/{self.name}: container {c.name} started pid {c.proc.pid} at {self.ip}: {argv}"
        )

    def _proc_env(self, c: _Container, mounts: Sequence[tuple[str, str]]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.node.env)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.update({k: self._map(v, mounts) for k, v in c.env.items()})
        env[NODE_MARK] = self.node.id
        env[CONTAINER_MARK] = c.token
        return env

    def _exited(self, c: _Container, code: int, reason: str, message: str, finished: str) -> None:
        """Records an exit and decides on a restart (restartPolicy, exponential backoff)."""
        if c.token:
            self.node._kill_marked(CONTAINER_MARK, c.token)  # the rest of its "PID namespace"
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": c.started_at or finished,
            "finishedAt": finished,
            "containerID": f"played://{c.proc.pid}" if c.proc else "played://none",
        }
        if not message and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = self._log_tail(c)
        if message:
            terminated["message"] = message
        c.proc = None
        c.ready = False
        c.started = False
        c.probes = {}
        policy = (self.pod.get("spec") or {}).get("restartPolicy") or "Always"
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if c.init and code == 0:
            restart = False
        if restart and not self._deleting() and not self.node._stopping.is_set():
            delay = min(self.node.max_restart_backoff_s, 0.2 * 2**c.restart_count)
            c.last_state = {"terminated": terminated}
            c.restart_count += 1
            c.state = {
                "waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:.1f}s restarting"}
            }
            c.next_start = time.monotonic() + delay
        else:
            c.state = {"terminated": terminated}
            c.done = True
        self.node._log(
            f"pod {self.ns}/{self.name}: container {c.name} exited {code} ({reason}); restart={restart}"
        )

    def _log_tail(self, c: _Container) -> str:
        """The kubelet's fallback termination message: the log's last 80 lines, at most 2048
        bytes (no message file is played)."""
        try:
            data = self.node.log_path(self.ns, self.name, c.name).read_bytes()[-2048:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-80:])

    def _step_init(self) -> None:
        for c in self.init:
            if c.done:
                if c.state.get("terminated", {}).get("exitCode") != 0:
                    return  # failed for good (restartPolicy Never): the pod is Failed
                continue
            self._step(c)
            return
        self.initialized = True

    def _step(self, c: _Container) -> None:
        if c.done:
            return
        if c.proc is None:
            if time.monotonic() >= c.next_start:
                self._start(c)
            return
        code = c.proc.poll()
        if code is not None:
            self._exited(
                c, code if code >= 0 else 128 - code, "Completed" if code == 0 else "Error", "", _now()
            )
            return
        self._run_probes(c)

    def _run_probes(self, c: _Container) -> None:
        now = time.monotonic()
        cap = self.node.probe_period_cap_s
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.probes.get(kind)
            if probe is None or now < probe.next_at:
                continue
            if kind != "startupProbe" and not c.started:
                continue
            if kind == "startupProbe" and c.started:
                continue
            spec = probe.spec
            probe.next_at = now + min(float(spec.get("periodSeconds") or 10), cap)
            ok = self._probe(c, spec)
            if ok:
                probe.successes += 1
                probe.failures = 0
            else:
                probe.failures += 1
                probe.successes = 0
            failure_threshold = int(spec.get("failureThreshold") or 3)
            if kind == "startupProbe":
                if ok:
                    c.started = True
                    c.ready = "readinessProbe" not in c.probes
                elif probe.failures >= failure_threshold:
                    self._probe_kill(c, "startup")
                    return
            elif kind == "livenessProbe":
                if not ok and probe.failures >= failure_threshold:
                    self._probe_kill(c, "liveness")
                    return
            elif ok and probe.successes >= int(spec.get("successThreshold") or 1):
                c.ready = True
            elif not ok and probe.failures >= failure_threshold:
                c.ready = False

    def _probe_kill(self, c: _Container, kind: str) -> None:
        self.node._log(f"pod {self.ns}/{self.name}: container {c.name} failed its {kind} probe; killing it")
        grace = float((self.pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 30)
        c.ready = False
        self._report()
        self._kill([c], grace_s=grace, pre_stop=True)

    def _target(self, c: _Container, spec: Mapping[str, Any]) -> tuple[str, int]:
        port = spec.get("port")
        if isinstance(port, str) and not port.isdigit():
            for p in c.spec.get("ports") or []:
                if p.get("name") == port:
                    port = p["containerPort"]
                    break
            else:
                raise ValueError(f"container {c.name} has no port named {port}")
        return spec.get("host") or self.ip, int(port or 0)

    def _exec_argv(self, c: _Container, command: Sequence[str]) -> list[str]:
        argv = [self._map(a, self._mounts_of(c)) for a in command]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    def _probe(self, c: _Container, spec: Mapping[str, Any]) -> bool:
        timeout = float(spec.get("timeoutSeconds") or 1)
        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                host, port = self._target(c, get)
                return self._http_get(get, host, port, timeout) < 400
            if "tcpSocket" in spec:
                with socket.create_connection(self._target(c, spec["tcpSocket"]), timeout=timeout):
                    return True
            if "exec" in spec:
                mounts = self._mounts_of(c)
                done = subprocess.run(
                    self._exec_argv(c, spec["exec"]["command"]),
                    env=self._proc_env(c, mounts),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=timeout,
                    check=False,
                )
                return done.returncode == 0
        except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException):
            return False
        return False

    @staticmethod
    def _http_get(get: Mapping[str, Any], host: str, port: int, timeout: float) -> int:
        conn: http.client.HTTPConnection
        if (get.get("scheme") or "HTTP").upper() == "HTTPS":
            ctx = ssl._create_unverified_context()  # noqa: S323 (the kubelet does not verify probes either)
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            headers.setdefault("User-Agent", "kube-probe/1.20")
            conn.request("GET", get.get("path") or "/", headers=headers)
            resp = conn.getresponse()
            resp.read()
            return resp.status if resp.status >= 200 else 600
        finally:
            conn.close()

    def _pre_stop(self, c: _Container, timeout: float) -> None:
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if not hook or timeout <= 0:
            return
        try:
            if "exec" in hook:
                done = subprocess.run(
                    self._exec_argv(c, hook["exec"]["command"]),
                    env=self._proc_env(c, self._mounts_of(c)),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=timeout,
                    check=False,
                )
                outcome = f"exit {done.returncode} {done.stdout[-300:]!r} {done.stderr[-300:]!r}"
            elif "httpGet" in hook:
                host, port = self._target(c, hook["httpGet"])
                outcome = f"HTTP {self._http_get(hook['httpGet'], host, port, timeout)}"
            else:
                outcome = "no handler played"
        except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException) as e:
            outcome = f"failed: {e!r}"
        self.node._log(f"pod {self.ns}/{self.name}: container {c.name} preStop: {outcome}")

    def _kill(self, containers: Sequence[_Container], *, grace_s: float, pre_stop: bool) -> None:
        """preStop (within the grace period), SIGTERM to each main process, SIGKILL for what is
        left at the end of the grace period (at least 2 s after the SIGTERM when preStop used
        it all, as the kubelet does), then the exits recorded."""
        live = [c for c in containers if c.running()]
        deadline = time.monotonic() + grace_s
        if pre_stop and live:
            hooks = [
                threading.Thread(target=self._pre_stop, args=(c, grace_s), daemon=True)
                for c in live
                if (c.spec.get("lifecycle") or {}).get("preStop")
            ]
            for t in hooks:
                t.start()
            for t in hooks:
                t.join(max(0.0, deadline - time.monotonic()))
            deadline = max(deadline, time.monotonic() + min(2.0, grace_s))
        for c in live:
            assert c.proc is not None
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        while any(c.running() for c in live) and time.monotonic() < deadline:
            if self.node._stopping.is_set():
                break
            time.sleep(0.02)
        for c in live:
            assert c.proc is not None
            killed = c.proc.poll() is None
            if killed:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)
            code = c.proc.returncode if c.proc.returncode is not None else -9
            self._exited(c, code if code >= 0 else 128 - code, "Error" if code else "Completed", "", _now())

    def _kill_all(self, *, grace_s: float, pre_stop: bool) -> None:
        self._kill(self.init + self.main, grace_s=grace_s, pre_stop=pre_stop)
        for c in self.init + self.main:
            if c.token:
                self.node._kill_marked(CONTAINER_MARK, c.token)

    # --- status ---

    def _phase(self) -> str:
        if any(c.done and c.state["terminated"]["exitCode"] != 0 for c in self.init):
            return "Failed"
        if not self.initialized:
            return "Pending"
        if any(c.running() for c in self.main):
            return "Running"
        if all(c.done for c in self.main):
            return "Failed" if any(c.state["terminated"]["exitCode"] != 0 for c in self.main) else "Succeeded"
        if any(c.restart_count or c.last_state for c in self.main):
            return "Running"
        return "Pending"

    def _condition(self, kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
        status = "True" if ok else "False"
        prev = self._transitions.get(kind)
        if prev is None or prev[0] != status:
            self._transitions[kind] = (status, _now())
        cond = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": self._transitions[kind][1],
        }
        if reason and not ok:
            cond["reason"] = reason
        return cond

    def _container_status(self, c: _Container) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "played://" + c.spec.get("image", ""),
            "ready": c.ready,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if not c.init:
            status["started"] = c.started and c.running()
        if c.proc is not None:
            status["containerID"] = f"played://{c.proc.pid}"
        return status

    def _report(self, *, final: bool = False) -> None:
        """PATCHes the pod's status when it changed (strategic merge: conditions by type, so
        conditions of readiness gates written by others stay)."""
        pod = self.pod
        containers_ready = bool(self.main) and all(c.ready and c.running() for c in self.main) and not final
        gates = [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or []]
        current = {
            cond.get("type"): cond.get("status") for cond in (pod.get("status") or {}).get("conditions") or []
        }
        ready = containers_ready and all(current.get(g) == "True" for g in gates)
        status = {
            "phase": self._phase(),
            "hostIP": self.node.host_ip,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", self.initialized, "ContainersNotInitialized"),
                self._condition("ContainersReady", containers_ready, "ContainersNotReady"),
                self._condition("Ready", ready, "ContainersNotReady"),
            ],
            "containerStatuses": [self._container_status(c) for c in self.main],
        }
        if self.init:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.init]
        text = json.dumps(status, sort_keys=True)
        if text == self._sent or self._gone.is_set():
            return
        try:
            self.node.api.patch(self.path + "/status", {"status": status})
            self._sent = text
        except KubeError as e:
            if e.status == 404:
                self.gone()
            else:
                self.node._log(f"pod {self.ns}/{self.name}: status update: {e}")
        except (OSError, urllib3.exceptions.HTTPError) as e:
            self.node._log(f"pod {self.ns}/{self.name}: status update: {e!r}")


_OCTETS_USED: set[int] = set()
_OCTETS_LOCK = threading.Lock()


class PlayedNode:
    """A scheduler and a kubelet for one node, playing pods as local processes (module docstring).

    Attributes tests use: `name`, `host_ip`, `root` (pods, pvc, logs), `id` (the value of
    PAVED_PLAYED_NODE in every process it started), `log_path(ns, pod, container)`,
    `pod_ip(ns, pod)`, `processes()`."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        name: str = "node-1",
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        capacity: Mapping[str, str] | None = None,
        images: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
        namespaces: Sequence[str] | None = None,
        root: Path | None = None,
        probe_period_cap_s: float = 0.5,
        initial_delay_cap_s: float | None = None,
        max_restart_backoff_s: float = 5.0,
    ):
        self.cluster = cluster
        self.name = name
        self.id = f"{name}-{uuid.uuid4().hex[:12]}"
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.taints = [dict(t) for t in taints]
        self.capacity = {
            "pods": "110",
            **(capacity or {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "0"}),
        }
        self.images = dict(images or {})
        self.env = dict(env or {})
        self.namespaces = set(namespaces) if namespaces is not None else None
        self.root = root or cluster.root / "nodes" / self.id
        self.probe_period_cap_s = probe_period_cap_s
        self.initial_delay_cap_s = initial_delay_cap_s
        self.max_restart_backoff_s = max_restart_backoff_s
        # Pod addresses 127.<octet>.<i>.<j>: an octet of its own among this process's nodes,
        # random so that parallel tests (other processes) rarely share one.
        with _OCTETS_LOCK:
            free = sorted(set(range(2, 255)) - _OCTETS_USED) or list(range(2, 255))
            self._octet = random.choice(free)
            _OCTETS_USED.add(self._octet)
        self._next_ip = random.randint(1, 200) * 256
        self.host_ip = f"127.{self._octet}.0.1"
        self.api = cluster.http()
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Any]] = {}
        self._workers: dict[str, _PodWorker] = {}
        self._assumed: dict[str, dict[str, Decimal]] = {}
        self._unschedulable: dict[str, str] = {}
        self._stopping = threading.Event()
        self._wake_scheduler = threading.Event()
        self._synced = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_resp: Any = None
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self._log_file = self.root / "logs" / "node.log"

    # --- public helpers ---

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.root / "logs" / f"{namespace}_{pod}_{container}.log"

    def log_tail(self, n: int = 4000) -> str:
        return _tail(self._log_file, n)

    def pod_ip(self, namespace: str, pod: str) -> str | None:
        with self._lock:
            for w in self._workers.values():
                if (w.ns, w.name) == (namespace, pod):
                    return w.ip
        return None

    def processes(self) -> dict[int, str]:
        """Every live process this node started (any depth, any session)."""
        return marked_processes(NODE_MARK, self.id)

    # --- lifecycle ---

    def start(self, *, timeout_s: float = 30.0) -> None:
        self._register()
        for target, name in ((self._watch_loop, "watch"), (self._scheduler_loop, "scheduler")):
            t = threading.Thread(target=target, name=f"played-{self.name}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if not self._synced.wait(timeout_s):
            raise TimeoutError(f"played node {self.name}: no pod list in {timeout_s} s\n{self.log_tail()}")

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Ends every process this node started; the API objects stay as they are."""
        self._stopping.set()
        self._wake_scheduler.set()
        if self._watch_resp is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._watch_resp.shutdown()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w._wake.set()
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.thread.join(max(0.1, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.1, min(5.0, deadline - time.monotonic())))
        self._kill_marked(NODE_MARK, self.id)
        with _OCTETS_LOCK:
            _OCTETS_USED.discard(self._octet)

    def _log(self, msg: str) -> None:
        with self._lock, open(self._log_file, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {msg}\n")

    @staticmethod
    def _kill_marked(name: str, value: str) -> None:
        for _ in range(3):
            found = marked_processes(name, value)
            if not found:
                return
            for pid in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def _allocate_ip(self) -> str:
        with self._lock:
            while True:
                self._next_ip = (self._next_ip + 1) % 65536
                i, j = divmod(self._next_ip, 256)
                if i and 0 < j < 255:
                    return f"127.{self._octet}.{i}.{j}"

    def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": self.labels,
                "annotations": {"paved.dev/played-node": self.id},
            },
            "spec": {"taints": self.taints},
        }
        try:
            self.api.request("POST", "/api/v1/nodes", node)
        except KubeError as e:
            if e.status != 409:
                raise
            self.api.patch(f"/api/v1/nodes/{self.name}", {"metadata": node["metadata"]}, kind="merge")
        self._heartbeat()
        # The TaintNodesByCondition admission added node.kubernetes.io/not-ready at creation;
        # the node lifecycle controller (not run) would lift it once the node is Ready.
        self.api.patch(f"/api/v1/nodes/{self.name}", {"spec": {"taints": self.taints or None}}, kind="merge")

    def _heartbeat(self) -> None:
        now = _now()
        conditions = [
            {
                "type": kind,
                "status": "True" if kind == "Ready" else "False",
                "reason": "KubeletReady" if kind == "Ready" else f"KubeletHasNo{kind}",
                "message": "played by paved's test helper",
                "lastHeartbeatTime": now,
                "lastTransitionTime": getattr(self, "_since", now),
            }
            for kind in ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        self._since = getattr(self, "_since", now)
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": self.host_ip},
                {"type": "Hostname", "address": self.name},
            ],
            "nodeInfo": {
                "machineID": self.id,
                "systemUUID": self.id,
                "bootID": self.id,
                "kernelVersion": os.uname().release,
                "osImage": "paved played node",
                "containerRuntimeVersion": "played://1",
                "kubeletVersion": "v1.20.2",
                "kubeProxyVersion": "v1.20.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": status})

    # --- watch: the pod cache, workers for the pods bound here ---

    def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                listing = self.api.get("/api/v1/pods", timeout_s=30)
                rv = listing["metadata"]["resourceVersion"]
                seen = {p["metadata"]["uid"] for p in listing.get("items") or []}
                with self._lock:
                    vanished = [uid for uid in self._cache if uid not in seen]
                for uid in vanished:
                    self._observe(None, uid)
                for pod in listing.get("items") or []:
                    self._observe(pod, pod["metadata"]["uid"])
                self._synced.set()
                while not self._stopping.is_set():
                    for event in self.api.watch(
                        "/api/v1/pods", rv, timeout_s=10, on_response=self._set_watch
                    ):
                        if self._stopping.is_set():
                            return
                        obj = event.get("object") or {}
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        if event["type"] == "BOOKMARK":
                            continue
                        uid = obj["metadata"]["uid"]
                        self._observe(None if event["type"] == "DELETED" else obj, uid)
            except KubeError as e:
                if e.status != 410:  # 410: too old a version; relist
                    self._log(f"watch: {e}")
                    self._stopping.wait(0.5)
            except (OSError, ValueError, KeyError, urllib3.exceptions.HTTPError) as e:
                if not self._stopping.is_set():
                    self._log(f"watch: {e!r}; relisting")
                    self._stopping.wait(0.5)

    def _set_watch(self, resp: Any) -> None:
        self._watch_resp = resp
        if self._stopping.is_set():
            resp.shutdown()

    def _mine(self, pod: Mapping[str, Any]) -> bool:
        return self.namespaces is None or pod["metadata"].get("namespace") in self.namespaces

    def _observe(self, pod: dict[str, Any] | None, uid: str) -> None:
        with self._lock:
            if pod is None:
                self._cache.pop(uid, None)
            else:
                self._cache[uid] = pod
            worker = self._workers.get(uid)
        if pod is None:
            if worker is not None:
                worker.gone()
            return
        spec = pod.get("spec") or {}
        if spec.get("nodeName") == self.name and self._mine(pod) and not self._stopping.is_set():
            if worker is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    return
                worker = _PodWorker(self, pod)
                with self._lock:
                    self._workers[uid] = worker
                    self._assumed.pop(uid, None)
                self._log(f"pod {worker.ns}/{worker.name}: starting at {worker.ip}")
                worker.thread.start()
            worker.update(pod)
        elif not spec.get("nodeName"):
            self._wake_scheduler.set()

    def _worker_done(self, uid: str) -> None:
        with self._lock:
            self._workers.pop(uid, None)
        self._wake_scheduler.set()

    # --- scheduling ---

    def _used(self) -> tuple[dict[str, Decimal], int]:
        used: dict[str, Decimal] = {}
        count = 0
        with self._lock:
            pods = [
                _requests(p)
                for p in self._cache.values()
                if (p.get("spec") or {}).get("nodeName") == self.name
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            ]
            pods += list(self._assumed.values())
        for req in pods:
            count += 1
            for k, v in req.items():
                used[k] = used.get(k, Decimal(0)) + v
        return used, count

    def _why_not(self, pod: Mapping[str, Any], used: Mapping[str, Decimal], count: int) -> str | None:
        """None when the pod fits this node; else the scheduler's reason."""
        spec = pod.get("spec") or {}
        selector = spec.get("nodeSelector") or {}
        if any(self.labels.get(k) != v for k, v in selector.items()):
            return "node(s) didn't match node selector"
        required = (
            ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution"
            )
            or {}
        ).get("nodeSelectorTerms")
        if required and not any(_selector_term_matches(t, self.labels, self.name) for t in required):
            return "node(s) didn't match node selector"
        for taint in self.taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
                spec.get("tolerations") or [], taint
            ):
                shown = taint["key"] + (f": {taint['value']}" if taint.get("value") else "")
                return f"node(s) had taint {{{shown}}}, that the pod didn't tolerate"
        if count + 1 > int(self.capacity["pods"]):
            return "Too many pods"
        for res, want in sorted(_requests(pod).items()):
            if want and used.get(res, Decimal(0)) + want > parse_quantity(self.capacity.get(res, "0")):
                return f"Insufficient {res}"
        return None

    def _scheduler_loop(self) -> None:
        next_heartbeat = time.monotonic() + 10.0
        while not self._stopping.is_set():
            self._wake_scheduler.wait(0.5)
            self._wake_scheduler.clear()
            if self._stopping.is_set():
                return
            try:
                if time.monotonic() >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + 10.0
                self._schedule()
            except (KubeError, OSError, urllib3.exceptions.HTTPError) as e:
                self._log(f"scheduler: {e!r}")
                self._stopping.wait(0.5)

    def _schedule(self) -> None:
        with self._lock:
            pending = [
                p
                for p in self._cache.values()
                if not (p.get("spec") or {}).get("nodeName")
                and not p["metadata"].get("deletionTimestamp")
                and (p.get("spec") or {}).get("schedulerName", "default-scheduler") == "default-scheduler"
                and (p.get("status") or {}).get("phase", "Pending") == "Pending"
                and self._mine(p)
            ]
        pending.sort(key=lambda p: p["metadata"].get("creationTimestamp", ""))
        for pod in pending:
            meta = pod["metadata"]
            uid = meta["uid"]
            used, count = self._used()
            reason = self._why_not(pod, used, count)
            ns, name = meta["namespace"], meta["name"]
            if reason is None:
                binding = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name, "uid": uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.name},
                }
                try:
                    self.api.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/binding", binding)
                except KubeError as e:
                    if e.status not in (404, 409):  # gone, or bound by another node first
                        raise
                    continue
                with self._lock:
                    self._assumed[uid] = _requests(pod)
                self._log(f"pod {ns}/{name}: bound to {self.name}")
            elif self._unschedulable.get(uid) != reason:
                self._unschedulable[uid] = reason
                scheduled = {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": f"0/1 nodes are available: 1 {reason}.",
                    "lastProbeTime": None,
                    "lastTransitionTime": _now(),
                }
                # The resourceVersion makes it conditional: a pod bound meanwhile (by another
                # played node) keeps its PodScheduled=True.
                patch = {
                    "metadata": {"resourceVersion": meta["resourceVersion"]},
                    "status": {"conditions": [scheduled]},
                }
                with contextlib.suppress(KubeError):
                    self.api.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status", patch)
                self._log(f"pod {ns}/{name}: unschedulable on {self.name}: {reason}")


@contextlib.contextmanager
def played_node(
    cluster: Cluster,
    *,
    name: str = "node-1",
    labels: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
    capacity: Mapping[str, str] | None = None,
    images: Mapping[str, Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
    namespaces: Sequence[str] | None = None,
    probe_period_cap_s: float = 0.5,
    initial_delay_cap_s: float | None = None,
    max_restart_backoff_s: float = 5.0,
) -> Iterator[PlayedNode]:
    """A `PlayedNode` registered and watching; on exit every process it started has ended.

    `images` maps an image reference (or its name without digest/tag) to its entrypoint argv;
    `env` is added to every process's environment (under the container's own env);
    `namespaces` limits the pods it schedules and runs (default: all);
    `probe_period_cap_s` caps every probe's periodSeconds, `initial_delay_cap_s` (None: as
    given) its initialDelaySeconds; `max_restart_backoff_s` caps the restart backoff, which
    starts at 0.2 s and doubles per restart."""
    node = PlayedNode(
        cluster,
        name=name,
        labels=labels,
        taints=taints,
        capacity=capacity,
        images=images,
        env=env,
        namespaces=namespaces,
        probe_period_cap_s=probe_period_cap_s,
        initial_delay_cap_s=initial_delay_cap_s,
        max_restart_backoff_s=max_restart_backoff_s,
    )
    try:
        node.start()
        yield node
    finally:
        node.stop()
