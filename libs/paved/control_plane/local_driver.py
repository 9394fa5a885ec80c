"""Replicas as local launcher processes (`python -m paved.launcher.main`) on 127.0.0.1.

Each replica is one launcher in its own session (`start_new_session=True`): a control plane
that crashes leaves its replicas serving, and the next one adopts them from their
`driver_ref` = {"pid", "start_time" (/proc/<pid>/stat field 22, so a reused pid is never taken
for the replica), "ports", "marker", "log"}. "ports" names each port the replica holds: "http",
"admin", "grpc" (KServe only) and "metrics" (the launcher's --metrics-port, the replica's
`metrics_url`; a ref written before it existed has none, and its replica keeps the metrics_url
it was created with).

The launcher puts its engine in a session of its own too, so the launcher's process group does
not hold the engine. Every process of a replica instead inherits the environment variable
PAVED_REPLICA_MARKER=<marker> (unique per replica start); killing a replica kills every process
of this user carrying its marker, which also finds engines orphaned by a launcher that died.

Ports come from the region's `port_range`: never one another replica of this driver holds
(created or adopted), never one something else has bound right now. The launcher binds the
public ports only once the engine is ready, so an allocated port may look free for a while:
the reservation, not the socket, is what keeps two replicas apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from paved.control_plane.driver import (
    PortsExhausted,
    ReplicaRequest,
    launcher_args,
    launcher_failure,
    port_names,
)
from paved.control_plane.errors import BadRequest
from paved.control_plane.types import Replica
from paved.net import port_free
from paved.procs import marked_processes, proc_start_time

log = logging.getLogger(__name__)

MARKER_ENV = "PAVED_REPLICA_MARKER"
MARKER_FILE = "marker"  # in a replica's work dir: its processes' MARKER_ENV value
_HOST = "127.0.0.1"
# Bounds on the kill loop: a replica that keeps forking is still gone after this many rounds.
_KILL_ROUNDS = 50
_LOG_TAIL_BYTES = 64 * 1024


class _Ref:
    """A parsed driver_ref; None from `parse` when the record is not one of ours."""

    def __init__(self, pid: int, start_time: int, ports: dict[str, int], marker: str, log_path: str):
        self.pid, self.start_time, self.ports, self.marker, self.log = (
            pid,
            start_time,
            ports,
            marker,
            log_path,
        )

    @classmethod
    def parse(cls, ref: dict[str, Any]) -> _Ref | None:
        try:
            pid, start, ports, marker = ref["pid"], ref["start_time"], ref["ports"], ref["marker"]
        except (KeyError, TypeError):
            return None
        if not (isinstance(pid, int) and pid > 0 and isinstance(start, int) and isinstance(marker, str)):
            return None
        if not marker or not isinstance(ports, dict) or not all(isinstance(p, int) for p in ports.values()):
            return None
        return cls(pid, start, dict(ports), marker, str(ref.get("log", "")))


class LocalDriver:
    """The `Driver` of one region on this host (see paved.control_plane.driver)."""

    def __init__(
        self,
        region: str,
        *,
        port_range: tuple[int, int],
        work_dir: Path,
        cache_dir: Path | None = None,
        s3_endpoint_url: str | None = None,
        python: str = sys.executable,
        drain_timeout_s: float = 30.0,
    ):
        if not isinstance(region, str) or not region:
            raise BadRequest("region must be a non-empty string")
        try:
            lo, hi = (int(p) for p in port_range)
        except (TypeError, ValueError):
            raise BadRequest(f"port_range must be (low, high), got {port_range!r}") from None
        if not 1024 <= lo <= hi <= 65535:
            raise BadRequest(f"port_range must satisfy 1024 <= low <= high <= 65535, got {port_range!r}")
        if not (
            isinstance(drain_timeout_s, int | float)
            and math.isfinite(drain_timeout_s)
            and drain_timeout_s > 0
        ):
            raise BadRequest(f"drain_timeout_s must be a positive number, got {drain_timeout_s!r}")
        self.region = region
        self.port_range = (lo, hi)
        self.work_dir = Path(work_dir).absolute()
        self.cache_dir = Path(cache_dir).absolute() if cache_dir is not None else self.work_dir / "cache"
        self.s3_endpoint_url = s3_endpoint_url
        self.python = python
        self.drain_timeout_s = float(drain_timeout_s)
        self._lock = threading.Lock()  # guards _reserved (allocation runs in worker threads)
        self._reserved: dict[str, tuple[int, ...]] = {}  # replica id -> its ports
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # pid -> our child (to reap it)

    # -- create ------------------------------------------------------------------------------
    async def create(self, req: ReplicaRequest) -> Replica:
        req.validate()
        if req.region != self.region:
            raise BadRequest(
                f"replica {req.replica_id} is for region {req.region!r}, this driver runs {self.region!r}"
            )
        if req.engine.startswith("sim://"):
            named = urllib.parse.unquote(urllib.parse.urlsplit(req.engine).netloc)
            if named and named != req.model_id:
                raise BadRequest(
                    f"engine {req.engine!r} names model {named!r} but the replica serves {req.model_id!r}"
                )
        return await asyncio.to_thread(self._create, req)

    def _create(self, req: ReplicaRequest) -> Replica:
        ports = self._allocate(req.replica_id, len(port_names(req)))
        try:
            return self._spawn(req, ports)
        except BaseException:
            self._release(req.replica_id)
            raise

    def _allocate(self, replica_id: str, n: int) -> tuple[int, ...]:
        lo, hi = self.port_range
        with self._lock:
            if replica_id in self._reserved:
                raise BadRequest(f"replica {replica_id} already runs on this driver")
            taken = {p for ports in self._reserved.values() for p in ports}
            chosen: list[int] = []
            for port in range(lo, hi + 1):
                if port not in taken and port_free(port, _HOST):
                    chosen.append(port)
                    if len(chosen) == n:
                        self._reserved[replica_id] = tuple(chosen)
                        return tuple(chosen)
        raise PortsExhausted(
            f"region {self.region!r}: no {n} free ports in {lo}-{hi} for replica {replica_id} "
            f"({len(self._reserved)} replica(s) hold {len(taken)}, the rest are in use or too few); "
            "widen the port range or stop replicas"
        )

    def _release(self, replica_id: str) -> None:
        with self._lock:
            self._reserved.pop(replica_id, None)

    def _argv(self, req: ReplicaRequest, ports: tuple[int, ...], rdir: Path) -> list[str]:
        return [
            self.python, "-m", "paved.launcher.main",
            *launcher_args(
                req,
                host=_HOST,
                ports=dict(zip(port_names(req), ports, strict=True)),
                cache_dir=str(self.cache_dir),
                metrics_dir=str(rdir / "metrics"),
                drain_timeout_s=self.drain_timeout_s,
                s3_endpoint_url=self.s3_endpoint_url,
            ),
        ]  # fmt: skip

    def _spawn(self, req: ReplicaRequest, ports: tuple[int, ...]) -> Replica:
        rdir = self.work_dir / req.replica_id
        rdir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        log_path = rdir / "log"
        marker = f"{req.replica_id}.{secrets.token_hex(8)}"
        env = dict(os.environ)
        # The launcher (and the engine it starts) import paved from where this process does.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env[MARKER_ENV] = marker
        # Written before the spawn: a replica whose record never made it to the store (the
        # control plane killed in between) is still found, and stopped, by the next adopt.
        (rdir / MARKER_FILE).write_text(marker)
        argv = self._argv(req, ports, rdir)
        with open(log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(  # noqa: S603 - argv built above, no shell
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=rdir,
                start_new_session=True,  # outlives a control-plane crash; adopt finds it
            )
        start = proc_start_time(proc.pid)
        if start is None:  # exited already (e.g. the interpreter is missing)
            proc.wait()
            start = -1
        self._procs[proc.pid] = proc
        named = dict(zip(port_names(req), ports, strict=True))
        ref = {
            "pid": proc.pid,
            "start_time": start,
            "ports": named,
            "marker": marker,
            "log": str(log_path),
        }
        url = f"http://{_HOST}:{named['http']}"
        log.info(
            "replica %s (%s@%s): launcher pid %d on %s",
            req.replica_id,
            req.model_id,
            req.version,
            proc.pid,
            url,
        )
        return Replica(
            id=req.replica_id,
            deployment_id=req.deployment_id,
            region=self.region,
            state="starting",
            url=url,
            admin_url=f"http://{_HOST}:{named['admin']}",
            kserve_grpc=f"{_HOST}:{named['grpc']}" if req.kserve else None,
            # A classic model's HTTP port is KServe v2 HTTP; an LLM's with KServe on serves both
            # the OpenAI API and KServe v2 HTTP (under /v2), as Triton serves every model.
            kserve_http=url if req.kind == "kserve" or req.kserve else None,
            # The launcher's metrics proxy, not the frontend's /metrics through the gate: it also
            # answers while the replica starts or drains, and merges the engine's multiprocess
            # files (vLLM's own processes) with the frontend's families.
            metrics_url=f"http://{_HOST}:{named['metrics']}/metrics",
            driver_ref=ref,
        )

    # -- liveness ----------------------------------------------------------------------------
    async def locate(self, replica: Replica) -> Replica:
        """A local replica's ports are chosen at create: nothing more to learn."""
        return replica

    def _alive(self, ref: _Ref) -> bool:
        proc = self._procs.get(ref.pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(ref.pid, None)  # reaped: the pid may now be reused
            return False
        return proc_start_time(ref.pid) == ref.start_time

    async def alive(self, replica: Replica) -> bool:
        ref = _Ref.parse(replica.driver_ref)
        return ref is not None and await asyncio.to_thread(self._alive, ref)

    async def exit_reason(self, replica: Replica) -> str | None:
        """Why the replica's launcher stopped (its last "launcher: ... failed: ..." line), or
        None while it runs or when its log says nothing."""
        ref = _Ref.parse(replica.driver_ref)
        if ref is None:
            return "not a local replica (no driver_ref)"
        if await self.alive(replica):
            return None
        return await asyncio.to_thread(self._log_reason, ref)

    @staticmethod
    def _log_reason(ref: _Ref) -> str | None:
        try:
            with open(ref.log, "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - _LOG_TAIL_BYTES, 0))
                return launcher_failure(f.read().decode(errors="replace"))
        except OSError:
            return None

    # -- stop --------------------------------------------------------------------------------
    def _wait_gone(self, ref: _Ref, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while self._alive(ref):
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return True

    def _kill_all(self, ref: _Ref) -> None:
        """SIGKILL the launcher's group and every process carrying the replica's marker, until
        none is left (bounded), then reap the launcher if it is our child."""
        self._kill_marked(ref.marker, ref)
        proc = self._procs.pop(ref.pid, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _stop(self, replica: Replica, timeout_s: float | None) -> None:
        ref = _Ref.parse(replica.driver_ref)
        if ref is None:
            self._release(replica.id)
            return
        if timeout_s is not None and self._alive(ref):
            with contextlib.suppress(ProcessLookupError):
                os.kill(ref.pid, signal.SIGTERM)  # the launcher drains its engine
            if not self._wait_gone(ref, timeout_s):
                log.warning(
                    "replica %s did not stop within %.1fs of SIGTERM: killing it", replica.id, timeout_s
                )
        self._kill_all(ref)
        self._release(replica.id)

    async def drain(self, replica: Replica, timeout_s: float = 30.0) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise BadRequest(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        await asyncio.to_thread(self._stop, replica, float(timeout_s))

    async def delete(self, replica: Replica) -> None:
        await asyncio.to_thread(self._stop, replica, None)

    # -- restart -----------------------------------------------------------------------------
    def _adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        adopted, gone = [], []
        for r in replicas:
            ref = _Ref.parse(r.driver_ref)
            if ref is not None and self._alive(ref):
                with self._lock:
                    self._reserved[r.id] = tuple(ref.ports.values())
                adopted.append(r)
                continue
            if ref is not None:
                self._kill_all(ref)  # an engine orphaned by its dead launcher
            self._release(r.id)
            gone.append(r)
        self._reap_unrecorded({r.id for r in replicas})
        return adopted, gone

    def _reap_unrecorded(self, recorded: set[str]) -> None:
        """Stop the processes of every replica this work dir started that has no live record:
        one spawned as the control plane stopped, before its record was written."""
        with contextlib.suppress(OSError):
            for rdir in self.work_dir.iterdir():
                marker_file = rdir / MARKER_FILE
                if rdir.name in recorded or not marker_file.is_file():
                    continue
                with contextlib.suppress(OSError):
                    marker = marker_file.read_text().strip()
                    if marker and marked_processes(MARKER_ENV, marker):
                        log.warning("replica %s runs without a record: stopping it", rdir.name)
                        self._kill_marked(marker)
                    marker_file.unlink()  # nothing of it runs: never looked at again

    def _kill_marked(self, marker: str, launcher: _Ref | None = None) -> None:
        """SIGKILL every process carrying `marker`, and the `launcher`'s group when given,
        until none is left (bounded)."""
        for _ in range(_KILL_ROUNDS):
            pids = list(marked_processes(MARKER_ENV, marker))
            if launcher is not None and self._alive(launcher):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(launcher.pid, signal.SIGKILL)  # its own session: pgid == pid
                pids.append(launcher.pid)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if launcher is not None:
                self._wait_gone(launcher, 2.0)
            time.sleep(0.02)
        log.error("replica processes with marker %s survived %d kill rounds", marker, _KILL_ROUNDS)

    async def adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        wrong = [r.id for r in replicas if r.region != self.region]
        if wrong:
            raise BadRequest(f"replicas {wrong} are not in region {self.region!r}")
        return await asyncio.to_thread(self._adopt, list(replicas))

    async def retire(self, deployment_id: str) -> None:
        """A local deployment leaves nothing besides its replicas' processes."""

    async def close(self) -> None:
        """Forget everything; replicas keep running (a new driver adopts them)."""
        with self._lock:
            self._reserved.clear()
        self._procs.clear()
