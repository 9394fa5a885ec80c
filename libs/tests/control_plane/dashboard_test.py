"""The dashboard's server side: the summary endpoint's JSON against the control-plane main over
the simulated engine (real launchers, a real gateway following its routes, requests through it),
the admin key on every data call, the static assets with their content types and a closed list
of names, and the pure pieces (gateway usage parsing, the traffic split) on hand-made inputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from fleet import first_deploy, make_fleet

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.dashboard import _merge_usage, dashboard_router, parse_gateway_usage, traffic_split
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.gateway.access.auth import AdminAuth
from paved.gateway.metrics import GatewayMetrics

KEY = "admin-key-for-tests-0123456789"


@pytest.fixture
def client(tmp_path: Path):
    """A control plane in-process with no fleet and no --gateway-metrics."""
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31540, 31560), work_dir=tmp_path / "work")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
    check = AdminAuth(KEY).check
    app = create_app(
        store, controller, feed, check, extra_routers=[dashboard_router(store, controller, check)]
    )
    asyncio.run(store.start())
    with TestClient(app) as c:
        yield c


def test_static_assets_are_served_with_their_types_and_nothing_else(client):
    r = client.get("/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    html = r.text
    assert '<script src="/dashboard/static/app.js"' in html and "/dashboard/static/style.css" in html
    # Self-contained: no external URL in any asset (the SVG namespace is an identifier, not a fetch).
    for body in (
        html,
        client.get("/dashboard/static/app.js").text,
        client.get("/dashboard/static/style.css").text,
    ):
        assert "https://" not in body
        assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")
    assert client.get("/dashboard/static/app.js").headers["content-type"] == "text/javascript; charset=utf-8"
    assert client.get("/dashboard/static/style.css").headers["content-type"] == "text/css; charset=utf-8"
    for bad in ("index.html", "nope.js", "..%2Fdashboard.py", "%2e%2e%2fapi.py"):
        assert client.get(f"/dashboard/static/{bad}").status_code == 404, bad


def test_summary_needs_the_admin_key(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.get("/dashboard/api/summary", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["message"]
    r = client.get("/dashboard/api/summary", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["deployments"] == [] and body["replicas"] == [] and body["traffic"] == []
    assert body["regions"] == ["local"]
    assert body["gateway"]["configured"] is False
    assert "no gateway metrics configured" in body["gateway"]["message"]


def test_gateway_usage_per_tenant_and_cache_results():
    m = GatewayMetrics()  # the gateway's own registry: the exposition the dashboard reads
    m.requests.labels("a", "m", "b1", "200").inc(7)
    m.requests.labels("a", "m", "b2", "503").inc(2)
    m.requests.labels("b", "m", "b1", "200").inc(1)
    m.cache.labels("a", "m", "exact").inc(3)
    m.cache.labels("a", "m", "miss").inc(1)
    m.cache.labels("b", "m", "bypass").inc(5)
    text = m.render().decode()
    usage = parse_gateway_usage(text)
    assert usage["tenants"] == {"a": {"requests": 9.0, "errors": 2.0}, "b": {"requests": 1.0, "errors": 0.0}}
    assert usage["cache"] == {"exact": 3.0, "miss": 1.0, "bypass": 5.0}


def test_gateway_queue_depth_and_wait_per_model_and_tenant_summed_over_gateways():
    parts = []
    for waiting in (2, 3):  # two gateway replicas, each with a queue of its own
        m = GatewayMetrics()
        m.queue_depth.labels("m", "a").set(waiting)
        m.queue_wait.labels("m", "a").observe(0.5)
        m.queue_wait.labels("m", "a").observe(1.5)
        m.queue_wait.labels("m", "b").observe(0.0)
        parts.append(parse_gateway_usage(m.render().decode()))
    queue = _merge_usage(parts)["queue"]
    assert queue == [
        {"model": "m", "tenant": "a", "waiting": 5.0, "mean_wait_s": 1.0},
        {"model": "m", "tenant": "b", "waiting": 0.0, "mean_wait_s": 0.0},
    ]


def test_traffic_split_is_the_weight_share_per_alias_and_region():
    routes = {
        "models": [
            {
                "alias": "m",
                "strategy": "weighted",
                "backends": [
                    {"id": "1", "url": "1", "version": "v1", "weight": 50, "region": "eu"},
                    {"id": "2", "url": "2", "version": "v2", "weight": 50, "region": "eu"},
                    {"id": "3", "url": "3", "version": "v2", "weight": 50, "region": "eu"},
                    {"id": "4", "url": "4", "version": "v1", "weight": 1.0, "region": "us"},
                    {"id": "5", "url": "5", "version": "v2", "weight": 0.0, "region": "us"},
                ],
            }
        ]
    }
    split = {(t["alias"], t["region"]): t["versions"] for t in traffic_split(routes)}
    eu = {v["version"]: v for v in split[("m", "eu")]}
    assert eu["v1"]["backends"] == 1 and eu["v2"]["backends"] == 2
    assert eu["v1"]["share"] == pytest.approx(1 / 3) and eu["v2"]["share"] == pytest.approx(2 / 3)
    us = {v["version"]: v["share"] for v in split[("m", "us")]}
    assert us == {"v1": 1.0, "v2": 0.0}
    assert traffic_split(None) == []


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def test_summary_over_a_fleet_on_the_simulated_engine(fleet):
    # A port range of its own: tests run in parallel, and replicas bind only once ready.
    cp, gw, key = fleet(("local=31500-31549",))
    first_deploy(cp, gw, key)
    for _ in range(4):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    assert httpx.get(cp.url + "/dashboard/api/summary", timeout=10).status_code == 401

    def summary():
        return cp.api("GET", "/dashboard/api/summary")

    # The gateway counts a request after its answer; the summary reads its /metrics each poll.
    def counted():
        s = summary()
        tenants = {t["tenant"]: t for t in s["gateway"].get("tenants", [])}
        return s if tenants.get("team", {}).get("requests", 0) >= 5 else None  # 4 + first_deploy's probe

    s = cp.wait_for("the tenant's requests in the summary", counted, timeout_s=30)
    (d,) = s["deployments"]
    assert (d["model_id"], d["version"], d["state"], d["strategy"]) == ("tiny", "v1", "active", "red_black")
    assert d["desired"] == {"local": 1}
    ready = [r for r in s["replicas"] if r["state"] == "ready"]
    assert len(ready) == 1 and ready[0]["version"] == "v1" and ready[0]["region"] == "local"
    gauges = ready[0]["gauges"]
    assert gauges is not None and "error" not in gauges, gauges
    assert gauges["waiting"] >= 0 and gauges["running"] >= 0 and 0 <= gauges["kv_usage"] <= 1
    (t,) = s["traffic"]
    assert (t["alias"], t["region"]) == ("tiny", "local")
    assert [(v["version"], v["share"]) for v in t["versions"]] == [("v1", 1.0)]
    assert s["routes_revision"] >= 1
    (ro,) = s["rollouts"]
    assert ro["status"] == "succeeded" and ro["to_version"] == "v1" and ro["from_version"] is None
    kinds = [e["kind"] for e in s["audit"]]
    assert "deployment.created" in kinds and "rollout.created" in kinds
    ids = [e["id"] for e in s["audit"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert s["gateway"]["configured"] is True and s["gateway"]["errors"] == []
    assert all(k in ("exact", "semantic", "miss", "bypass") for k in s["gateway"]["cache"])
    # A second summary reads only new audit events: the tail neither repeats nor loses any.
    cp.api("PATCH", "/v1/deployments/tiny/v1", {"replicas": 1})
    s2 = summary()
    ids2 = [e["id"] for e in s2["audit"]]
    assert ids2[: len(ids)] == ids and len(set(ids2)) == len(ids2)
    assert s2["audit"][-1]["kind"] == "scale"
