"""The gateway following the control plane's routes feed (`--routes http://...`).

A small FastAPI app serving `paved.control_plane.routes_feed.routes_api` over a store plays the
control plane (in a thread, on a fixed loopback port so it can be stopped and restarted).
HttpRoutesSource is exercised in process (invalid tables, tokens, the cache), then the real
gateway main in front of two paved frontends on the simulated engine: table changes are
followed, a stopped control plane leaves the last table serving with `last_error` shown, a
restarted one is followed again, and a gateway restarted while it is down serves its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from gateway_proc import GatewayProcess
from servers import ServerProcess

from paved.control_plane.errors import ControlError
from paved.control_plane.routes_feed import RoutesFeed, routes_api
from paved.control_plane.store import ControlStore
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import RoutesError, parse_routes
from paved.gateway.routing.watch_source import HttpRoutesSource, routes_url

SIM = "sim://tiny?tokens_per_s=400&max_num_seqs=64"
TOKEN = "cp-" + secrets.token_hex(12)


def sqlite_store(path: Path) -> ControlStore:
    """The real ControlStore on a SQLite file, started. It is loop-agnostic (its work runs in
    threads), so one instance outlives control-plane restarts, each on its own event loop."""
    store = ControlStore(f"sqlite:///{path}")
    asyncio.run(store.start())
    return store


def check_auth(authorization: str | None) -> None:
    if authorization != f"Bearer {TOKEN}":
        raise ControlError(401, "missing or wrong routes token", code="unauthorized")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ControlPlane:
    """routes_api over `store` served by uvicorn in a thread on 127.0.0.1:`port`; a test-only
    POST /test/publish publishes through the feed (on the server's own loop)."""

    def __init__(self, store: ControlStore, port: int | None = None):
        self.store = store
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ControlPlane:
        feed = RoutesFeed(self.store, poll_s=0.1)
        app = FastAPI()
        app.include_router(routes_api(feed, check_auth))

        @app.post("/test/publish")
        async def publish(request: Request) -> dict[str, int]:
            return {"revision": await feed.publish(await request.json())}

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(
            app, loop="asyncio", http="h11", log_level="warning", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("control plane did not start")
            time.sleep(0.01)
        self._sock = sock
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
            assert not self._thread.is_alive(), "control plane thread did not stop"
            self._sock.close()
        self._server = self._thread = None

    def publish(self, tbl: dict[str, Any]) -> int:
        r = httpx.post(self.url + "/test/publish", json=tbl, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["revision"]


@contextlib.contextmanager
def control_plane(db: Path, port: int | None = None):
    store = sqlite_store(db)
    cp = ControlPlane(store, port).start()
    try:
        yield cp
    finally:
        cp.stop()
        asyncio.run(store.close())


def table(*urls: str, alias: str = "tiny") -> dict[str, Any]:
    return {"models": [{"alias": alias, "backends": [{"url": u, "version": "v1"} for u in urls]}]}


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    """Poll until predicate() is truthy; the assertion is on the state, the deadline only
    bounds a broken run."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def async_wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def empty_router() -> Router:
    return Router(parse_routes({"models": []}))


def urls_of(router: Router) -> set[str]:
    return {b.url for r in router.table.models.values() for b in r.backends}


# -- HttpRoutesSource in process ------------------------------------------------------------------


def test_routes_url_validation() -> None:
    assert routes_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000/v1/routes"
    assert routes_url("http://cp.internal:9000/") == "http://cp.internal:9000/v1/routes"
    assert routes_url("https://cp/api/v1/routes") == "https://cp/api/v1/routes"
    for bad in ("ftp://h/x", "http://", "http://u:p@h:1", "http://h:1/?after=3", "http://h:99999"):
        with pytest.raises(RoutesError):
            routes_url(bad)


def test_follows_publishes_and_keeps_the_last_table_on_a_bad_one(tmp_path: Path) -> None:
    with control_plane(tmp_path / "cp.sqlite") as cp:
        cp.publish(table("http://127.0.0.1:8001"))

        async def run() -> None:
            router = empty_router()
            source = HttpRoutesSource(
                cp.url, router, token=TOKEN, timeout_s=5, retry_s=0.05, cache_file=tmp_path / "c.json"
            )
            await source.start()
            try:
                assert urls_of(router) == {"http://127.0.0.1:8001"} and source.last_error is None
                assert source.feed_revision == 1 and source.revision == router.table.revision
                # A publish wakes the long poll (timeout_s=5 would otherwise hold it).
                await asyncio.to_thread(cp.publish, table("http://127.0.0.1:8002"))
                await async_wait_for(lambda: urls_of(router) == {"http://127.0.0.1:8002"}, "second table")
                good = router.table.revision
                # The cache is written right after the swap.
                await async_wait_for(
                    lambda: json.loads((tmp_path / "c.json").read_text())["revision"] == 2, "cache"
                )
                cached = json.loads((tmp_path / "c.json").read_text())
                assert cached["revision"] == 2 and parse_routes(cached["table"]).revision == good
                # A row the feed would have refused: the table in force stays, the error shows.
                # (the store validates only that it is a JSON object: meaning is the feed's job)
                await cp.store.publish_routes({"models": [{"alias": "x@y", "backends": []}]})
                await async_wait_for(lambda: source.last_error is not None, "last_error")
                assert "revision 3" in (source.last_error or "") and "alias" in (source.last_error or "")
                assert router.table.revision == good and source.feed_revision == 2
                # The next valid revision applies and clears the error.
                await asyncio.to_thread(cp.publish, table("http://127.0.0.1:8003"))
                await async_wait_for(lambda: urls_of(router) == {"http://127.0.0.1:8003"}, "fourth table")
                assert source.last_error is None and source.feed_revision == 4
            finally:
                await source.stop()

        asyncio.run(run())


def test_wrong_token_and_unreachable_control_plane_at_start(tmp_path: Path) -> None:
    with control_plane(tmp_path / "cp.sqlite") as cp:
        cp.publish(table("http://127.0.0.1:8001"))

        async def wrong_token() -> None:
            source = HttpRoutesSource(cp.url, empty_router(), token="nope", retry_s=0.1, start_timeout_s=0.5)  # noqa: S106
            with pytest.raises(RoutesError, match=r"HTTP 401.*wrong routes token") as err:
                await source.start()
            assert "nope" not in str(err.value)
            await source.stop()

        asyncio.run(wrong_token())
    port = cp.port  # stopped now: connections are refused

    async def unreachable() -> None:
        source = HttpRoutesSource(
            f"http://127.0.0.1:{port}", empty_router(), retry_s=0.1, start_timeout_s=0.5
        )
        with pytest.raises(RoutesError, match="no routes table within"):
            await source.start()
        await source.stop()
        source = HttpRoutesSource(
            f"http://127.0.0.1:{port}",
            empty_router(),
            retry_s=0.1,
            start_timeout_s=0.5,
            cache_file=tmp_path / "missing.json",
        )
        with pytest.raises(RoutesError, match="no cache at"):
            await source.start()
        await source.stop()
        (tmp_path / "bad.json").write_text('{"revision": 1, "table": {"models": 3}}')
        source = HttpRoutesSource(
            f"http://127.0.0.1:{port}",
            empty_router(),
            retry_s=0.1,
            start_timeout_s=0.5,
            cache_file=tmp_path / "bad.json",
        )
        with pytest.raises(RoutesError, match="routes cache"):
            await source.start()
        await source.stop()

    asyncio.run(unreachable())


def test_cache_at_start_then_resync_with_the_control_plane(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    with control_plane(tmp_path / "cp.sqlite") as cp:
        cp.publish(table("http://127.0.0.1:8002"))
        assert cp.publish(table("http://127.0.0.1:8001")) == 2  # the cache will hold revision 2
        port = cp.port

        async def fill_cache() -> None:
            source = HttpRoutesSource(cp.url, empty_router(), token=TOKEN, cache_file=cache)
            await source.start()
            await source.stop()

        asyncio.run(fill_cache())
    assert cache.exists()

    async def run() -> None:
        router = empty_router()
        source = HttpRoutesSource(
            f"http://127.0.0.1:{port}",
            router,
            token=TOKEN,
            retry_s=0.05,
            start_timeout_s=0.5,
            cache_file=cache,
        )
        await source.start()
        try:
            assert urls_of(router) == {"http://127.0.0.1:8001"}
            assert "cached" in (source.last_error or "")
            # The control plane comes back with a rebuilt store whose revisions restart at 1:
            # the gateway resyncs to its latest table instead of waiting for revision > 1.
            fresh = ControlStore(f"sqlite:///{tmp_path / 'rebuilt.sqlite'}")
            await fresh.start()
            assert await fresh.publish_routes(parse_routes(table("http://127.0.0.1:8009")).to_obj()) == 1
            cp2 = await asyncio.to_thread(ControlPlane(fresh, port).start)
            try:
                await async_wait_for(lambda: urls_of(router) == {"http://127.0.0.1:8009"}, "resync")
                assert source.last_error is None and source.feed_revision == 1
            finally:
                await asyncio.to_thread(cp2.stop)
                await fresh.close()
        finally:
            await source.stop()

    asyncio.run(run())


# -- the gateway main --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontends():
    servers = [ServerProcess("--engine", SIM, ready_timeout_s=120) for _ in range(2)]
    yield servers
    for s in servers:
        s.terminate()


def _chat(gw_url: str, key: str) -> httpx.Response:
    return httpx.post(
        gw_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )


def _routes_view(gw: GatewayProcess) -> dict[str, Any]:
    r = gw.admin("GET", "/admin/v1/routes")
    assert r.status_code == 200, r.text
    return r.json()


def test_gateway_main_follows_the_control_plane(frontends, tmp_path: Path) -> None:
    a, b = frontends
    store = sqlite_store(tmp_path / "cp.sqlite")
    cache = tmp_path / "routes-cache.json"
    cp = ControlPlane(store).start()
    gw: GatewayProcess | None = None
    try:
        cp.publish(table(a.url))
        gw = GatewayProcess(
            cp.url,
            "--routes-cache",
            str(cache),
            "--health-interval",
            "0.5",
            admin_key="adm-" + secrets.token_hex(16),
            state_dir=tmp_path,
            env={"PAVED_ROUTES_TOKEN": TOKEN},
        )
        gw.tenant("acme", models=["tiny"])
        key = gw.key("acme")
        r = _chat(gw.url, key)
        assert r.status_code == 200 and r.headers["x-paved-backend"] == a.url, r.text
        view = _routes_view(gw)
        assert view["revision"] == parse_routes(table(a.url)).revision and view["last_error"] is None

        # A new table is followed (the long poll is woken by the publish).
        cp.publish(table(b.url))
        target = parse_routes(table(b.url)).revision
        wait_for(lambda: _routes_view(gw)["revision"] == target, "the gateway to follow table 2")
        r = _chat(gw.url, key)
        assert r.status_code == 200 and r.headers["x-paved-backend"] == b.url

        # Control plane down: the last table keeps serving; the error is visible.
        cp.stop()
        wait_for(lambda: _routes_view(gw)["last_error"], "last_error after the control plane stopped")
        assert _routes_view(gw)["revision"] == target
        for _ in range(3):
            r = _chat(gw.url, key)
            assert r.status_code == 200 and r.headers["x-paved-backend"] == b.url, r.text

        # Restarted (same store, same port): followed again, the error clears.
        cp = ControlPlane(store, cp.port).start()
        both = table(a.url, b.url)
        cp.publish(both)
        wait_for(
            lambda: (
                (v := _routes_view(gw))["revision"] == parse_routes(both).revision and v["last_error"] is None
            ),
            "the gateway to follow the restarted control plane",
        )
        seen = {_chat(gw.url, key).headers["x-paved-backend"] for _ in range(20)}
        assert seen <= {a.url, b.url} and seen

        # The token never reaches the logs.
        assert TOKEN not in gw.tail(10_000)

        # Gateway restarted while the control plane is down: it serves its cache.
        gw.stop()
        cp.stop()
        gw = GatewayProcess(
            cp.url,
            "--routes-cache",
            str(cache),
            admin_key=gw.admin_key,
            state_dir=tmp_path,
            env={"PAVED_ROUTES_TOKEN": TOKEN},
        )
        view = _routes_view(gw)
        assert view["revision"] == parse_routes(both).revision and "cached" in view["last_error"]
        r = _chat(gw.url, key)
        assert r.status_code == 200, r.text
    finally:
        if gw is not None:
            gw.stop()
        cp.stop()
        asyncio.run(store.close())


def test_gateway_main_without_routes_exits_2(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paved.gateway.server",
            "--routes",
            f"http://127.0.0.1:{port}",
            "--port",
            "0",
            "--state",
            f"sqlite:///{tmp_path / 'gw.sqlite'}",
        ],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PAVED_ADMIN_KEY": "adm-" + secrets.token_hex(16)},
    )
    assert proc.returncode == 2, proc.stderr.decode()
    assert b"no routes from" in proc.stderr and b"no routes table within" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "paved.gateway.server", "--routes", "routes.json", "--routes-cache", "x"],
        capture_output=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert bad.returncode == 2 and b"--routes-cache needs --routes http" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--queue-size", "-1"], b"--queue-size must be 0..1000000"),
        (["--queue-size", "many"], b"--queue-size: invalid int value"),
        (["--queue-max-wait", "0"], b"--queue-max-wait must be in (0, 3600] seconds"),
        (["--queue-max-wait", "nan"], b"--queue-max-wait must be in (0, 3600] seconds"),
        (["--queue-max-wait", "inf"], b"--queue-max-wait must be in (0, 3600] seconds"),
        (["--wake-max-wait", "0"], b"--wake-max-wait must be in (0, 3600] seconds"),
        (["--wake-max-wait", "nan"], b"--wake-max-wait must be in (0, 3600] seconds"),
        (["--wake-max-wait", "1e9"], b"--wake-max-wait must be in (0, 3600] seconds"),
        (["--tenant-weight", "acme"], b"--tenant-weight"),
        (["--tenant-weight", "acme=-2"], b"--tenant-weight"),
        (["--tenant-weight", "acme=nan"], b"--tenant-weight"),
    ],
)
def test_gateway_main_refuses_bad_flow_control_flags_with_exit_2(flags: list[str], needle: bytes) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "paved.gateway.server", "--routes", "routes.json", *flags],
        capture_output=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert proc.returncode == 2, proc.stderr.decode()
    assert needle in proc.stderr, proc.stderr.decode()
