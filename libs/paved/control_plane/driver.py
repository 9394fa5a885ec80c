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
from dataclasses import dataclass
from typing import Protocol

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

    async def adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        """(still running: adopted, gone) after a control-plane restart."""
        ...

    async def close(self) -> None:
        """Forget the driver's resources; running replicas keep running (adopt finds them)."""
        ...
