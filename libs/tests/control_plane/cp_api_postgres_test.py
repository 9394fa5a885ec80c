"""The control plane's REST API on a real PostgreSQL 15 store: ids and URIs carrying control
characters are 4xx answers before any query or replica start. PostgreSQL refuses a NUL in a text
parameter (psycopg's DataError), which was a 500 for a rollout id in the path or the audit's
rollout_id; a NUL in a deployment's engine URI was stored, and every reconcile pass then failed
spawning its replica (a NUL cannot be in a command-line argument)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fleet import tiny_package

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.controller import Controller
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.gateway.access.auth import AdminAuth
from paved.testing.postgres import create_database, postgres_server

KEY = "admin-key-for-tests-0123456789"
_db_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def client(server: str, tmp_path: Path) -> Iterator[TestClient]:
    """The API over a fresh database; the controller's loop is not run."""
    store = ControlStore(create_database(server, f"cp_api_{next(_db_names)}"))
    driver = LocalDriver("local", port_range=(31540, 31560), work_dir=tmp_path / "work")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": driver}, feed, GatewayAnalyzer([]))
    app = create_app(store, controller, feed, AdminAuth(KEY).check)
    # raise_server_exceptions=False: a failure is seen as the 500 a client would get.
    with TestClient(app, raise_server_exceptions=False) as c:
        c.portal.call(store.start)
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c
        c.portal.call(store.close)
    asyncio.run(driver.close())


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_rollout_ids_with_a_nul_are_404_and_400_not_500(client):
    assert _error(client.get("/v1/rollouts/ro_%00x"), 404)["code"] == "rollout_not_found"
    assert _error(client.post("/v1/rollouts/ro_%00x/abort"), 404)["code"] == "rollout_not_found"
    assert _error(client.get("/v1/rollouts/ro_nope"), 404)["code"] == "rollout_not_found"
    error = _error(client.get("/v1/audit", params={"rollout_id": "ro_\x00"}), 400)
    assert "rollout_id" in error["message"], error
    assert client.get("/v1/audit", params={"rollout_id": "ro_0123"}).json()["data"] == []


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("engine", "sim://tiny?tokenizer=/a\x00b", "bad_engine"),
        ("engine", "sim://tiny?tokenizer=/a\nb", "bad_engine"),
        ("package_uri", "PACKAGE\x00", "bad_package"),
        ("package_uri", "PACKAGE\x1b[2J", "bad_package"),
    ],
)
def test_control_characters_in_a_deployments_uris_are_400(client, field, value, code):
    body = {"model_id": "tiny", "version": "v1", "package_uri": tiny_package(), "engine": "sim://tiny"}
    body[field] = value.replace("PACKAGE", tiny_package())
    assert _error(client.post("/v1/deployments", json=body), 400)["code"] == code
    _error(client.get("/v1/deployments/tiny/v1"), 404)  # nothing stored
