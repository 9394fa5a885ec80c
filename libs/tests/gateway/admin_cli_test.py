"""The admin API (paved.gateway.access.admin_api) served by uvicorn on loopback, driven by the `paved`
CLI in-process (main()) and as `python -m paved.cli.main`.

Covers: every admin route refusing a missing or wrong admin key with a 401 OpenAI error body
(before the body is even parsed); body validation (400); tenants create/list/patch; keys
create (plaintext shown once) / list (prefix, never the secret) / revoke, with the created key
authenticating until revoked; exit codes 0 / 1 (API or connection error, one line on stderr) / 2
(usage: also every bad URL option or variable, bad admin key, out-of-range number and id that
would change a URL path, on the gateway's and the control plane's commands, before any
request); the admin key never printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from in_process import app_with
from servers import serve_in_thread

from paved.cli.main import main
from paved.gateway.access import keys
from paved.gateway.access.admin_api import admin_router
from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import AuthError

ADMIN_KEY = "test-admin-key-0123456789"


def make_app(store: GatewayStore) -> FastAPI:
    return app_with(admin_router(store, AdminAuth(ADMIN_KEY)))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GatewayStore]:
    s = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    asyncio.run(s.start())
    yield s
    asyncio.run(s.close())


@pytest.fixture
def gateway(store, monkeypatch) -> Iterator[str]:
    with serve_in_thread(make_app(store)) as url:
        monkeypatch.setenv("PAVED_GATEWAY_URL", url)
        monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
        yield url


def admin_headers(key: str = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert ADMIN_KEY not in out and ADMIN_KEY not in err
    return code, out, err


# -- the API itself ---------------------------------------------------------------------------

ROUTES = [
    ("POST", "/admin/v1/tenants", {"name": "acme"}),
    ("GET", "/admin/v1/tenants", None),
    ("PATCH", "/admin/v1/tenants/acme", {"models": ["x"]}),
    ("POST", "/admin/v1/keys", {"tenant": "acme"}),
    ("GET", "/admin/v1/keys", None),
    ("POST", "/admin/v1/keys/abcdefgh2345/revoke", None),
    ("DELETE", "/admin/v1/keys/abcdefgh2345", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_route_requires_the_admin_key(gateway, store, method, path, body):
    with httpx.Client(base_url=gateway, timeout=10) as client:
        for headers, code in [
            ({}, "missing_api_key"),
            (admin_headers("wrong-key"), "invalid_api_key"),
            ({"Authorization": f"Basic {ADMIN_KEY}"}, "invalid_api_key"),
        ]:
            resp = client.request(method, path, json=body, headers=headers)
            assert resp.status_code == 401, resp.text
            assert resp.headers["www-authenticate"] == "Bearer"
            err = resp.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == code
        # Not even a malformed body gets past the key check.
        resp = client.request(
            method, path, content=b"{not json", headers={"content-type": "application/json"}
        )
        assert resp.status_code == 401
    assert asyncio.run(store.list_tenants()) == []


def test_api_validates_bodies(gateway):
    with httpx.Client(base_url=gateway, timeout=10, headers=admin_headers()) as client:
        assert client.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 201
        bad = [
            ("/admin/v1/tenants", {"name": "acme", "extra": 1}),
            ("/admin/v1/tenants", {"name": "UPPER"}),
            ("/admin/v1/tenants", {"name": "ok", "limits": {"requests_per_min": -1}}),
            ("/admin/v1/tenants", {"name": "ok", "limits": {"requests_per_min": "5"}}),
            ("/admin/v1/tenants", {"name": "ok", "limits": {"rpm": 5}}),
            ("/admin/v1/tenants", {"name": "ok", "models": "llama"}),
            ("/admin/v1/keys", {"tenant": "acme", "expires_in_s": 0}),
            ("/admin/v1/keys", {"tenant": "acme", "expires_in_s": 10, "expires_at": "2100-01-01T00:00:00Z"}),
            ("/admin/v1/keys", {"tenant": "acme", "expires_at": "2100-01-01T00:00:00"}),  # naive
            ("/admin/v1/keys", {"tenant": "acme", "expires_at": "2000-01-01T00:00:00Z"}),  # past
            ("/admin/v1/keys", {"tenant": "acme", "name": "x" * 200}),
        ]
        for path, body in bad:
            resp = client.post(path, json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = client.post("/admin/v1/keys", json={"tenant": "ghost"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "tenant_not_found"
        resp = client.post("/admin/v1/tenants", json={"name": "acme"})
        assert resp.status_code == 409
        resp = client.post("/admin/v1/keys/abcdefgh2345/revoke")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "key_not_found"
        resp = client.get("/admin/v1/keys", params={"tenant": "ghost"})
        assert resp.status_code == 404


def test_api_tenants_and_keys(gateway, store):
    with httpx.Client(base_url=gateway, timeout=10, headers=admin_headers()) as client:
        resp = client.post(
            "/admin/v1/tenants", json={"name": "acme", "models": ["llama"], "limits": {"tokens_per_min": 100}}
        )
        assert resp.status_code == 201
        assert resp.json()["models"] == ["llama"] and resp.json()["limits"]["tokens_per_min"] == 100
        resp = client.patch("/admin/v1/tenants/acme", json={"limits": {"max_concurrent": 4}})
        assert resp.status_code == 200
        assert resp.json()["limits"] == {
            "requests_per_min": None,
            "tokens_per_min": None,
            "max_concurrent": 4,
        }
        assert client.patch("/admin/v1/tenants/ghost", json={}).status_code == 404

        resp = client.post("/admin/v1/keys", json={"tenant": "acme", "name": "ci", "expires_in_s": 3600})
        assert resp.status_code == 201
        created = resp.json()
        assert created["key"].startswith(created["prefix"] + "_") and created["expires_at"]
        assert "secret_hash" not in created
        listed = client.get("/admin/v1/keys", params={"tenant": "acme"}).json()["data"]
        assert [k["key_id"] for k in listed] == [created["key_id"]]
        assert "key" not in listed[0] and created["key"] not in json.dumps(listed)

        principal = asyncio.run(Authenticator(store, cache_s=0).authenticate(f"Bearer {created['key']}"))
        assert principal.tenant.name == "acme"
        resp = client.delete(f"/admin/v1/keys/{created['key_id']}")
        assert resp.status_code == 200 and resp.json()["revoked_at"]
        with pytest.raises(AuthError) as err:
            asyncio.run(Authenticator(store, cache_s=0).authenticate(f"Bearer {created['key']}"))
        assert err.value.code == "revoked_api_key"


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_flow_in_process(gateway, store, capsys):
    code, out, _ = cli(capsys, "tenants", "create", "acme", "--models", "llama,qwen", "--rpm", "60")
    assert code == 0 and "acme" in out
    code, out, _ = cli(capsys, "tenants", "list")
    assert code == 0 and "acme" in out and "llama,qwen" in out and "60" in out
    code, out, _ = cli(capsys, "tenants", "list", "--json")
    assert code == 0 and json.loads(out)[0]["limits"]["requests_per_min"] == 60

    code, out, err = cli(
        capsys, "keys", "create", "--tenant", "acme", "--name", "ci", "--expires-in", "30d", "--tpm", "1000"
    )
    assert code == 0
    plaintext = out.strip()
    key_id, secret = keys.parse_key(plaintext)  # stdout is exactly the key
    assert "will not be shown again" in err

    code, out, _ = cli(capsys, "keys", "list")
    assert code == 0 and f"pvd_{key_id}" in out and secret not in out and "expires" in out
    code, out, _ = cli(capsys, "keys", "list", "--tenant", "acme", "--json")
    data = json.loads(out)
    assert code == 0 and data[0]["key_id"] == key_id and data[0]["limits"]["tokens_per_min"] == 1000
    assert secret not in out

    principal = asyncio.run(Authenticator(store, cache_s=0).authenticate(f"Bearer {plaintext}"))
    assert principal.key_name == "ci" and principal.tenant.models == ("llama", "qwen")

    code, out, _ = cli(capsys, "keys", "revoke", f"pvd_{key_id}")
    assert code == 0 and "Revoked" in out
    code, out, _ = cli(capsys, "keys", "list", "--tenant", "acme")
    assert code == 0 and "revoked" in out
    with pytest.raises(AuthError):
        asyncio.run(Authenticator(store, cache_s=0).authenticate(f"Bearer {plaintext}"))


def test_cli_api_errors_exit_1_with_the_api_message(gateway, capsys, monkeypatch):
    code, out, err = cli(capsys, "keys", "create", "--tenant", "ghost")
    assert code == 1 and out == ""
    assert err.startswith("paved: error: no tenant named 'ghost'") and err.count("\n") == 1

    code, _, err = cli(capsys, "keys", "revoke", "abcdefgh2345")
    assert code == 1 and "HTTP 404" in err

    monkeypatch.setenv("PAVED_ADMIN_KEY", "not-the-admin-key")
    code, out, err = cli(capsys, "tenants", "list")
    assert code == 1 and out == "" and "invalid admin key" in err and "not-the-admin-key" not in err
    code, _, err = cli(capsys, "keys", "list", "--admin-key", "also-wrong-key")
    assert code == 1 and "invalid admin key" in err and "also-wrong-key" not in err


def test_cli_connection_error_exits_1(capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    code, out, err = cli(capsys, "tenants", "list", "--gateway", f"http://127.0.0.1:{port}")
    assert code == 1 and out == ""
    assert err.startswith(f"paved: error: cannot reach the gateway at http://127.0.0.1:{port}")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "create", "--tenant", "acme", "--expires-in", "soon"],
        ["keys", "create", "--tenant", "acme", "--expires-in", "0s"],
        ["keys", "create", "--tenant", "acme", "--expires-in", "-5d"],
        ["keys", "create", "--tenant", "acme", "--expires-in", "99999y"],
        ["keys", "create", "--tenant", "acme", "--rpm", "-1"],
        ["keys", "create", "--tenant", "BAD NAME"],
        ["keys", "create"],
        ["keys", "revoke", "not-an-id"],
        ["keys"],
        ["tenants", "create", "acme", "--models", "a,,b"],
        ["tenants", "list", "--gateway", "ftp://x"],
        ["keys", "create", "--tenant", "acme", "--name", "x" * 129],
        ["keys", "create", "--tenant", "acme", "--name", "two\nlines"],
        ["keys", "create", "--tenant", "acme", "--rpm", "1_000"],
        ["keys", "create", "--tenant", "acme", "--expires-in", "\u0663d"],  # an Arabic-Indic 3
        ["nosuchcommand"],
        [],
    ],
)
def test_cli_usage_errors_exit_2(capsys, monkeypatch, argv):
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    # Nothing listens here: a usage error must be found before any request is made.
    monkeypatch.setenv("PAVED_GATEWAY_URL", "http://127.0.0.1:9")
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "usage:" in err


def usage_error(capsys, argv: list[str]) -> str:
    """Runs argv, which must fail as a usage error: exit 2, argparse's usage and one error line,
    no traceback, and no request (nothing listens at port 9, which would be an exit 1)."""
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == "", (argv, err)
    assert "usage:" in err and "Traceback" not in err, (argv, err)
    return err.strip().splitlines()[-1]


BAD_URLS = [
    "http://127.0.0.1:abc",  # httpx.InvalidURL traceback, once
    "http://[::1",  # the same
    "http://127.0.0.1:0",
    "http://127.0.0.1:65536",
    "http://:8080",
    "http://",
    "ftp://127.0.0.1:21",
    "127.0.0.1:8080",
    "http://127.0.0.1:8080/?q=1",
    "http://127.0.0.1:8080/#x",
    "http://127.0.0.1:80\x00",
    "http://h\u00e9st:80",
    "",
]


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize(
    ("argv", "option", "env"),
    [
        (["keys", "list"], "--gateway", "PAVED_GATEWAY_URL"),
        (["templates", "list"], "--gateway", "PAVED_GATEWAY_URL"),
        (["deploy", "list"], "--control-plane", "PAVED_CONTROL_PLANE_URL"),
        (["gc", "--dry-run"], "--control-plane", "PAVED_CONTROL_PLANE_URL"),
    ],
)
def test_cli_bad_urls_are_usage_errors_naming_the_option(capsys, monkeypatch, url, argv, option, env):
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("PAVED_GATEWAY_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("PAVED_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    line = usage_error(capsys, [*argv, f"{option}={url}"])
    assert f"argument {option}: invalid URL" in line
    # An empty variable means "the default"; an environment variable cannot hold a NUL.
    if url and "\x00" not in url:
        monkeypatch.setenv(env, url)
        line = usage_error(capsys, argv)
        # The variable at fault is named (a control-plane URL was once "invalid gateway URL").
        assert f"{env}: invalid URL" in line and "gateway URL" not in line


@pytest.mark.parametrize("url", ["http://[::1]:9", "https://127.0.0.1:9/base/", "HTTP://127.0.0.1:9"])
def test_cli_good_urls_get_as_far_as_connecting(capsys, monkeypatch, url):
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    code, _, err = cli(capsys, "keys", "list", "--gateway", url)
    assert code == 1 and "cannot reach the gateway" in err and err.count("\n") == 1


BAD_KEYS = ["\u00e9", "caf\u00e9-key", "a\nb", "a b", "a\tb", "a\x7fb", "a\x00b"]


@pytest.mark.parametrize("key", BAD_KEYS)
@pytest.mark.parametrize("argv", [["keys", "list"], ["templates", "list"], ["rollout", "list"]])
def test_cli_bad_admin_keys_are_usage_errors(capsys, monkeypatch, key, argv):
    """A key httpx cannot put in a header was a UnicodeEncodeError traceback, or a misleading
    "cannot reach the gateway" (exit 1); the message names the source and never echoes the key."""
    monkeypatch.setenv("PAVED_GATEWAY_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("PAVED_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    line = usage_error(capsys, [*argv, "--admin-key", key])
    assert "argument --admin-key: the admin key must be" in line and key not in line
    if "\x00" not in key:  # an environment variable cannot hold a NUL
        monkeypatch.setenv("PAVED_ADMIN_KEY", key)
        line = usage_error(capsys, argv)
        assert "PAVED_ADMIN_KEY: the admin key must be" in line and key not in line


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "--min-kept", "0"],  # once a CliError: exit 1
        ["gc", "--min-kept", "1001"],
        ["gc", "--since-created", "0s"],
        ["audit", "--limit", "0"],  # once silently raised to 1
        ["audit", "--limit", "1001"],
        ["audit", "--rollout", ""],
        ["audit", "--model", "a/b"],
        # Ids and names are URL path segments: empty, "..", "/" or "?" would reach another
        # endpoint (an empty id made `rollout abort` POST /v1/rollouts/abort: a 404, exit 1).
        ["rollout", "abort", ""],
        ["rollout", "abort", ".."],
        ["rollout", "status", "."],
        ["rollout", "status", "ro_1/abort"],
        ["rollout", "status", "ro_1?x=1"],
        ["rollout", "status", "ro_1%2Fabort"],
        ["rollout", "list", "--model", ""],
        ["rollout", "start", "tiny", ""],
        ["rollout", "start", "..", "v1"],
        ["rollout", "start", "tiny", "v1", "--interval", "0"],
        ["rollout", "start", "tiny", "v1", "--phases", ",".join(str(p) for p in range(80, 101))],
        ["rollout", "start", "tiny", "v1", "--phases", "\u0665\u0660,100"],
        ["deploy", "delete", "tiny", ""],
        ["deploy", "delete", "tiny", "../../models/tiny"],
        ["deploy", "current", "a/b", "v1"],
        ["deploy", "scale", "tiny", "v1", "257"],
        ["deploy", "scale", "tiny", "v1", "-1"],
        ["deploy", "scale", "tiny", "..", "1"],
        ["deploy", "list", "--model", ""],
        ["deploy", "create", "tiny", "v1", ""],
        ["deploy", "create", "tiny", "v1", "pkg", "--engine", ""],
        ["deploy", "create", "tiny", "v1", "pkg", "--region", ""],
        ["deploy", "create", "tiny", "v1", "pkg", "--replicas", "257"],
        ["deploy", "create", "tiny", "v1", "pkg", "--max", "0"],
        ["deploy", "create", "tiny", "v1", "pkg", "--min", "5", "--max", "2"],
        # httpx refuses NaN when it encodes the body: a ValueError traceback, once.
        ["deploy", "create", "tiny", "v1", "pkg", "--route", '{"max_model_len": NaN}'],
        ["deploy", "create", "tiny", "v1", "pkg", "--route", '{"x": Infinity}'],
    ],
)
def test_control_plane_usage_errors_exit_2(capsys, monkeypatch, argv):
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("PAVED_CONTROL_PLANE_URL", "http://127.0.0.1:9")
    usage_error(capsys, argv)


def test_cli_without_admin_key_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("PAVED_ADMIN_KEY", raising=False)
    code, _, err = cli(capsys, "tenants", "list", "--gateway", "http://127.0.0.1:9")
    assert code == 2 and "PAVED_ADMIN_KEY" in err


def test_cli_help_exits_0(capsys):
    code, out, _ = cli(capsys, "keys", "create", "--help")
    assert code == 0 and "--expires-in" in out and "--tenant" in out


def test_cli_as_a_subprocess(gateway, store):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "PAVED_GATEWAY_URL": gateway,
        "PAVED_ADMIN_KEY": ADMIN_KEY,
    }

    def paved(*argv: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "paved.cli.main", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ADMIN_KEY not in proc.stdout and ADMIN_KEY not in proc.stderr
        return proc

    assert paved("tenants", "create", "acme").returncode == 0
    created = paved("keys", "create", "--tenant", "acme", "--expires-in", "12h")
    assert created.returncode == 0, created.stderr
    key_id, secret = keys.parse_key(created.stdout.strip())
    assert "will not be shown again" in created.stderr
    listed = paved("keys", "list")
    assert listed.returncode == 0 and f"pvd_{key_id}" in listed.stdout and secret not in listed.stdout
    revoked = paved("keys", "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    assert asyncio.run(store.list_keys())[0].revoked_at is not None

    env["PAVED_ADMIN_KEY"] = "wrong-admin-key"
    wrong = paved("keys", "list")
    assert wrong.returncode == 1 and "invalid admin key" in wrong.stderr and wrong.stdout == ""
    bad = paved("keys", "create", "--tenant", "acme", "--expires-in", "forever")
    assert bad.returncode == 2 and "invalid duration" in bad.stderr


# ---- the tenant PATCH over httpx's ASGI transport ----------------------------------------------
def test_patch_refuses_null_fields_and_changes_nothing(store):
    """`{"models": null}` once answered 200 (the CLI's tester saw the tenant locked out of every
    model); `{"limits": null}` answered 200 and did nothing. Create refuses a null models too."""
    app = make_app(store)

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
            assert r.json()["limits"] == {
                "requests_per_min": None,
                "tokens_per_min": None,
                "max_concurrent": None,
            }
            r = await c.patch("/admin/v1/tenants/acme", json={"models": []})
            assert (
                r.status_code == 200
                and r.json()["models"] == []
                and r.json()["limits"]
                == {"requests_per_min": None, "tokens_per_min": None, "max_concurrent": None}
            )

    asyncio.run(go())


def test_rollout_list_reads_every_page(capsys, monkeypatch):
    """GET /v1/rollouts answers a page (at most 1000) and has_more: `paved rollout list` follows
    `after` the page's last id until the end."""
    from paved.cli import control

    made = [f"ro_{i:03d}" for i in range(5)]
    calls: list[dict | None] = []

    class Pages:
        def request(self, method: str, path: str, params: dict | None = None) -> dict:
            assert (method, path) == ("GET", "/rollouts")
            calls.append(params)
            start = made.index(params["after"]) + 1 if params and "after" in params else 0
            page = made[start : start + 2]
            rows = [
                {"id": i, "model_id": "tiny", "from_version": "v1", "to_version": "v2", "status": "succeeded",
                 "phase": "done", "reason": None}
                for i in page
            ]  # fmt: skip
            return {"object": "list", "data": rows, "has_more": start + 2 < len(made), "last_id": page[-1]}

    monkeypatch.setattr(control, "_client", lambda args, parser: Pages())
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    code, out, err = cli(capsys, "rollout", "list", "--model", "tiny")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == made
    assert calls == [{"model_id": "tiny"}, *({"model_id": "tiny", "after": a} for a in ("ro_001", "ro_003"))]
