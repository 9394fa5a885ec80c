"""LocalDriver against real launcher processes of the tiny package, with the simulated engine.

Each replica is `python -m paved.launcher.main tiny_package.tar --child-cmd "<sim frontend>"`:
the package is materialized for real, the engine is paved.engine.sim (seconds, no model). Every
test deletes what it started and checks that no process carrying a replica marker is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from paved.control_plane.driver import PortsExhausted, ReplicaRequest
from paved.control_plane.errors import BadRequest
from paved.control_plane.local_driver import MARKER_ENV, LocalDriver
from paved.control_plane.probes import probe_live, probe_ready
from paved.control_plane.types import Replica
from paved.metrics.gauges import scrape
from paved.procs import marked_processes, proc_start_time
from paved.runfiles import runfile
from paved.testing.ports import port_block


def marked(marker: str) -> dict[int, str]:
    return marked_processes(MARKER_ENV, marker)


SIM = "sim://tiny?tokens_per_s=0"


def tiny_package() -> str:
    return runfile("services/launcher/tiny_package.tar")


def request(rid: str, **kw) -> ReplicaRequest:
    fields = dict(
        replica_id=rid,
        deployment_id="dep_1",
        model_id="tiny",
        version="1",
        package_uri=tiny_package(),
        region="local",
        engine=SIM,
    )
    fields.update(kw)
    return ReplicaRequest(**fields)  # type: ignore[arg-type]


async def read_log(replica: Replica) -> str:
    return await asyncio.to_thread(Path(replica.driver_ref["log"]).read_text, errors="replace")


async def wait_ready(replica: Replica, driver: LocalDriver, rounds: int = 600) -> None:
    reason = ""
    for _ in range(rounds):
        ok, reason = await probe_ready(replica, model_id="tiny", timeout_s=5)
        if ok:
            return
        if not await driver.alive(replica):
            log = (await read_log(replica))[-3000:]
            raise AssertionError(f"launcher exited: {await driver.exit_reason(replica)}\n{log}")
        await asyncio.sleep(0.2)
    raise AssertionError(f"not ready: {reason}")


@pytest.fixture
def cleanup():
    """Replicas to delete at the end whatever happens, then no marked process may remain."""
    started: list[Replica] = []
    yield started

    async def reap() -> None:
        driver = LocalDriver("local", port_range=(1024, 1024), work_dir=Path("/nonexistent"))
        for r in started:
            await driver.delete(r)

    asyncio.run(reap())
    for r in started:
        assert marked(r.driver_ref["marker"]) == {}, f"processes of {r.id} left behind"


def test_create_ready_metrics_drain(tmp_path: Path, cleanup: list[Replica]) -> None:
    lo, hi = port_block(6)

    async def go() -> None:
        driver = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        r = await driver.create(request("r1", kserve=True))
        cleanup.append(r)
        assert r.state == "starting"
        ports = r.driver_ref["ports"]
        assert set(ports) == {"http", "admin", "grpc", "metrics"}
        assert all(lo <= p <= hi for p in ports.values()) and len(set(ports.values())) == 4
        assert r.url == f"http://127.0.0.1:{ports['http']}"
        assert r.kserve_grpc == f"127.0.0.1:{ports['grpc']}"
        assert r.driver_ref["start_time"] == proc_start_time(r.driver_ref["pid"])
        await wait_ready(r, driver)  # admin ready + KServe ServerReady/ModelReady + JSON smoke
        assert await probe_live(r, driver) == (True, "live")
        # The launcher's metrics proxy on a port of its own, merging the frontend's /metrics.
        assert r.metrics_url == f"http://127.0.0.1:{ports['metrics']}/metrics"
        assert f"--metrics-port {ports['metrics']}" in await read_log(r)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(r.metrics_url, timeout=5).read())
        assert b"vllm:num_requests_waiting" in body
        assert b'paved_metrics_proxy_up{source="frontend"} 1.0' in body
        # What the autoscaler and the gateways read of it: the sim engine's gauges under the
        # replica's model, and the frontend's admission bound (merged by the proxy).
        m = await scrape(r.metrics_url, model_id="tiny")
        assert m.waiting == 0 and m.running == 0
        assert (m.queued, m.max_queued) == (0, 1024) and not m.full
        assert "paved launcher: ready: tiny:1" in await read_log(r)
        # The sim engine runs under the launcher with the replica's marker.
        assert len(marked(r.driver_ref["marker"])) >= 2

        await driver.drain(r, timeout_s=30)
        assert not await driver.alive(r)
        assert marked(r.driver_ref["marker"]) == {}
        ok, reason = await probe_live(r, driver)
        assert not ok and "gone" in reason
        ok, reason = await probe_ready(r, model_id="tiny", timeout_s=2)
        assert not ok and "/health/ready" in reason
        # The launcher drained cleanly (exit 0: SIGTERM, not the kill).
        assert "phase: stopped" in await read_log(r)
        await driver.close()

    asyncio.run(go())


def test_adopt_after_restart(tmp_path: Path, cleanup: list[Replica]) -> None:
    lo, hi = port_block(6)

    async def go() -> None:
        first = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        r = await first.create(request("r1"))
        cleanup.append(r)
        await wait_ready(r, first)
        await first.close()
        del first  # the control plane is gone; the replica keeps serving

        exited = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", "pass"])
        await asyncio.to_thread(exited.wait)
        gone_pid = Replica(
            id="r-dead", deployment_id="dep_1", region="local", state="ready", url="http://127.0.0.1:1",
            admin_url="http://127.0.0.1:1",
            driver_ref={"pid": exited.pid, "start_time": 1, "ports": {"http": 1}, "marker": "r-dead.x"},
        )  # fmt: skip
        me = os.getpid()
        wrong_start = (proc_start_time(me) or 0) + 1
        reused = Replica(
            id="r-reused", deployment_id="dep_1", region="local", state="ready", url="http://127.0.0.1:1",
            admin_url="http://127.0.0.1:1",
            driver_ref={"pid": me, "start_time": wrong_start, "ports": {}, "marker": "r-re.x"},
        )  # fmt: skip
        junk = Replica(
            id="r-junk", deployment_id="dep_1", region="local", state="ready", url="", admin_url=""
        )

        # A ref written before replicas had a metrics port ({"http", "admin"} only) is adopted too.
        old_ref = {
            **r.driver_ref,
            "ports": {k: v for k, v in r.driver_ref["ports"].items() if k != "metrics"},
        }
        old = dataclasses.replace(r, driver_ref=old_ref, metrics_url=r.url + "/metrics")

        second = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        adopted, gone = await second.adopt([old, gone_pid, reused, junk])
        assert [x.id for x in adopted] == ["r1"]
        assert [x.id for x in gone] == ["r-dead", "r-reused", "r-junk"]
        assert await second.alive(old)
        assert (await probe_ready(old, model_id="tiny", timeout_s=5))[0]
        # The metrics_url it was recorded with (the frontend's, through the gate) still answers.
        assert b"vllm:num_requests_waiting" in await asyncio.to_thread(
            lambda: urllib.request.urlopen(old.metrics_url, timeout=5).read()
        )
        # The adopted replica's ports stay reserved: 6 ports, 3 held (2 reserved, plus the metrics
        # port its launcher has bound), room for exactly one more.
        r2 = await second.create(request("r2"))
        cleanup.append(r2)
        assert set(r2.driver_ref["ports"].values()).isdisjoint(r.driver_ref["ports"].values())
        with pytest.raises(PortsExhausted):
            await second.create(request("r3"))
        await second.delete(r2)
        await second.delete(old)
        assert not await second.alive(old)
        assert marked(r.driver_ref["marker"]) == {}
        with pytest.raises(BadRequest):
            await second.adopt(
                [Replica(id="x", deployment_id="d", region="eu", state="ready", url="", admin_url="")]
            )

    asyncio.run(go())


def test_port_exhaustion_and_ports_in_use(tmp_path: Path, cleanup: list[Replica]) -> None:
    lo, hi = port_block(4)

    async def go() -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", lo))  # something else holds the first port of the range
            busy.listen()
            driver = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
            r = await driver.create(request("r1"))
            cleanup.append(r)
            assert sorted(r.driver_ref["ports"].values()) == [lo + 1, lo + 2, lo + 3]
            with pytest.raises(PortsExhausted) as e:
                await driver.create(request("r2"))
            assert e.value.status == 503 and e.value.code == "ports_exhausted"
            assert f"{lo}-{hi}" in e.value.message
            await driver.delete(r)
            # Deleting released the ports.
            r3 = await driver.create(request("r3"))
            cleanup.append(r3)
            await driver.delete(r3)
            assert not await driver.alive(r3)

    asyncio.run(go())


def test_start_failure_reason_and_bad_requests(tmp_path: Path, cleanup: list[Replica]) -> None:
    lo, hi = port_block(4)

    async def go() -> None:
        driver = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        r = await driver.create(request("r1", package_uri=str(tmp_path / "no-such-package")))
        cleanup.append(r)
        for _ in range(600):
            if not await driver.alive(r):
                break
            await asyncio.sleep(0.1)
        assert not await driver.alive(r)
        reason = await driver.exit_reason(r)
        assert reason is not None and "materializing" in reason, reason
        await driver.delete(r)

        bad = [
            request("r2", region="eu"),
            request("../escape"),
            request("r2", engine="sim://other"),
            request("r2", engine="vllm"),
            request("r2", model_id=""),
        ]
        for req in bad:
            with pytest.raises(BadRequest):
                await driver.create(req)
        for kw in ({"port_range": (10, 5)}, {"port_range": (80, 90)}, {"port_range": "x"}):
            with pytest.raises(BadRequest):
                LocalDriver("local", work_dir=tmp_path, **kw)  # type: ignore[arg-type]
        with pytest.raises(BadRequest):
            await driver.drain(r, timeout_s=float("nan"))
        # Nothing was started for the refused requests.
        assert not (tmp_path / "work" / "r2").exists()
        with contextlib.suppress(FileNotFoundError):
            assert "escape" not in os.listdir(tmp_path)

    asyncio.run(go())


def test_adopt_stops_a_replica_started_but_never_recorded(tmp_path: Path, cleanup: list[Replica]) -> None:
    """The control plane killed between a replica's spawn and its record: nothing would ever
    stop the process (adoption reads the records). The next adopt finds it by the marker file
    its work dir holds and stops it; a recorded replica beside it is adopted and kept."""
    lo, hi = port_block(6)

    async def go() -> None:
        first = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        kept = await first.create(request("r-kept"))
        cleanup.append(kept)
        lost = await first.create(request("r-lost"))
        cleanup.append(lost)
        assert marked(lost.driver_ref["marker"])
        await first.close()
        second = LocalDriver("local", port_range=(lo, hi), work_dir=tmp_path / "work")
        adopted, gone = await second.adopt([kept])  # r-lost has no record
        assert [r.id for r in adopted] == ["r-kept"] and gone == []
        assert marked(lost.driver_ref["marker"]) == {}
        assert marked(kept.driver_ref["marker"]) and await second.alive(kept)
        assert not (tmp_path / "work" / "r-lost" / "marker").exists()
        await second.delete(kept)

    asyncio.run(go())
