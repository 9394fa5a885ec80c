"""Prometheus service discovery from the control plane: the target groups a fleet gives (ready
replicas only, labels, metrics paths), GET /v1/prometheus/targets behind the admin key, the
control plane's own /metrics, the file_sd writer, the control plane main's --prometheus-file-sd,
and `paved render prometheus` (a config promtool accepts; bad input exit 2)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from paved.cli.main import main as paved
from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.prometheus import (
    FileSdWriter,
    metrics_endpoint,
    prometheus_router,
    target_groups,
    write_file_sd,
)
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.control_plane.types import Deployment, DeploymentSpec, Replica
from paved.gateway.access.auth import AdminAuth

KEY = "admin-key-for-tests-0123456789"
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def _deployment(id: str, model: str, version: str) -> Deployment:
    return Deployment(id, DeploymentSpec(model, version, "/pkg"), {}, NOW, state="active")


def _replica(id: str, dep: str, state: str, metrics: str | None, region: str = "local") -> Replica:
    return Replica(id, dep, region, state, "http://127.0.0.1:1", "http://127.0.0.1:2", metrics_url=metrics)  # type: ignore[arg-type]


def test_target_groups_list_ready_replicas_gateways_and_the_control_plane() -> None:
    deps = [_deployment("d1", "tiny", "v1"), _deployment("d2", "tiny", "v2"), _deployment("d3", "big", "v1")]
    replicas = [
        _replica("r3", "d2", "ready", "http://127.0.0.1:30012/metrics", region="west"),
        _replica("r1", "d1", "ready", "http://127.0.0.1:30002/metrics"),
        _replica("r2", "d1", "starting", "http://127.0.0.1:30005/metrics"),
        _replica("r4", "d1", "draining", "http://127.0.0.1:30006/metrics"),
        _replica("r5", "d3", "ready", None),  # no metrics endpoint: nothing to scrape
        _replica("r6", "gone", "ready", "http://127.0.0.1:30007/metrics"),  # unknown deployment
        _replica("r7", "d3", "ready", "not a url"),  # a bad record hides nothing else
        _replica("r8", "d3", "ready", "https://10.0.0.5:9400/x/metrics?format=text"),
    ]
    groups = target_groups(deps, replicas, ["http://127.0.0.1:8080/metrics"], "http://127.0.0.1:8090/metrics")
    assert groups == [
        {
            "targets": ["10.0.0.5:9400"],
            "labels": {
                "__metrics_path__": "/x/metrics",
                "__scheme__": "https",
                "__param_format": "text",
                "paved_role": "replica",
                "paved_model": "big",
                "paved_version": "v1",
                "paved_region": "local",
                "paved_replica": "r8",
            },
        },
        {
            "targets": ["127.0.0.1:30002"],
            "labels": {
                "__metrics_path__": "/metrics",
                "paved_role": "replica",
                "paved_model": "tiny",
                "paved_version": "v1",
                "paved_region": "local",
                "paved_replica": "r1",
            },
        },
        {
            "targets": ["127.0.0.1:30012"],
            "labels": {
                "__metrics_path__": "/metrics",
                "paved_role": "replica",
                "paved_model": "tiny",
                "paved_version": "v2",
                "paved_region": "west",
                "paved_replica": "r3",
            },
        },
        {"targets": ["127.0.0.1:8080"], "labels": {"__metrics_path__": "/metrics", "paved_role": "gateway"}},
        {
            "targets": ["127.0.0.1:8090"],
            "labels": {"__metrics_path__": "/metrics", "paved_role": "control_plane"},
        },
    ]
    # The same fleet in another order gives the same document.
    assert (
        target_groups(
            deps[::-1], replicas[::-1], ["http://127.0.0.1:8080/metrics"], "http://127.0.0.1:8090/metrics"
        )
        == groups
    )
    for group in groups:
        assert all(value for value in group["labels"].values())


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1:1/metrics", "http:///metrics", "http://h:99999/m", "http://h:1/m?a-b=1"]
)
def test_bad_metrics_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="metrics URL"):
        metrics_endpoint(url)


def test_metrics_endpoint_defaults() -> None:
    assert metrics_endpoint("http://gw.internal/metrics") == metrics_endpoint("http://gw.internal:80/metrics")
    assert metrics_endpoint("http://[::1]:9/").target == "[::1]:9"
    assert metrics_endpoint("http://h:9").labels == {"__metrics_path__": "/metrics"}


def test_file_sd_is_rewritten_only_when_the_fleet_changes(tmp_path: Path) -> None:
    path = tmp_path / "paved.json"
    fleet: list[Any] = [{"targets": ["127.0.0.1:1"], "labels": {"paved_role": "gateway"}}]

    async def produce() -> list[Any]:
        return list(fleet)

    async def scenario() -> list[bool]:
        writer = FileSdWriter(path, produce, interval_s=1.0)
        done = [await writer.refresh(), await writer.refresh()]
        fleet.append({"targets": ["127.0.0.1:2"], "labels": {"paved_role": "gateway"}})
        done.append(await writer.refresh())
        return done

    assert asyncio.run(scenario()) == [True, False, True]
    assert json.loads(path.read_text()) == fleet
    assert [p.name for p in tmp_path.iterdir()] == ["paved.json"]  # no temporary file left
    with pytest.raises(ValueError):
        FileSdWriter(path, produce, interval_s=0)


def test_a_failed_write_keeps_the_last_good_file(tmp_path: Path) -> None:
    path = tmp_path / "sd.json"
    write_file_sd(path, [])
    with pytest.raises(TypeError):
        write_file_sd(path, [{"targets": [object()]}])  # not JSON: nothing replaces the file
    assert json.loads(path.read_text()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["sd.json"]


# -- the API ------------------------------------------------------------------------------------


@pytest.fixture
def plane(tmp_path: Path):
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31600, 31620), work_dir=tmp_path / "work")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
    router = prometheus_router(
        store,
        AdminAuth(KEY).check,
        gateway_metrics=["http://127.0.0.1:8080/metrics"],
        control_plane_metrics=lambda: "http://127.0.0.1:8090/metrics",
    )
    app = create_app(store, controller, feed, AdminAuth(KEY).check, extra_routers=[router])
    asyncio.run(store.start())
    with TestClient(app) as c:
        yield c, store


def test_targets_need_the_admin_key(plane) -> None:
    client, _ = plane
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/v1/prometheus/targets", headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_targets_follow_the_store_and_metrics_count_it(plane) -> None:
    client, store = plane
    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.get("/v1/prometheus/targets", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert [g["labels"]["paved_role"] for g in r.json()] == ["gateway", "control_plane"]

    async def add() -> None:
        d = await store.create_deployment(DeploymentSpec("tiny", "v1", "/pkg"), {})
        await store.set_desired(d.id, "local", 2)
        await store.add_replica(_replica("rep-a", d.id, "ready", "http://127.0.0.1:30002/metrics"))
        await store.add_replica(_replica("rep-b", d.id, "starting", "http://127.0.0.1:30003/metrics"))
        await store.create_rollout("tiny", None, "v1", "red_black", {})

    asyncio.run(add())
    groups = client.get("/v1/prometheus/targets", headers=auth).json()
    assert [(g["targets"], g["labels"]["paved_role"]) for g in groups] == [
        (["127.0.0.1:30002"], "replica"),
        (["127.0.0.1:8080"], "gateway"),
        (["127.0.0.1:8090"], "control_plane"),
    ]
    assert groups[0]["labels"]["paved_replica"] == "rep-a"

    # /metrics is open, like every paved process' (Prometheus scrapes without the key).
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }
    assert (
        samples[
            (
                "paved_control_plane_replicas",
                (("model", "tiny"), ("region", "local"), ("state", "ready"), ("version", "v1")),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "paved_control_plane_replicas",
                (("model", "tiny"), ("region", "local"), ("state", "starting"), ("version", "v1")),
            )
        ]
        == 1
    )
    assert samples[("paved_control_plane_rollouts", (("model", "tiny"), ("status", "running")))] == 1
    assert samples[("paved_control_plane_leader", ())] == 1
    assert (
        samples[
            (
                "paved_control_plane_desired_replicas",
                (("model", "tiny"), ("region", "local"), ("version", "v1")),
            )
        ]
        == 2
    )


# -- the control plane main ---------------------------------------------------------------------


def _wait_for(path: Path, proc: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, "the control plane exited"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_the_main_writes_file_sd_and_serves_the_same_targets(tmp_path: Path) -> None:
    sd = tmp_path / "sd" / "paved.json"
    sd.parent.mkdir()
    env = {**os.environ, "PAVED_ADMIN_KEY": KEY, "PAVED_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "paved.control_plane.server", "--port", "0",
            "--region", "local=31700-31720", "--interval", "0.2",
            "--gateway-metrics", "http://127.0.0.1:8080/metrics",
            "--prometheus-file-sd", str(sd),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            if line.startswith(b"serving control plane on "):
                url = line.split()[-1].decode()
                break
        assert url, "the control plane exited before serving"
        _wait_for(sd, proc)
        from_file = json.loads(sd.read_text())
        served = httpx.get(
            url + "/v1/prometheus/targets", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
        )
        assert served.status_code == 200
        assert from_file == served.json()
        port = url.rsplit(":", 1)[1]
        assert from_file[-1] == {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {"__metrics_path__": "/metrics", "paved_role": "control_plane"},
        }
        own = httpx.get(url + "/metrics", timeout=10)
        assert own.status_code == 200 and "paved_control_plane_leader" in own.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--prometheus-file-sd", "/nonexistent-dir/x.json", "--prometheus-file-sd"),
        ("--gateway-metrics", "ftp://127.0.0.1:1/metrics", "--gateway-metrics"),
    ],
)
def test_the_main_refuses_bad_flags(tmp_path: Path, flag: str, value: str, message: str) -> None:
    env = {**os.environ, "PAVED_ADMIN_KEY": KEY, "PAVED_STATE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "paved.control_plane.server", "--port", "0", flag, value],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr


# -- paved render prometheus --------------------------------------------------------------------


def test_render_prometheus_prints_a_config_promtool_accepts(tmp_path: Path, capsys) -> None:
    key = tmp_path / "admin-key"
    key.write_text(KEY)
    assert (
        paved(
            [
                "render",
                "prometheus",
                "--control-plane",
                "http://127.0.0.1:8090",
                "--credentials-file",
                str(key),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    config = yaml.safe_load(out)
    (job,) = config["scrape_configs"]
    assert job["http_sd_configs"] == [
        {
            "url": "http://127.0.0.1:8090/v1/prometheus/targets",
            "refresh_interval": "15s",
            "authorization": {"type": "Bearer", "credentials_file": str(key)},
        }
    ]
    assert "authorization" not in job  # the key is for discovery, never sent to the replicas
    assert config["rule_files"] and config["rule_files"][0].endswith("ops/prometheus/rules/*.yml")
    (tmp_path / "prometheus.yml").write_text(out)
    result = subprocess.run(
        ["/usr/bin/promtool", "check", "config", "--syntax-only", "prometheus.yml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

    assert (
        paved(["render", "prometheus", "--file-sd", "/var/lib/paved/sd.json", "--rule-files", "r.yml"]) == 0
    )
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/var/lib/paved/sd.json"]
    assert config["rule_files"] == ["r.yml"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scrape-interval", "5"], "scrape interval"),
        (["--scrape-interval", "1m"], "at most 15s"),
        (["--scrape-interval", "16s"], "at most 15s"),
        (["--control-plane", "ftp://x"], "--control-plane"),
        (["--file-sd", "x.json", "--control-plane", "http://127.0.0.1:1"], "--file-sd"),
        (["--output", "json"], "--output"),
        (["--job-name", "a b"], "job name"),
    ],
)
def test_render_prometheus_bad_input_exits_2(capsys, args: list[str], message: str) -> None:
    assert paved(["render", "prometheus", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err
