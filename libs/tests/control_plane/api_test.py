"""The control plane's REST API on a real SQLite store, without a fleet: every bad input is a
400 OpenAI-style body naming the field (never a 500), the admin key is required, conflicts are
409, unknown things 404, and /openapi.json documents the routes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fleet import tiny_package

from paved.control_plane import controller as controller_module
from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.control_plane.types import DeploymentSpec, Replica
from paved.gateway.access.auth import AdminAuth

KEY = "admin-key-for-tests-0123456789"


@pytest.fixture
def plane(tmp_path: Path):
    """(API client, store, controller) over one SQLite file; the controller's loop is not run."""
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31500, 31520), work_dir=tmp_path / "work")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
    app = create_app(store, controller, feed, AdminAuth(KEY).check)
    asyncio.run(store.start())
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c, store, controller


@pytest.fixture
def client(plane):
    return plane[0]


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) >= {"message", "type", "param", "code"}
    return body


def test_s3_packages_are_read_from_the_control_planes_endpoint(tmp_path: Path, monkeypatch):
    """--s3-endpoint-url reaches the registration's package read (it only reached the
    replicas', so a deployment from that store was a 400 unless $AWS_ENDPOINT_URL was set)."""
    from paved.launcher.build import upload_package
    from paved.launcher.testing import CREDENTIALS, MotoServer

    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    with MotoServer(str(tmp_path / "moto.log")) as s3:
        s3.client().create_bucket(Bucket="models")
        upload_package(tiny_package(), "s3://models/tiny.tar", s3.client())
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        driver = LocalDriver("local", port_range=(31521, 31530), work_dir=tmp_path / "work")
        feed = RoutesFeed(store)
        controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
        app = create_app(store, controller, feed, AdminAuth(KEY).check, s3_endpoint_url=s3.endpoint)
        asyncio.run(store.start())
        body = {
            "model_id": "tiny",
            "version": "1",
            "package_uri": "s3://models/tiny.tar",
            "engine": "sim://tiny",
        }
        with TestClient(app) as c:
            c.headers["Authorization"] = f"Bearer {KEY}"
            r = c.post("/v1/deployments", json=body)
            assert r.status_code == 201, r.text
            assert r.json()["fingerprint"]["kind"] == "generate"
            missing = c.post(
                "/v1/deployments", json={**body, "version": "2", "package_uri": "s3://models/no.tar"}
            )
            assert _error(missing, 400)["code"] == "package_unreadable"


def test_gc_by_traffic_needs_the_gateways_metrics(client):
    """Without a metrics source no traffic is ever recorded: a policy by traffic would read
    every version as idle since its creation and remove versions still serving."""
    r = client.post("/v1/gc", json={"retain_s_since_traffic": 60, "dry_run": True})
    assert _error(r, 400)["code"] == "traffic_unknown"
    assert client.post("/v1/gc", json={"retain_s_since_created": 60, "dry_run": True}).status_code == 200


def test_openapi_and_auth(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/deployments", "/v1/rollouts", "/v1/audit", "/v1/gc"} <= set(paths)
    _error(client.get("/v1/deployments", headers={"Authorization": "Bearer wrong"}), 401)
    del client.headers["Authorization"]
    _error(client.get("/v1/deployments"), 401)


def test_rollouts_are_listed_a_page_at_a_time(plane):
    """Rollouts are kept, so a fleet's list only grows: pages of `limit`, oldest first,
    continued `after` the last id, `has_more` until the end."""
    client, store, _ = plane
    made = [asyncio.run(store.create_rollout(f"m{i}", None, "v1", "red_black", {})).id for i in range(5)]
    assert [r["id"] for r in client.get("/v1/rollouts").json()["data"]] == made
    seen: list[str] = []
    after = None
    for want, more in ((2, True), (2, True), (1, False)):
        page = client.get("/v1/rollouts", params={"limit": 2, **({"after": after} if after else {})}).json()
        assert len(page["data"]) == want and page["has_more"] is more, page
        assert page["last_id"] == page["data"][-1]["id"]
        seen += [r["id"] for r in page["data"]]
        after = page["last_id"]
    assert seen == made
    assert client.get("/v1/rollouts", params={"after": made[-1]}).json() == {
        "object": "list", "data": [], "has_more": False, "last_id": None
    }  # fmt: skip
    assert _error(client.get("/v1/rollouts", params={"after": "ro_nope"}), 404)
    assert _error(client.get("/v1/rollouts", params={"limit": 0}), 400)["param"] is None
    assert _error(client.get("/v1/rollouts", params={"limit": 1001}), 400)
    assert _error(client.get("/v1/rollouts", params={"after": "../x"}), 400)["code"] == "invalid_rollout_id"


def test_readiness_shows_the_controller_error_only_to_the_admin(plane):
    """Probes read /health/ready without a key; the controller's last error (deployment names,
    engine URIs, database hosts) is the admin's alone."""
    client, _, controller = plane
    controller.last_error = "deploy tiny@v1: postgresql://db.internal:5432 refused the connection"
    anonymous = client.get("/health/ready", headers={"Authorization": ""})
    assert anonymous.status_code == 200
    assert anonymous.json() == {"status": "ready", "leader": True, "controller_ok": False}
    wrong = client.get("/health/ready", headers={"Authorization": "Bearer not-the-key"}).json()
    assert "last_error" not in wrong and "db.internal" not in json.dumps(wrong)
    admin = client.get("/health/ready").json()
    assert admin["last_error"] == controller.last_error and admin["controller_ok"] is False
    controller.last_error = None
    assert client.get("/health/ready", headers={"Authorization": ""}).json()["controller_ok"] is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"version": "v1", "package_uri": "/x"}, "model_id"),
        ({"model_id": "bad name", "version": "v1", "package_uri": "/x"}, "model_id"),
        ({"model_id": "m", "version": "v1", "package_uri": "/x", "replicas": -1}, "replicas"),
        ({"model_id": "m", "version": "v1", "package_uri": "/x", "strategy": "canary"}, "strategy"),
        ({"model_id": "m", "version": "v1", "package_uri": "/x", "colour": "red"}, "colour"),
        ({"model_id": "m", "version": "v1", "package_uri": "/x", "replicas": "2"}, "replicas"),
        (
            {"model_id": "m", "version": "v1", "package_uri": "/x", "autoscale": {"panic_window_s": 0}},
            "autoscale.panic_window_s",
        ),
    ],
)
def test_bad_deployments_are_400_naming_the_field(client, body, param):
    error = _error(client.post("/v1/deployments", json=body), 400)
    assert error["param"] == param, error


def test_semantic_errors(client):
    base = {"model_id": "tiny", "version": "v1", "package_uri": tiny_package(), "engine": "sim://tiny"}
    assert (
        "unknown region"
        in _error(client.post("/v1/deployments", json={**base, "regions": ["mars"]}), 400)["message"]
    )
    assert (
        "engine"
        in _error(client.post("/v1/deployments", json={**base, "engine": "docker://x"}), 400)["message"]
    )
    assert (
        "/no/such"
        in _error(client.post("/v1/deployments", json={**base, "package_uri": "/no/such"}), 400)["message"]
    )
    # The whole sim:// URI is checked at creation (these once passed and failed every replica).
    for engine, needle in [
        ("sim://tiny?tokens_per_s=abc", "tokens_per_s must be a number"),
        ("sim://tiny?tokens_per_s=-5", "tokens_per_s must be a finite number >= 0"),
        ("sim://tiny?max_num_seqs=0", "max_num_seqs must be an integer >= 1"),
        ("sim://nosuch", "names model 'nosuch'"),
        ("sim://tiny?x=1", "unknown option(s) ['x']"),
    ]:
        error = _error(client.post("/v1/deployments", json={**base, "version": "bad", "engine": engine}), 400)
        assert error["code"] == "bad_engine" and needle in error["message"], error
    _error(client.get("/v1/deployments/tiny/bad"), 404)  # nothing was stored
    # A tokenizer directory is the replica's machine's: not looked for here.
    ok = {**base, "version": "tok", "engine": "sim://tiny?tokenizer=/on/the/replica/host"}
    assert client.post("/v1/deployments", json=ok).status_code == 201
    assert client.post("/v1/deployments", json=base).status_code == 201
    # A conflict is the client's to resolve (its type once read "server_error").
    assert _error(client.post("/v1/deployments", json=base), 409)["type"] == "invalid_request_error"
    _error(client.get("/v1/deployments/tiny/v9"), 404)
    _error(client.get("/v1/rollouts/ro_nope"), 404)
    bad = client.post(
        "/v1/rollouts", json={"model_id": "tiny", "version": "v1", "params": {"phases": [50, 20]}}
    )
    assert "phases" in _error(bad, 400)["message"]
    bad = client.post("/v1/rollouts", json={"model_id": "tiny", "version": "v1", "params": {"colour": 1}})
    assert "colour" in _error(bad, 400)["message"]
    _error(client.put("/v1/models/tiny/current", json={"version": "v1"}), 400)  # red_black has no current
    _error(client.get("/v1/audit?limit=0"), 400)
    _error(client.post("/v1/gc", json={"min_kept": 0}), 400)


@pytest.mark.parametrize(
    "flags",
    [
        ["--interval", "0"],
        ["--interval", "nan"],
        ["--health-timeout", "-1"],
        ["--drain-delay", "inf"],
        ["--drain-delay", "-0.5"],
    ],
)
def test_server_flags_out_of_range_exit_2_naming_the_flag(flags, capsys):
    from paved.control_plane.server import main

    assert main([*flags, "--port", "0"]) == 2
    assert flags[0] in capsys.readouterr().err


def test_route_options_are_validated_and_published_with_the_alias(plane):
    client, store, controller = plane
    base = {"model_id": "tiny", "package_uri": tiny_package(), "engine": "sim://tiny"}
    for route, needle in (
        ({"backends": []}, "unknown route option(s) ['backends']"),
        ({"cache": {"exact": "yes"}}, "route options rejected"),
        ({"max_model_len": 0}, "max_model_len"),
        ("cache", "route"),
    ):
        error = _error(client.post("/v1/deployments", json={**base, "version": "v1", "route": route}), 400)
        assert needle in error["message"] or error["param"] == needle, (route, error)
    cached = {"cache": {"exact": True, "ttl_s": 60}, "max_model_len": 512}
    r = client.post("/v1/deployments", json={**base, "version": "v1", "route": cached})
    assert r.status_code == 201, r.text
    assert r.json()["route"] == cached
    assert client.post("/v1/deployments", json={**base, "version": "v2"}).status_code == 201

    async def publish() -> dict:
        v1 = await store.get_deployment("tiny", "v1")
        v2 = await store.get_deployment("tiny", "v2")
        assert v1 is not None and v2 is not None
        await controller.activate(v1.id)
        for d, port, metrics in ((v1, 1, "http://127.0.0.1:9/metrics"), (v2, 2, None)):
            await store.add_replica(
                Replica(
                    id=f"rep_{d.spec.version}", deployment_id=d.id, region="local", state="ready",
                    url=f"http://127.0.0.1:{port}", admin_url=f"http://127.0.0.1:{port}",
                    metrics_url=metrics,
                )
            )  # fmt: skip
        await controller.publish_routes()
        return await controller.routes_table()

    (route,) = asyncio.run(publish())["models"]
    # The active version's options for the whole alias (v2, inactive, has none of its own).
    assert route["cache"] == {"exact": True, "ttl_s": 60.0} and route["max_model_len"] == 512, route
    assert {b["version"] for b in route["backends"]} == {"v1", "v2"}
    # A replica's metrics proxy is where the gateways read its load; without one, the frontend's.
    by_version = {b["version"]: b for b in route["backends"]}
    assert by_version["v1"]["metrics_url"] == "http://127.0.0.1:9/metrics"
    assert "metrics_url" not in by_version["v2"]
    # PATCH replaces them whole; {} clears them.
    r = client.patch("/v1/deployments/tiny/v1", json={"route": {}})
    assert r.status_code == 200 and r.json()["route"] == {}, r.text
    (route,) = asyncio.run(controller.routes_table())["models"]
    assert "cache" not in route and "max_model_len" not in route
    _error(client.patch("/v1/deployments/tiny/v1", json={"route": {"strategy": "weighted"}}), 400)


async def _raw(app, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
    """One request straight through the ASGI app with a declared 120 MB body the client never
    sends: (status, JSON body, how many times the app asked for the body)."""
    sent: list[dict] = []
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"{" * 1024, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"content-length", b"120000000"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8090),
    }  # fmt: skip
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), reads


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/deployments", {}),
        ("PATCH", "/v1/deployments/tiny/v3", {"replicas": -1}),
        ("PUT", "/v1/models/tiny/current", {}),
        ("POST", "/v1/rollouts", {"model_id": 1}),
        ("POST", "/v1/gc", {"min_kept": 0}),
        ("POST", "/v1/deployments", "{not json"),
    ],
)
def test_no_admin_key_is_401_before_the_body_is_looked_at(client, method, path, body):
    del client.headers["Authorization"]
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        error = _error(client.request(method, path, headers=headers, **kwargs), 401)
        assert error["code"] in ("missing_api_key", "invalid_api_key"), error


def test_admin_bodies_are_bounded_and_unauthenticated_ones_never_read(plane):
    client, _, _ = plane
    app = client.app
    big = b'{"model_id": "' + b"m" * (2 * 1024 * 1024) + b'"}'
    error = _error(client.post("/v1/deployments", content=big), 413)
    assert error["code"] == "request_too_large" and str(1024 * 1024) in error["message"], error
    status, body, reads = asyncio.run(_raw(app, "POST", "/v1/deployments", []))
    assert (status, body["error"]["code"], reads) == (401, "missing_api_key", 0)
    auth = [(b"authorization", f"Bearer {KEY}".encode())]
    status, body, reads = asyncio.run(_raw(app, "POST", "/v1/deployments", auth))
    assert (status, body["error"]["code"], reads) == (413, "request_too_large", 0)
    # Under the limit, a body is still read and validated as before.
    _error(client.post("/v1/deployments", json={}), 400)


def test_delete_refuses_a_deployment_with_replicas_until_it_is_scaled_to_0(plane):
    client, store, controller = plane
    base = {"model_id": "tiny", "version": "v1", "package_uri": tiny_package(), "engine": "sim://tiny"}
    assert client.post("/v1/deployments", json={**base, "min_replicas": 0}).status_code == 201

    async def serve() -> None:
        d = await store.get_deployment("tiny", "v1")
        assert d is not None
        await controller.activate(d.id)
        await controller.scale(d.id, "local", 1)
        await store.add_replica(
            Replica(
                id="rep_v1", deployment_id=d.id, region="local", state="ready",
                url="http://127.0.0.1:1", admin_url="http://127.0.0.1:1",
            )
        )  # fmt: skip

    asyncio.run(serve())
    error = _error(client.delete("/v1/deployments/tiny/v1"), 409)
    assert error["code"] == "deployment_has_replicas" and '"replicas": 0' in error["message"], error
    assert client.get("/v1/deployments/tiny/v1").status_code == 200
    r = client.patch("/v1/deployments/tiny/v1", json={"replicas": 0})
    assert r.status_code == 200 and r.json()["desired"] == {"local": 0}, r.text
    # Desired 0, but the replica has not drained yet (the controller's loop is not running).
    error = _error(client.delete("/v1/deployments/tiny/v1"), 409)
    assert "1 running" in error["message"], error
    asyncio.run(store.update_replica("rep_v1", state="stopped"))
    r = client.delete("/v1/deployments/tiny/v1")
    assert r.status_code == 200, r.text
    _error(client.get("/v1/deployments/tiny/v1"), 404)


class _RecordingDriver:
    """A driver whose replicas are records only: it notes which ones it was told to drain."""

    def __init__(self) -> None:
        self.drained: list[str] = []

    async def drain(self, replica: Replica, timeout_s: float = 30.0) -> None:
        self.drained.append(replica.id)

    async def delete(self, replica: Replica) -> None:
        self.drained.append(replica.id)

    async def alive(self, replica: Replica) -> bool:
        return True

    async def exit_reason(self, replica: Replica) -> str | None:
        return None

    async def locate(self, replica: Replica) -> Replica:
        return replica

    async def retire(self, deployment_id: str) -> None:
        pass


def test_the_controller_drains_replicas_of_a_deleted_deployment(tmp_path: Path):
    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        driver = _RecordingDriver()
        drivers: dict[str, Any] = {"local": driver}
        controller = Controller(store, drivers, RoutesFeed(store), GatewayAnalyzer([]), drain_delay_s=0.0)
        try:
            spec = DeploymentSpec(
                model_id="tiny", version="v1", package_uri=tiny_package(), strategy="red_black",
                min_replicas=0, max_replicas=1, replicas=1, regions=("local",), engine="sim://tiny",
            )  # fmt: skip
            d = await store.create_deployment(spec, {})
            await store.add_replica(
                Replica(
                    id="rep_v1", deployment_id=d.id, region="local", state="ready",
                    url="http://127.0.0.1:1", admin_url="http://127.0.0.1:1",
                )
            )  # fmt: skip
            # What a delete racing a scale-up (or GC) leaves: a live replica, its deployment gone.
            await store.delete_deployment(d.id)
            await controller.reconcile()
            await asyncio.gather(*controller._draining.values())
            assert driver.drained == ["rep_v1"]
            (replica,) = await store.list_replicas()
            assert replica.state == "stopped"
            (drain,) = [e for e in await store.list_audit(model_id="tiny") if e.kind == "scale"]
            assert drain.version == "v1" and "rep_v1 of tiny@v1" in drain.message
        finally:
            await store.close()

    asyncio.run(main())


class _ForkFailingDriver(_RecordingDriver):
    """Starts replicas as records, except for model `bad`, whose start fails as a fork or an
    exec does (OSError)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []

    async def create(self, req: Any) -> Replica:
        if req.model_id == "bad":
            raise OSError(12, "Cannot allocate memory")
        self.created.append(req.model_id)
        return Replica(
            id=req.replica_id, deployment_id=req.deployment_id, region=req.region, state="starting",
            url="http://127.0.0.1:1", admin_url="http://127.0.0.1:1",
        )  # fmt: skip


def test_a_start_that_fails_in_the_os_fails_its_deployment_not_the_pass(tmp_path: Path):
    """A replica that could not be forked or executed is that deployment's audited failure; the
    other deployments of the same pass still get their replicas."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        driver = _ForkFailingDriver()
        controller = Controller(store, {"local": driver}, RoutesFeed(store), GatewayAnalyzer([]))
        try:
            for model in ("bad", "good"):
                spec = DeploymentSpec(
                    model_id=model, version="v1", package_uri="/pkg/v1", strategy="red_black",
                    min_replicas=0, max_replicas=1, replicas=1, regions=("local",), engine="sim://tiny",
                )  # fmt: skip
                await store.create_deployment(spec, {})
            await controller.reconcile()
            assert controller.last_error is None
            assert driver.created == ["good"] and len(await store.list_replicas()) == 1
            (failed,) = [e for e in await store.list_audit(model_id="bad") if e.kind == "replica.failed"]
            assert "Cannot allocate memory" in failed.message and failed.version == "v1"
        finally:
            await store.close()

    asyncio.run(main())


class _DyingDriver(_ForkFailingDriver):
    """Its replicas die before they are ready; why, it can tell for model `told` only (for
    `broken` asking raises, for the rest it knows nothing)."""

    async def alive(self, replica: Replica) -> bool:
        return False

    async def exit_reason(self, replica: Replica) -> str | None:
        model = self.models[replica.deployment_id]
        if model == "broken":
            raise RuntimeError("the driver's own bug")
        if model == "verbose":  # an engine's traceback: lines, a NUL, far past the store's bound
            return "start failed: boom\n  File x\x00\n" + "z" * 10_000
        return "start failed: engine exited 1: no tokenizer" if model == "told" else None


def test_a_replica_that_dies_starting_is_audited_with_its_drivers_reason(tmp_path: Path):
    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        driver = _DyingDriver()
        controller = Controller(store, {"local": driver}, RoutesFeed(store), GatewayAnalyzer([]))
        try:
            driver.models = {}
            for model in ("told", "broken", "silent", "verbose"):
                spec = DeploymentSpec(
                    model_id=model, version="v1", package_uri="/pkg/v1", min_replicas=0, max_replicas=1,
                    replicas=1, regions=("local",), engine="sim://tiny",
                )  # fmt: skip
                driver.models[(await store.create_deployment(spec, {})).id] = model
            await controller.reconcile()  # starts them
            await controller.reconcile()  # finds them dead
            messages = {}
            for model in ("told", "broken", "silent", "verbose"):
                (e,) = [e for e in await store.list_audit(model_id=model) if e.kind == "replica.failed"]
                messages[model] = e.message.split(" failed: ", 1)[1]
            assert messages["told"].startswith(
                "its process exited before it was ready: start failed: engine exited 1: no tokenizer"
            ), messages
            for model in ("broken", "silent"):  # recorded all the same, without a reason
                assert messages[model].startswith("its process exited before it was ready"), messages
                assert "bug" not in messages[model] and "tokenizer" not in messages[model], messages
            # One line, printable, cut to WHY_CHARS: stored, not refused by the store's bound.
            verbose = messages["verbose"]
            assert verbose.startswith("its process exited before it was ready: start failed: boom File x ")
            assert verbose.endswith("z…") and len(verbose) < 1100, len(verbose)
            assert len([r for r in await store.list_replicas() if r.state == "failed"]) == 4
            # A probe's own text may be long too (a smoke answer's repr, a model's traceback):
            # the whole reason is bounded, so the store takes it and the pass goes on.
            victim = next(r for r in await store.list_replicas() if r.state == "failed")
            await controller._fail(victim, "not ready after 1 s: " + "y" * 9000 + "\x00")
            stored = await store.get_replica(victim.id)
            assert stored is not None and stored.reason is not None
            assert len(stored.reason) <= controller_module.REASON_CHARS and stored.reason.endswith("y…")
        finally:
            await store.close()

    asyncio.run(main())


def test_starts_that_keep_failing_back_off_and_ended_replicas_are_forgotten(tmp_path: Path):
    """A deployment whose starts keep failing is tried once per pass (not once per missing
    replica), then again at once, then after 5 s, 10 s, ...; stopped and failed replicas are
    forgotten after the retention, live ones never."""

    class Counting(_ForkFailingDriver):
        attempts = 0

        async def create(self, req: Any) -> Replica:
            Counting.attempts += 1
            return await super().create(req)

    async def main() -> None:
        from datetime import UTC, datetime, timedelta

        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        controller = Controller(store, {"local": Counting()}, RoutesFeed(store), GatewayAnalyzer([]))
        try:
            spec = DeploymentSpec(
                model_id="bad", version="v1", package_uri="/pkg/v1", strategy="red_black",
                min_replicas=0, max_replicas=3, replicas=3, regions=("local",), engine="sim://tiny",
            )  # fmt: skip
            d = await store.create_deployment(spec, {})
            await controller.reconcile()
            assert Counting.attempts == 1  # three missing, one refused start ends the pass's tries
            await controller.reconcile()
            assert Counting.attempts == 2  # a first failure is retried at once
            await controller.reconcile()
            await controller.reconcile()
            assert Counting.attempts == 2  # then it waits
            failures, _, counted = controller._backoff[(d.id, "local")]
            controller._backoff[(d.id, "local")] = (failures, 0.0, counted)  # as if the 5 s had passed
            await controller.reconcile()
            assert Counting.attempts == 3
            messages = [
                e.message for e in await store.list_audit(model_id="bad") if e.kind == "replica.failed"
            ]
            assert "2 failed starts in a row; the next in 5 s" in messages[1]
            assert "3 failed starts in a row; the next in 10 s" in messages[2]

            for rid, state in (("rep_s", "stopped"), ("rep_f", "failed"), ("rep_r", "ready")):
                await store.add_replica(
                    Replica(id=rid, deployment_id=d.id, region="local", state=state,  # type: ignore[arg-type]
                            url="http://127.0.0.1:1", admin_url="http://127.0.0.1:1")
                )  # fmt: skip
            assert await store.prune_replicas(datetime.now(UTC) - timedelta(hours=1)) == 0
            assert await store.prune_replicas(datetime.now(UTC) + timedelta(seconds=1)) == 2
            assert [r.id for r in await store.list_replicas()] == ["rep_r"]
        finally:
            await store.close()

    asyncio.run(main())


class _AdoptingDriver(_RecordingDriver):
    """After a restart: the replicas in `running` are still there, the others are gone."""

    def __init__(self, running: set[str]) -> None:
        super().__init__()
        self.running = running

    async def adopt(self, replicas: list[Replica]) -> tuple[list[Replica], list[Replica]]:
        alive = [r for r in replicas if r.id in self.running]
        return alive, [r for r in replicas if r.id not in self.running]


def test_a_models_audit_shows_the_leader_change_and_its_replicas_adoption(tmp_path: Path):
    """`paved audit --model tiny` (GET /v1/audit?model_id=tiny) after a control-plane restart:
    the leader change, the adoption of tiny's replicas, the ones gone and failed, and nothing
    about another model's replicas."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        try:
            ids = {}
            for model in ("tiny", "other"):
                spec = DeploymentSpec(
                    model_id=model, version="v1", package_uri="/pkg/v1", strategy="red_black",
                    min_replicas=0, max_replicas=4, replicas=2, regions=("local",), engine="sim://tiny",
                )  # fmt: skip
                ids[model] = (await store.create_deployment(spec, {})).id
            owners = {"rep_t1": "tiny", "rep_t2": "tiny", "rep_t3": "tiny", "rep_o1": "other"}
            for rid, model in owners.items():
                await store.add_replica(
                    Replica(
                        id=rid, deployment_id=ids[model], region="local", state="ready",
                        url=f"http://127.0.0.1:1/{rid}", admin_url="http://127.0.0.1:1",
                    )
                )  # fmt: skip
            await store.audit("leader", "control plane pid 1 became the leader")  # as server.py does
            drivers: dict[str, Any] = {"local": _AdoptingDriver({"rep_t1", "rep_t3", "rep_o1"})}
            controller = Controller(store, drivers, RoutesFeed(store), GatewayAnalyzer([]))
            await controller._adopt()
            t3 = await store.get_replica("rep_t3")
            assert t3 is not None
            await controller._fail(t3, "its process exited before it was ready")
            events = await store.list_audit(model_id="tiny")
            assert [e.kind for e in events] == ["leader", "replica.gone", "replica.adopted", "replica.failed"]
            assert all(e.version == "v1" for e in events[1:])
            gone, adopted, failed = events[1:]
            assert gone.data == {"replica": "rep_t2"} and "rep_t2 of tiny@v1" in gone.message
            assert adopted.data == {"replicas": ["rep_t1", "rep_t3"]} and "of tiny@v1" in adopted.message
            assert failed.data == {"replica": "rep_t3"} and "rep_t3 of tiny@v1 failed" in failed.message
            (others,) = [e for e in await store.list_audit(model_id="other") if e.kind == "replica.adopted"]
            assert others.data == {"replicas": ["rep_o1"]}
        finally:
            await store.close()

    asyncio.run(main())


def test_a_registration_is_stored_inactive_in_one_write(plane, monkeypatch):
    """Registering starts nothing: the deployment is inserted inactive. It was inserted active
    and then updated; a failed (or interrupted) update left it active, and the controller started
    its replicas with no rollout, while the client got a 503 and then 409s."""
    client, store, _ = plane

    async def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the store failed this write")

    monkeypatch.setattr(store, "update_deployment", unavailable)
    base = {"model_id": "tiny", "version": "v1", "package_uri": tiny_package(), "engine": "sim://tiny"}
    r = client.post("/v1/deployments", json=base)
    assert r.status_code == 201, r.text
    assert client.get("/v1/deployments/tiny/v1").json()["state"] == "inactive"


def test_rollout_waves_naming_other_regions_are_a_400_at_start(plane):
    """Checked when the rollout is started, not at its first step (it was a 201, then failed);
    and a running rollout's versions are not scaled beside it."""
    client, store, _ = plane
    base = {"model_id": "tiny", "package_uri": tiny_package(), "engine": "sim://tiny"}
    assert client.post("/v1/deployments", json={**base, "version": "v1"}).status_code == 201
    assert client.post("/v1/deployments", json={**base, "version": "v2"}).status_code == 201
    v1 = asyncio.run(store.get_deployment("tiny", "v1"))
    asyncio.run(store.update_deployment(v1.id, state="active"))
    bad = client.post(
        "/v1/rollouts", json={"model_id": "tiny", "version": "v2", "params": {"waves": [["mars"]]}}
    )
    assert "must cover exactly the deployment's regions" in _error(bad, 400)["message"]
    assert client.post("/v1/rollouts", json={"model_id": "tiny", "version": "v2"}).status_code == 201
    # While it runs, the rollout sets both versions' counts: a count set beside it is a 409.
    error = _error(client.patch("/v1/deployments/tiny/v1", json={"replicas": 0}), 409)
    assert error["code"] == "rollout_running"
    assert client.patch("/v1/deployments/tiny/v1", json={"no_gc": True}).status_code == 200


def test_a_replica_started_but_not_recorded_is_stopped(plane, monkeypatch):
    """The driver started the process, the store failed to record it: nothing would ever stop
    an unrecorded replica (adoption reads the records) and the next pass starts another, so the
    controller deletes it at once and the error propagates."""
    _, store, controller = plane
    deployment = asyncio.run(store.create_deployment(DeploymentSpec("tiny", "v1", tiny_package()), {}))
    started: list[Replica] = []
    deleted: list[str] = []

    class Driver:
        async def create(self, req):
            replica = Replica(
                req.replica_id, req.deployment_id, req.region, "starting", "http://x", "http://y"
            )
            started.append(replica)
            return replica

        async def delete(self, replica):
            deleted.append(replica.id)

    async def fail(replica):
        raise RuntimeError("the store failed this write")

    controller.drivers["local"] = Driver()
    monkeypatch.setattr(store, "add_replica", fail)
    with pytest.raises(RuntimeError, match="failed this write"):
        asyncio.run(controller._create(deployment, "local"))
    assert [r.id for r in started] == deleted and len(deleted) == 1


def test_the_cli_refuses_json_nested_too_deep_with_exit_2(capsys, monkeypatch):
    """json.loads' RecursionError escaped as a traceback (exit 1). A --param value that is not
    JSON is a string, so there it is sent (and this control plane is unreachable: exit 1)."""
    from paved.cli.main import main

    monkeypatch.setenv("PAVED_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("PAVED_ADMIN_KEY", KEY)
    deep = "[" * 100_000
    for argv, expected in (
        (["deploy", "create", "tiny", "v1", "/x", "--route", deep], 2),
        (["rollout", "start", "tiny", "v1", "--param", "x=" + deep], 1),
    ):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == expected and "Traceback" not in err, err[-300:]
        if expected == 2:
            assert "nested too deeply" in err


def test_cli_scale_to_zero_lowers_min_replicas_with_it(monkeypatch, capsys):
    """`paved deploy scale M V 0` means zero: min_replicas (1 by default) went unchanged and
    the API refused the PATCH, with no other CLI way to lower it."""
    from paved.cli import control
    from paved.cli.main import main

    sent: list[dict[str, Any]] = []

    class Client:
        def request(self, method: str, path: str, json: dict[str, Any]) -> dict[str, Any]:
            sent.append({"method": method, "path": path, **json})
            return {"model_id": "tiny", "version": "v1", "replicas": json["replicas"]}

    monkeypatch.setattr(control, "_client", lambda args, parser: Client())
    monkeypatch.setenv("PAVED_ADMIN_KEY", KEY)
    assert main(["deploy", "scale", "tiny", "v1", "0"]) == 0
    assert main(["deploy", "scale", "tiny", "v1", "3"]) == 0
    assert sent == [
        {"method": "PATCH", "path": "/deployments/tiny/v1", "replicas": 0, "min_replicas": 0},
        {"method": "PATCH", "path": "/deployments/tiny/v1", "replicas": 3},
    ]
