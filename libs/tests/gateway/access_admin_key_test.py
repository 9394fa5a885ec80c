"""The admin key as the gateway main loads it, and revocation through the admin API, over real
processes and a real SQLite store: a key that can never be presented, a blank variable and an
unreadable key file are each told at startup, never a silently unusable admin API."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn
from gateway_proc import GatewayProcess, write_routes
from in_process import app_with

from paved.gateway.access.admin_api import admin_router
from paved.gateway.access.auth import (
    AdminAuth,
    Authenticator,
    admin_key_for_run,
    configured_admin_key,
    load_admin_key,
)
from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import AuthError

ROUTES = [{"alias": "tiny", "backends": [{"url": "http://127.0.0.1:9", "version": "v1"}]}]


def _start(tmp_path, *args: str, env: dict[str, str]) -> tuple[int | None, str]:
    """(exit status, stderr) of the gateway main; None if it came up serving (then stopped)."""
    routes = write_routes(tmp_path / "routes.json", ROUTES)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paved.gateway.server",
            "--routes",
            str(routes),
            "--port",
            "0",
            "--state",
            f"sqlite:///{tmp_path / 'gw.sqlite'}",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **env},
    )
    errors: list[bytes] = []
    drain = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    drain.start()
    serving = False
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if b"serving gateway on" in line:
                serving = True
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        drain.join(10)
    return (None if serving else proc.returncode), b"".join(errors).decode(errors="replace")


@pytest.mark.parametrize("key", ["clé-de-l'admin", "ключ-админа"])
def test_an_admin_key_no_client_can_send_is_refused_at_startup(tmp_path, key):
    # Starlette reads a header as latin-1 and httpx sends only ASCII: the old gateway started
    # with such a key and answered every admin call 401.
    status, stderr = _start(tmp_path, env={"PAVED_ADMIN_KEY": key})
    assert status == 2, stderr
    assert "printable ASCII" in stderr and "Traceback" not in stderr
    assert key not in stderr


def test_an_unreadable_admin_key_file_is_a_usage_error(tmp_path):
    status, stderr = _start(tmp_path, "--admin-key-file", str(tmp_path / "missing.key"), env={})
    assert status == 2, stderr
    assert "cannot read the admin key file" in stderr and "Traceback" not in stderr


def test_a_blank_admin_key_variable_prints_the_key_it_generates(tmp_path):
    # The old main decided "configured" from the raw variable and the key from the stripped
    # one: "  " made a fresh key that was never shown, so no one could use the admin API.
    routes = write_routes(tmp_path / "routes.json", ROUTES)
    gw = GatewayProcess(routes, admin_key="   ", state_dir=tmp_path)
    try:
        match = re.search(r"admin key for this run \(.*\): (\S+)", gw.tail())
        assert match, gw.tail()
        gw.admin_key = match.group(1)
        r = gw.admin("GET", "/admin/v1/tenants")
        assert r.status_code == 200, r.text
    finally:
        gw.stop()


def test_admin_key_checks(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="printable ASCII"):
        AdminAuth("clé")
    with pytest.raises(ValueError, match="printable ASCII"):
        AdminAuth("a\nb")
    f = tmp_path / "admin.key"
    f.write_bytes("  sécret\n".encode())
    with pytest.raises(ValueError, match="printable ASCII") as err:
        load_admin_key(f)
    assert "sécret" not in str(err.value)
    # An undecodable byte in the environment arrives as a lone surrogate.
    monkeypatch.setenv("PAVED_ADMIN_KEY", "key\udcff")
    with pytest.raises(ValueError, match="PAVED_ADMIN_KEY"):
        load_admin_key(None)
    admin = AdminAuth(" spaced admin key ")
    admin.check("Bearer spaced admin key")


def test_only_a_key_nobody_configured_is_generated_and_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAVED_ADMIN_KEY", " \t")
    # The argument check validates without making (and dropping) a key of its own.
    assert configured_admin_key(None) is None
    key = admin_key_for_run(None, "gateway")
    shown = capsys.readouterr().err
    assert shown.count(key) == 1 and shown.startswith("gateway: admin key for this run")
    monkeypatch.setenv("PAVED_ADMIN_KEY", "chosen-key")
    assert admin_key_for_run(None, "gateway") == "chosen-key"
    f = tmp_path / "admin.key"
    f.write_text("from-file\n")
    assert admin_key_for_run(f, "control plane") == "from-file"
    assert capsys.readouterr().err == ""  # a configured key is never printed


def test_a_revoke_takes_effect_on_this_replica_at_once(tmp_path):
    """The admin API drops the revoked key from this replica's auth cache: no window in which
    the key it just answered 'revoked' for still works here."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    store = GatewayStore(f"sqlite:///{tmp_path / 'gw.sqlite'}")
    run(store.start())
    run(store.create_tenant("acme"))
    info, plaintext = run(store.create_key("acme"))
    # The longest cache the Authenticator takes: the window the old admin API left open.
    authn = Authenticator(store, cache_s=60)
    app = app_with(admin_router(store, AdminAuth("adm-key"), on_revoke=authn.invalidate))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.run_coroutine_threadsafe(server.serve(), loop)
    try:
        while not server.started:
            assert not task.done(), task.exception()
            threading.Event().wait(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        assert run(authn.authenticate(f"Bearer {plaintext}")).key_id == info.key_id
        r = httpx.post(
            f"http://127.0.0.1:{port}/admin/v1/keys/{info.key_id}/revoke",
            headers={"Authorization": "Bearer adm-key"},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["revoked_at"], r.text
        with pytest.raises(AuthError) as err:
            run(authn.authenticate(f"Bearer {plaintext}"))
        assert err.value.code == "revoked_api_key"
    finally:
        server.should_exit = True
        task.result(30)
        run(store.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--semantic-cache-mb", "0"], "--semantic-cache-mb must be 1..1048576"),
        (["--exact-cache-mb", "0"], "--exact-cache-mb must be 1..1048576"),
        (["--queue-charge-unit", "0"], "--queue-charge-unit must be in (0, 3600] seconds"),
        (["--admin-key-file", "/nonexistent/admin.key"], "cannot read the admin key file"),
    ],
)
def test_gateway_usage_errors_exit_2_before_starting(tmp_path, capsys, argv, message):
    from paved.gateway.server import main

    routes = write_routes(tmp_path / "routes.json", ROUTES)
    with pytest.raises(SystemExit) as exit_:
        main(["--routes", str(routes), "--state", f"sqlite:///{tmp_path / 'gw.sqlite'}", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "gw.sqlite").exists()  # nothing started, nothing written
