"""The admin API's tenant PATCH (paved.gateway.admin_api) over httpx's ASGI transport, with the
gateway's own error handlers: an explicit null is a 400 naming the field and changes nothing;
an omitted field is left as it is, `{"limits": {}}` clears the limits and `{"models": []}` is
an explicit empty list. (The rest of the admin API, driven by the CLI: admin_cli_test.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from in_process import app_with

from paved.gateway.admin_api import admin_router
from paved.gateway.auth import AdminAuth
from paved.gateway.state import GatewayStore

ADMIN_KEY = "test-admin-key-0123456789"
NO_LIMITS = {"requests_per_min": None, "tokens_per_min": None, "max_concurrent": None}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GatewayStore]:
    s = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    asyncio.run(s.start())
    yield s
    asyncio.run(s.close())


def test_patch_refuses_null_fields_and_changes_nothing(store):
    """`{"models": null}` once answered 200 (the CLI's tester saw the tenant locked out of every
    model); `{"limits": null}` answered 200 and did nothing. Create refuses a null models too."""
    app = app_with(admin_router(store, AdminAuth(ADMIN_KEY)))

    async def go():
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
            body = {"name": "acme", "models": ["llama"], "limits": {"tokens_per_min": 100}}
            assert (await c.post("/admin/v1/tenants", json=body)).status_code == 201
            r = await c.post("/admin/v1/tenants", json={"name": "other", "models": None})
            assert r.status_code == 400 and r.json()["error"]["param"] == "models", r.text
            for patch, param in (
                ({"models": None}, "models"),
                ({"limits": None}, "limits"),
                ({"models": None, "limits": {"max_concurrent": 1}}, "models"),
                ({"models": ["llama"], "limits": None}, "limits"),
            ):
                r = await c.patch("/admin/v1/tenants/acme", json=patch)
                assert r.status_code == 400, (patch, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == param, error
                assert "valid" in error["message"], error
            [tenant] = (await c.get("/admin/v1/tenants")).json()["data"]
            assert tenant["models"] == ["llama"] and tenant["limits"]["tokens_per_min"] == 100

            r = await c.patch("/admin/v1/tenants/acme", json={})
            assert r.status_code == 200 and r.json()["models"] == ["llama"]
            assert r.json()["limits"]["tokens_per_min"] == 100
            r = await c.patch("/admin/v1/tenants/acme", json={"limits": {}})
            assert r.status_code == 200 and r.json()["models"] == ["llama"]
            assert r.json()["limits"] == NO_LIMITS
            r = await c.patch("/admin/v1/tenants/acme", json={"models": []})
            assert r.status_code == 200 and r.json()["models"] == [] and r.json()["limits"] == NO_LIMITS

    asyncio.run(go())
