"""The dashboard's server side: the summary endpoint's JSON against the control-plane main over
the simulated engine (real launchers, a real gateway following its routes, requests through it),
the admin key on every data call, the static assets with their content types and a closed list
of names, and the pure pieces (gateway usage parsing, the traffic split, the batch listing's
parse and merge) on hand-made inputs; a batch running through that gateway, its progress in the
gateway's admin listing (GET /admin/v1/batches: its key and input checks) and in the summary."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from fleet import first_deploy, make_fleet

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.dashboard import (
    BATCHES_SHOWN,
    _merge_usage,
    dashboard_router,
    gateway_origin,
    merge_batches,
    parse_gateway_batches,
    parse_gateway_usage,
    traffic_split,
)
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


def _batch(i: str, *, total=10, completed=0, failed=0, created_at=100.0, status="in_progress"):
    return {
        "id": i,
        "object": "batch",
        "tenant": "t",
        "model": "tiny",
        "endpoint": "/v1/chat/completions",
        "status": status,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "created_at": created_at,
        "finished_at": None,
        "age_s": 3.5,
    }


def test_gateway_batches_parse_into_progress_and_merge_once_newest_first():
    (row,) = parse_gateway_batches({"object": "list", "data": [_batch("b1", completed=6, failed=2)]})
    assert (row["id"], row["tenant"], row["status"]) == ("b1", "t", "in_progress")
    assert (row["total"], row["completed"], row["failed"], row["age_s"]) == (10, 6, 2, 3.5)
    assert row["done"] == pytest.approx(0.8)
    assert row["completed_share"] == pytest.approx(0.6) and row["failed_share"] == pytest.approx(0.2)
    (empty,) = parse_gateway_batches({"data": [_batch("b0", total=0)]})
    assert empty["done"] == 1.0 and empty["completed_share"] == empty["failed_share"] == 0.0
    # Counts that overshoot the total (a gateway mid-update) never draw past the bar's end.
    (over,) = parse_gateway_batches({"data": [_batch("b9", total=4, completed=3, failed=3)]})
    assert over["completed_share"] + over["failed_share"] == pytest.approx(1.0) and over["done"] == 1.0
    for bad in (
        [],
        {"data": {}},
        {"data": [{"id": "x"}]},
        {"data": [_batch("x", total=-1)]},
        {"data": [_batch("x", completed=True)]},
        {"data": [{**_batch("x"), "id": 7}]},
        {"data": [{**_batch("x"), "created_at": "yesterday"}]},
    ):
        with pytest.raises(ValueError):
            parse_gateway_batches(bad)
    # Two gateways on one database list the same batch: shown once, the most advanced reading kept.
    a = parse_gateway_batches(
        {"data": [_batch("b1", completed=1, created_at=1.0), _batch("b2", created_at=2.0)]}
    )
    b = parse_gateway_batches(
        {"data": [_batch("b1", completed=5, created_at=1.0), _batch("b3", created_at=3.0)]}
    )
    merged = merge_batches([a, b])
    assert [r["id"] for r in merged] == ["b3", "b2", "b1"] and merged[2]["completed"] == 5
    many = parse_gateway_batches({"data": [_batch(f"x{i}", created_at=i) for i in range(BATCHES_SHOWN + 5)]})
    assert len(merge_batches([many, many])) == BATCHES_SHOWN


def test_admin_batch_listing_pages_filters_and_counts(tmp_path: Path):
    """GET /admin/v1/batches over a gateway database holding batches of two tenants: newest
    first, bounded by limit with has_more, filtered by status (or "active"), line counts of an
    unfinished batch from its lines and of a finished one from its row."""
    from fastapi import FastAPI

    from paved.gateway.access.state import GatewayStore
    from paved.gateway.app import install_error_handlers
    from paved.gateway.batches.admin import admin_batch_routes
    from paved.gateway.batches.store import BatchStore, batches_table

    accounts = GatewayStore(f"sqlite:///{tmp_path / 'gw.sqlite'}")
    store = BatchStore(accounts)

    async def fill() -> None:
        await accounts.start()
        await store.start()
        for n, (tenant, status) in enumerate(
            (("a", "in_progress"), ("b", "in_progress"), ("a", "completed"))
        ):
            row = {
                "id": f"batch_{n}",
                "tenant": tenant,
                "key_id": "k",
                "endpoint": "/v1/chat/completions",
                "model": "tiny",
                "input_file_id": "file_x",
                "completion_window": "24h",
                "status": status,
                "metadata": None,
                "total": 4,
                "created_at": 1000.0 + n,
                "in_progress_at": 1000.0 + n,
                "expires_at": 9e9,
            }
            await store.create_batch(row, iter([(f"c{i}", "{}") for i in range(4)]))
        # batch_1: one line done, one failed, two pending.
        leases = await store.lease("batch_1", "runner", 2, 1010.0, 30.0)
        await store.settle_many("runner", [(leases[0], "done", "x", 0.0), (leases[1], "failed", "y", 0.0)])
        # batch_2 finished with its final counts on its row.
        with accounts.engine.begin() as c:
            c.execute(
                batches_table.update()
                .where(batches_table.c.id == "batch_2")
                .values(completed=3, failed=1, completed_at=1020.0)
            )

    asyncio.run(fill())
    app = FastAPI()
    install_error_handlers(app)
    app.router.routes.extend(admin_batch_routes(accounts, AdminAuth(KEY), clock=lambda: 1030.0))
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as c:
        body = c.get("/admin/v1/batches", headers=auth).json()
        assert [b["id"] for b in body["data"]] == ["batch_2", "batch_1", "batch_0"] and not body["has_more"]
        done, running, idle = body["data"]
        assert running["request_counts"] == {"total": 4, "completed": 1, "failed": 1}
        assert running["tenant"] == "b" and running["age_s"] == pytest.approx(29.0)
        assert idle["request_counts"] == {"total": 4, "completed": 0, "failed": 0}
        assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
        assert done["age_s"] is None and done["finished_at"] == 1020 and done["status"] == "completed"
        page = c.get("/admin/v1/batches?limit=2", headers=auth).json()
        assert [b["id"] for b in page["data"]] == ["batch_2", "batch_1"] and page["has_more"]
        active = c.get("/admin/v1/batches?status=active", headers=auth).json()["data"]
        assert [b["id"] for b in active] == ["batch_1", "batch_0"]
        assert [
            b["id"] for b in c.get("/admin/v1/batches?status=completed", headers=auth).json()["data"]
        ] == ["batch_2"]
        for query in ("limit=0", "limit=201", "limit=1.5", "status=", "status=ACTIVE"):
            r = c.get(f"/admin/v1/batches?{query}", headers=auth)
            assert r.status_code == 400, (query, r.text)
            assert r.json()["error"]["param"] in ("limit", "status")
            assert c.get(f"/admin/v1/batches?{query}").status_code == 401
        assert c.get("/admin/v1/batches", headers={"Authorization": "Bearer nope"}).status_code == 401
    asyncio.run(accounts.close())


def test_gateway_origin_is_where_the_admin_api_is():
    assert gateway_origin("http://127.0.0.1:8080/metrics") == "http://127.0.0.1:8080"
    assert gateway_origin("https://gw.example:443/x?y=1") == "https://gw.example:443"
    assert gateway_origin("http://[::1]:9/") == "http://[::1]:9"
    for bad in ("ftp://h:1", "http://:80", "127.0.0.1:8080", "http://h:99999"):
        with pytest.raises(ValueError):
            gateway_origin(bad)


def test_control_plane_refuses_a_bad_gateway_admin_flag(tmp_path: Path, capsys):
    from paved.control_plane.server import main

    assert main(["--gateway-admin", "ftp://gw:1"]) == 2
    assert "--gateway-admin: gateway URL 'ftp://gw:1'" in capsys.readouterr().err
    missing = tmp_path / "no-key"
    assert main(["--gateway-admin-key-file", str(missing)]) == 2
    assert f"cannot read the admin key file {missing}" in capsys.readouterr().err
    # Its own admin key too: a usage error (exit 2, one line), not a traceback from the loop.
    assert main(["--admin-key-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"admin key: cannot read the admin key file {missing}" in err and "Traceback" not in err


def test_an_unreadable_gateway_is_an_error_in_the_summary_not_a_failed_one(tmp_path: Path):
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31540, 31560), work_dir=tmp_path / "work")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
    check = AdminAuth(KEY).check
    # Port 9 (discard) on loopback: nothing listens there, the connection is refused at once.
    dash = dashboard_router(
        store, controller, check, gateway_admin=["http://127.0.0.1:9"], gateway_admin_key="gw-key"
    )
    app = create_app(store, controller, feed, check, extra_routers=[dash])
    asyncio.run(store.start())
    with TestClient(app) as c:
        r = c.get("/dashboard/api/summary", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    batches = r.json()["batches"]
    assert batches["configured"] is True and batches["batches"] == []
    (err,) = batches["errors"]
    assert err["url"] == "http://127.0.0.1:9/admin/v1/batches" and err["error"]
    assert "gw-key" not in r.text


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def test_summary_over_a_fleet_on_the_simulated_engine(fleet):
    cp, gw, key = fleet()
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


# Slow decoding (8 tokens/s, lines of at most 16 tokens: ~2 s a line, 32 lines at a time): the
# batch runs for several seconds, so its progress is seen between its start and its end.
SLOW_SIM = "sim://tiny?tokens_per_s=8&max_num_seqs=64&max_model_len=512"
BATCH_LINES = 192


def _batch_file(n: int, *, too_long: int = 0) -> bytes:
    """`n` chat lines for tiny; the last `too_long` have a prompt past the model's length, which
    the engine refuses (400): they end failed."""
    lines = []
    for i in range(n):
        content = f"question {i}" if i < n - too_long else "long " * 200
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16}
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def start_batch(gw, key: str, n: int, *, too_long: int = 0) -> str:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=30, max_retries=0)
    f = client.files.create(file=("in.jsonl", io.BytesIO(_batch_file(n, too_long=too_long))), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def test_batch_progress_in_the_gateway_admin_listing_and_the_summary(fleet):
    cp, gw, key = fleet()
    first_deploy(cp, gw, key, engine=SLOW_SIM)
    batch_id = start_batch(gw, key, BATCH_LINES, too_long=2)
    admin = {"Authorization": f"Bearer {cp.admin_key}"}  # the fleet's gateway shares the key

    def listing(**params):
        r = httpx.get(gw.url + "/admin/v1/batches", params=params, headers=admin, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def running():
        (b,) = [b for b in listing()["data"] if b["id"] == batch_id]
        c = b["request_counts"]
        return b if b["status"] == "in_progress" and 0 < c["completed"] + c["failed"] < c["total"] else None

    b = cp.wait_for("the batch part done in the gateway's admin listing", running, timeout_s=120)
    assert (b["tenant"], b["model"], b["endpoint"]) == ("team", "tiny", "/v1/chat/completions")
    assert b["request_counts"]["total"] == BATCH_LINES and b["age_s"] >= 0 and b["finished_at"] is None
    assert [x["id"] for x in listing(status="active")["data"]] == [batch_id]
    assert listing(status="completed")["data"] == []
    page = listing(limit="1")
    assert len(page["data"]) == 1 and page["has_more"] is False

    # The same batch in the dashboard's summary, with its progress, while it runs.
    def summarized():
        s = cp.api("GET", "/dashboard/api/summary")["batches"]
        rows = [r for r in s.get("batches", []) if r["id"] == batch_id]
        return (s, rows[0]) if rows and 0 < rows[0]["done"] < 1 else None

    s, row = cp.wait_for("the running batch in the summary", summarized, timeout_s=60)
    assert s["configured"] is True and s["errors"] == [] and row["tenant"] == "team"
    assert row["total"] == BATCH_LINES and row["status"] == "in_progress"

    # It ends completed with both counts: the lines past the model's length failed.
    def finished():
        (b,) = listing()["data"]
        return b if b["status"] == "completed" else None

    b = cp.wait_for("the batch completed", finished, timeout_s=180)
    assert b["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES - 2, "failed": 2}
    assert b["age_s"] is None and b["finished_at"] >= b["created_at"]

    # The listing's input is checked (400, OpenAI-style), after the admin key (401 without it).
    for params in ({"limit": "0"}, {"limit": "201"}, {"limit": "x"}, {"status": "done"}):
        r = httpx.get(gw.url + "/admin/v1/batches", params=params, headers=admin, timeout=10)
        assert r.status_code == 400, (params, r.text)
        err = r.json()["error"]
        assert err["message"] and err["param"] in ("limit", "status"), err
        r = httpx.get(gw.url + "/admin/v1/batches", params=params, timeout=10)
        assert r.status_code == 401, r.text
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}"}):
        r = httpx.get(gw.url + "/admin/v1/batches", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["message"]
