"""How the control plane starts and stops replicas: the `Driver` protocol, one driver per region.

Invariants every driver keeps:
- `create` returns at once with a replica in state "starting"; the replica becomes ready only
  when `paved.control_plane.probes.probe_ready` says so (the driver never decides readiness).
- A replica's addresses may be unknown at `create` (a Kubernetes pod has no IP until it is
  scheduled): its urls are then "" and `locate` returns them once known. The controller stores
  what `locate` returns and probes a replica only once it has an admin url. Addresses never
  change after they are known (a pod keeps its IP for its whole life).
- A replica's `driver_ref` is all a driver needs to find its process again: a control plane
  that restarts builds a new driver and calls `adopt` with the replicas its store remembers.
- `alive` is true only for the very process the driver started (a reused pid is not alive).
- `drain` and `delete` leave no process of the replica behind (engine children included).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Protocol

from paved.control_plane.errors import BadRequest, ControlError
from paved.control_plane.types import Replica

# Replica ids name directories and appear in process environments: keep them plain.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME = re.compile(r"^[^\s\x00-\x1f]{1,256}$")


class PortsExhausted(ControlError):
    """Every port of the region's range is taken (by replicas or by other programs)."""

    def __init__(self, message: str):
        super().__init__(503, message, code="ports_exhausted", headers={"Retry-After": "5"})


@dataclass(frozen=True)
class ReplicaRequest:
    """One replica to start. `engine` is "package" (the package's own engine) or a
    `sim://MODEL?...` URI (the package is materialized as usual, the engine is simulated)."""

    replica_id: str
    deployment_id: str
    model_id: str
    version: str
    package_uri: str
    region: str
    engine: str = "package"
    kserve: bool = False  # also open a KServe v2 gRPC port
    # The package's kind (its fingerprint's): "kserve" is a classic model the launcher serves
    # through paved.kserve (HTTP and gRPC are both KServe v2), never the paved frontend.
    kind: str = "generate"
    # Accelerators one replica needs (the package's tensor x pipeline parallel size, from its
    # fingerprint's "resources"); a cluster driver requests them, the local driver ignores it.
    gpus: int = 0
    # The deployment's placement (node_selector, tolerations: store.validate_placement), for a
    # cluster driver; the local driver ignores it.
    placement: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """BadRequest naming the field when a value is unusable."""
        if not isinstance(self.replica_id, str) or not _ID.match(self.replica_id):
            raise BadRequest(f"replica_id must match {_ID.pattern}, got {self.replica_id!r}")
        for name in ("deployment_id", "model_id", "version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _NAME.match(value):
                raise BadRequest(f"{name} must be a non-empty string without spaces, got {value!r}")
        if not isinstance(self.package_uri, str) or not self.package_uri.strip():
            raise BadRequest("package_uri must be a non-empty string")
        if not isinstance(self.region, str) or not self.region:
            raise BadRequest("region must be a non-empty string")
        if not isinstance(self.engine, str) or not (
            self.engine == "package" or self.engine.startswith("sim://")
        ):
            raise BadRequest(f"engine must be 'package' or a sim:// URI, got {self.engine!r}")
        if not isinstance(self.kserve, bool):
            raise BadRequest(f"kserve must be a boolean, got {self.kserve!r}")
        if self.kind not in ("generate", "embed", "kserve"):
            raise BadRequest(f"kind must be 'generate', 'embed' or 'kserve', got {self.kind!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 0 <= self.gpus <= 1024:
            raise BadRequest(f"gpus must be an integer in [0, 1024], got {self.gpus!r}")
        if not isinstance(self.placement, dict):
            raise BadRequest(f"placement must be an object, got {self.placement!r:.80}")
        if self.kind == "kserve" and not self.kserve:
            raise BadRequest("a kserve replica needs kserve=true (its gRPC port)")
        if self.kind == "kserve" and self.engine != "package":
            raise BadRequest("a kserve replica serves its package's model: engine must be 'package'")


class Driver(Protocol):
    """Starts and stops the replicas of one region."""

    region: str

    async def create(self, req: ReplicaRequest) -> Replica:
        """Start a replica in the background; returns it in state "starting" at once."""
        ...

    async def drain(self, replica: Replica, timeout_s: float = 30.0) -> None:
        """SIGTERM (in-flight requests finish), wait up to timeout_s, then kill what is left."""
        ...

    async def delete(self, replica: Replica) -> None:
        """Kill now and reap."""
        ...

    async def locate(self, replica: Replica) -> Replica:
        """`replica` with the addresses (and driver_ref) it has now; unchanged when nothing
        new is known. Never blocks on the replica's start."""
        ...

    async def alive(self, replica: Replica) -> bool:
        """The replica's process exists and is the same process (pid + start time)."""
        ...

    async def exit_reason(self, replica: Replica) -> str | None:
        """Why the replica is not serving, in one line an operator can act on: its launcher's
        failure, or what its pod's status says (its container's last termination, which a
        crash-looping pod has while it still counts as alive; a container stuck waiting for its
        image; an eviction; no node to schedule it on). None when nothing is wrong that the
        driver can see. Reads what the driver already holds (no remote call) and never raises
        for a replica of another driver."""
        ...

    async def adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        """(still running: adopted, gone) after a control-plane restart."""
        ...

    async def retire(self, deployment_id: str) -> None:
        """The deployment is deleted and none of its replicas runs: remove what the driver keeps
        for it besides replicas (a cluster's Deployment, Service, PDB). Idempotent."""
        ...

    async def close(self) -> None:
        """Forget the driver's resources; running replicas keep running (adopt finds them)."""
        ...


def launcher_failure(log_tail: str) -> str | None:
    """The launcher's own account of why it stopped: the last "launcher: ... failed: ..." line
    of `log_tail`, without its prefix; None when it wrote none."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith("launcher: ") and "failed: " in line:
            return line[len("launcher: ") :]
    return None


def port_names(req: ReplicaRequest) -> tuple[str, ...]:
    """What each of a replica's ports is for, in allocation order (metrics last: index 2 stays
    gRPC's place)."""
    return ("http", "admin", *(("grpc",) if req.kserve else ()), "metrics")


def launcher_args(
    req: ReplicaRequest,
    *,
    host: str,
    ports: dict[str, int],
    cache_dir: str,
    metrics_dir: str,
    drain_timeout_s: float,
    s3_endpoint_url: str | None = None,
) -> list[str]:
    """The launcher's arguments (after `python -m paved.launcher.main`) for one replica: every
    driver runs the same launcher the same way, only where (host, ports, dirs) differs.
    `ports` maps each name of `port_names(req)` to its port."""
    argv = [
        req.package_uri,
        "--host", host, "--port", str(ports["http"]),
        "--admin-host", host, "--admin-port", str(ports["admin"]),
        "--cache-dir", cache_dir,
        "--metrics-dir", metrics_dir,
        "--metrics-host", host, "--metrics-port", str(ports["metrics"]),
        "--drain-timeout", str(drain_timeout_s),
        "--progress", "log",
    ]  # fmt: skip
    if s3_endpoint_url:
        argv += ["--s3-endpoint-url", s3_endpoint_url]
    if req.kserve:
        argv += ["--grpc-port", str(ports["grpc"])]

    # The launcher expands {placeholders} in --child-cmd: literal braces are doubled.
    def lit(s: str) -> str:
        return shlex.quote(s).replace("{", "{{").replace("}", "}}")

    drain = f"--drain-timeout {drain_timeout_s}"
    grpc = " --kserve-grpc-port {grpc_port}" if req.kserve else ""
    # The frontend serves the public HTTP port itself once ready (no relay in the launcher).
    handoff = " --listen-fd {http_fd}"
    if req.kind == "kserve":
        pass  # the launcher serves a kserve package through paved.kserve by itself
    elif req.engine.startswith("sim://"):
        argv += [
            "--child-cmd",
            f"{{python}} -m paved.frontend.server --engine {lit(req.engine)} --model {lit(req.model_id)} "
            f"--port {{http_port}} {drain}{grpc}{handoff}",
        ]
    elif req.kserve:
        # The paved frontend over the package's engine (the launcher's config names the model
        # dir, the engine args and the private HTTP port), plus its KServe listener.
        argv += ["--child-cmd", f"{{python}} -m paved.frontend.server --config {{config}}{grpc}{handoff}"]
    return argv
