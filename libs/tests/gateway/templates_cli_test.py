"""`paved templates ...` (paved.cli.templates) driven in-process through main() against the
templates admin API served by uvicorn on loopback (a SQLite GatewayStore underneath).

Covers: create from --system/--user and from --file (a list, an {messages, description} object,
stdin), new versions, list (catalog and versions, table and JSON), show (latest and pinned),
tenant prompting shown, set, partly updated and cleared; the API's refusals and 404s exiting 1
with one line on stderr; usage errors exiting 2 before any request; the admin key never printed.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from in_process import app_with
from servers import serve_in_thread

from paved.cli.main import main
from paved.gateway.access.auth import AdminAuth
from paved.gateway.access.state import GatewayStore
from paved.gateway.orchestration.templates import TemplateRegistry, TenantPrompting, templates_router

ADMIN_KEY = "templates-cli-admin-key-0123456789"


def make_app(registry: TemplateRegistry) -> FastAPI:
    return app_with(templates_router(registry, AdminAuth(ADMIN_KEY)))


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[TemplateRegistry]:
    store = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    asyncio.run(store.start())
    asyncio.run(store.create_tenant("acme"))
    reg = TemplateRegistry(store)
    asyncio.run(reg.start())
    yield reg
    asyncio.run(reg.close())
    asyncio.run(store.close())


@pytest.fixture
def gateway(registry, monkeypatch) -> Iterator[str]:
    with serve_in_thread(make_app(registry)) as url:
        monkeypatch.setenv("PAVED_GATEWAY_URL", url)
        monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
        yield url


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert ADMIN_KEY not in out and ADMIN_KEY not in err
    return code, out, err


def test_create_list_show(gateway, registry, capsys, tmp_path, monkeypatch):
    code, out, _ = cli(
        capsys, "templates", "create", "greet", "--system", "Be {{ tone }}.", "--user", "Hi {{ name }}",
        "--description", "a greeting",
    )  # fmt: skip
    assert code == 0 and out.strip() == "Created template greet@1 (2 messages)."
    first = asyncio.run(registry.get("greet@1"))
    assert [dict(m) for m in first.messages] == [
        {"role": "system", "content": "Be {{ tone }}."},
        {"role": "user", "content": "Hi {{ name }}"},
    ]
    assert first.description == "a greeting"

    as_list = tmp_path / "v2.json"
    as_list.write_text(json.dumps([{"role": "developer", "content": "v2 {{ x }}"}]))
    code, out, _ = cli(capsys, "templates", "create", "greet", "--file", str(as_list))
    assert code == 0 and "greet@2 (1 message)" in out
    as_object = tmp_path / "other.json"
    as_object.write_text(
        json.dumps({"messages": [{"role": "user", "content": "o"}], "description": "from file"})
    )
    assert cli(capsys, "templates", "create", "other", "--file", str(as_object))[0] == 0
    assert asyncio.run(registry.get("other")).description == "from file"
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([{"role": "user", "content": "stdin"}])))
    code, out, _ = cli(capsys, "templates", "create", "piped", "--file", "-", "--description", "p")
    assert code == 0 and "piped@1" in out
    assert asyncio.run(registry.get("piped")).messages[0]["content"] == "stdin"

    code, out, _ = cli(capsys, "templates", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["TEMPLATE", "MESSAGES", "CREATED", "DESCRIPTION"]
    assert [line.split()[0] for line in lines[1:]] == ["greet@2", "other@1", "piped@1"]
    code, out, _ = cli(capsys, "templates", "list", "greet", "--json")
    assert code == 0 and [t["ref"] for t in json.loads(out)] == ["greet@1", "greet@2"]

    code, out, _ = cli(capsys, "templates", "show", "greet")
    assert code == 0 and out.startswith("greet@2 ") and "--- developer ---\nv2 {{ x }}" in out
    code, out, _ = cli(capsys, "templates", "show", "greet@1")
    assert code == 0 and "a greeting" in out and "--- system ---\nBe {{ tone }}." in out
    code, out, _ = cli(capsys, "templates", "show", "greet@1", "--json")
    assert code == 0 and json.loads(out)["messages"][1]["content"] == "Hi {{ name }}"


def test_tenant_prompting(gateway, registry, capsys):
    assert cli(capsys, "templates", "create", "greet", "--user", "hi")[0] == 0
    code, out, _ = cli(capsys, "templates", "tenant", "acme")
    assert code == 0 and "default template: -" in out and "system prompt:    -" in out

    code, out, _ = cli(
        capsys, "templates", "tenant", "acme", "--system-prompt", "Be brief.", "--default-template", "greet@1"
    )
    assert code == 0 and "greet@1" in out and "Be brief." in out
    assert asyncio.run(registry.tenant_prompting("acme", fresh=True)) == TenantPrompting(
        "acme", "Be brief.", "greet@1"
    )
    # Only the field given changes.
    code, _, _ = cli(capsys, "templates", "tenant", "acme", "--default-template", "greet")
    assert code == 0
    assert asyncio.run(registry.tenant_prompting("acme", fresh=True)) == TenantPrompting(
        "acme", "Be brief.", "greet"
    )
    code, out, _ = cli(capsys, "templates", "tenant", "acme", "--system-prompt", "", "--json")
    assert code == 0 and json.loads(out) == {
        "tenant": "acme",
        "system_prompt": None,
        "default_template": "greet",
    }


def test_api_errors_exit_1_with_one_line(gateway, registry, capsys, monkeypatch):
    code, out, err = cli(capsys, "templates", "create", "evil", "--user", "{{ ''.__class__.__mro__ }}")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("paved: error: ") and "'__mro__' is not allowed" in err and "HTTP 400" in err
    assert asyncio.run(registry.list()) == []

    for argv, text in [
        (["templates", "show", "missing"], "no prompt template 'missing'"),
        (["templates", "show", "missing@2"], "HTTP 404"),
        (["templates", "list", "missing"], "HTTP 404"),
        (["templates", "tenant", "ghost"], "no tenant named 'ghost'"),
        (["templates", "tenant", "acme", "--default-template", "missing"], "no prompt template 'missing'"),
    ]:
        code, out, err = cli(capsys, *argv)
        assert code == 1 and out == "" and text in err and err.count("\n") == 1, (argv, err)

    monkeypatch.setenv("PAVED_ADMIN_KEY", "wrong-admin-key")
    code, _, err = cli(capsys, "templates", "list")
    assert code == 1 and "invalid admin key" in err and "wrong-admin-key" not in err


def test_unreadable_files_exit_1(gateway, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = cli(capsys, "templates", "create", "t", "--file", str(bad))
    assert code == 1 and "not valid JSON" in err
    code, _, err = cli(capsys, "templates", "create", "t", "--file", str(tmp_path / "absent.json"))
    assert code == 1 and "cannot read" in err
    scalar = tmp_path / "scalar.json"
    scalar.write_text("5")
    code, _, err = cli(capsys, "templates", "create", "t", "--file", str(scalar))
    assert code == 1 and "list of messages" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["templates"],
        ["templates", "create", "t"],
        ["templates", "create", "Bad Name", "--user", "x"],
        ["templates", "create", "t", "--file", "f.json", "--user", "x"],
        ["templates", "create", "t", "--file", "f.json", "--system", "x"],
        ["templates", "show", "t@0"],
        ["templates", "show", "t@x"],
        ["templates", "list", "UPPER"],
        ["templates", "tenant", "BAD"],
        ["templates", "tenant", "acme", "--default-template", "bad ref"],
        # An empty path once opened "." and failed as an I/O error (exit 1).
        ["templates", "create", "t", "--file", ""],
        ["templates", "show", ""],
        ["templates", "show", "../keys"],
        ["templates", "list", "--gateway", "http://[::1"],
        ["templates", "list", "--gateway", "http://127.0.0.1:abc"],
        ["templates", "list", "--admin-key", "key with spaces"],
    ],
)
def test_usage_errors_exit_2(capsys, monkeypatch, argv):
    monkeypatch.setenv("PAVED_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("PAVED_GATEWAY_URL", "http://127.0.0.1:9")  # nothing listens: no request is made
    code, _, err = cli(capsys, *argv)
    assert code == 2 and "usage:" in err and "Traceback" not in err
