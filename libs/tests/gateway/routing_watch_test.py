"""HttpRoutesSource against the control plane's real routes feed (`routes_api` over a
ControlStore on SQLite, served by uvicorn on loopback) with a table of a realistic size:
thousands of backends, hundreds of KiB of JSON.

- The whole body is read: aiohttp's StreamReader.read(n) answers the bytes that have arrived
  (a chunk), not n bytes, and a single call cut any table past the first chunk short ("invalid
  JSON"): the gateway could neither start from nor follow such a table.
- The table is validated off the event loop, as FileRoutesSource does: parse_routes over
  thousands of backends takes hundreds of milliseconds, which on the loop stalls every request
  and stream of the gateway at each publish.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from paved.control_plane.errors import ControlError
from paved.control_plane.routes_feed import RoutesFeed, routes_api
from paved.control_plane.store import ControlStore
from paved.gateway.routing import watch_source
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import parse_routes
from paved.gateway.routing.watch_source import HttpRoutesSource

TOKEN = "cp-" + secrets.token_hex(12)


def _check_auth(authorization: str | None) -> None:
    if authorization != f"Bearer {TOKEN}":
        raise ControlError(401, "missing or wrong routes token", code="unauthorized")


class _ControlPlane:
    """routes_api over a real ControlStore, served by uvicorn in a thread on loopback; a
    test-only POST /test/publish publishes through the feed."""

    def __init__(self, db: Path):
        self.store = ControlStore(f"sqlite:///{db}")
        asyncio.run(self.store.start())
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        feed = RoutesFeed(self.store, poll_s=0.1)
        app = FastAPI()
        app.include_router(routes_api(feed, _check_auth))

        @app.post("/test/publish")
        async def publish(request: Request) -> dict[str, int]:
            return {"revision": await feed.publish(await request.json())}

        config = uvicorn.Config(
            app, loop="asyncio", http="h11", log_level="warning", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("control plane did not start")
            time.sleep(0.01)

    def publish(self, table: dict[str, Any]) -> int:
        r = httpx.post(self.url + "/test/publish", json=table, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["revision"]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        assert not self._thread.is_alive(), "control plane thread did not stop"
        self._sock.close()
        asyncio.run(self.store.close())


@pytest.fixture
def control_plane(tmp_path: Path):
    cp = _ControlPlane(tmp_path / "cp.sqlite")
    try:
        yield cp
    finally:
        cp.stop()


def _big_table(models: int, per_model: int, tag: str) -> dict[str, Any]:
    """A table of models * per_model backends (hostnames as a cluster names its pods)."""
    return {
        "models": [
            {
                "alias": f"model-{m}",
                "strategy": "prefix_affinity",
                "backends": [
                    {
                        "id": f"{tag}-{m}-{i}",
                        "url": f"http://{tag}-{m}-{i}.model-{m}.paved.svc.cluster.local:8000",
                        "version": "v1",
                    }
                    for i in range(per_model)
                ],
            }
            for m in range(models)
        ]
    }


def _count(router: Router) -> int:
    return sum(len(r.backends) for r in router.table.models.values())


async def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _follow(control_plane: _ControlPlane, cache_file: Path, table: dict[str, Any], want: int) -> None:
    """A source started on the control plane's table follows it to `table` (`want` backends),
    then stops."""
    router = Router(parse_routes({"models": []}))
    source = HttpRoutesSource(
        control_plane.url, router, token=TOKEN, timeout_s=5, retry_s=0.05, start_timeout_s=5,
        cache_file=cache_file,
    )  # fmt: skip
    await source.start()
    try:
        await asyncio.to_thread(control_plane.publish, table)
        await _wait_for(lambda: _count(router) == want, "the second table")
    finally:
        await source.stop()


async def _served_offline(cache_file: Path) -> int:
    """The backends a gateway restarted while the control plane is down serves from the cache."""
    cached = Router(parse_routes({"models": []}))
    offline = HttpRoutesSource("http://127.0.0.1:9", cached, start_timeout_s=0.2, cache_file=cache_file)
    await offline.start()
    try:
        return _count(cached)
    finally:
        await offline.stop()


def test_a_table_of_hundreds_of_kib_is_read_whole(control_plane, tmp_path: Path) -> None:
    control_plane.publish(_big_table(20, 100, "a"))  # 2,000 backends, ~220 KB of JSON

    async def run() -> None:
        router = Router(parse_routes({"models": []}))
        source = HttpRoutesSource(
            control_plane.url, router, token=TOKEN, timeout_s=5, retry_s=0.05, start_timeout_s=5,
            cache_file=tmp_path / "cache.json",
        )  # fmt: skip
        await source.start()
        try:
            assert source.last_error is None, source.last_error
            assert _count(router) == 2000 and source.feed_revision == 1
            # Followed too, not only at start.
            await asyncio.to_thread(control_plane.publish, _big_table(20, 120, "b"))
            await _wait_for(lambda: _count(router) == 2400, "the second table")
            assert source.last_error is None and source.feed_revision == 2
        finally:
            await source.stop()
        # The cache it wrote is a whole table too: a restart while the control plane is down
        # serves it.
        assert await _served_offline(tmp_path / "cache.json") == 2400

    asyncio.run(run())


def test_tables_are_validated_off_the_event_loop(control_plane, tmp_path: Path, monkeypatch) -> None:
    control_plane.publish(_big_table(2, 10, "a"))
    threads: list[threading.Thread] = []
    real = watch_source.parse_routes

    def recording(obj: Any) -> Any:
        threads.append(threading.current_thread())
        return real(obj)

    monkeypatch.setattr(watch_source, "parse_routes", recording)

    async def run() -> None:
        loop_thread = threading.current_thread()
        await _follow(control_plane, tmp_path / "cache.json", _big_table(2, 11, "b"), 22)
        await _served_offline(tmp_path / "cache.json")
        assert len(threads) == 3  # start, the publish, the cache
        assert all(t is not loop_thread for t in threads)

    asyncio.run(run())


def test_a_stop_during_the_cache_write_waits_for_it(control_plane, monkeypatch, tmp_path: Path) -> None:
    """The router takes a new table before its cache write ends: a stop then (a gateway's
    shutdown) must not cut the write, or the next start offline serves the table before."""
    control_plane.publish(_big_table(2, 10, "a"))
    real = watch_source._save

    def slow(*args: Any) -> None:
        time.sleep(0.5)
        real(*args)

    monkeypatch.setattr(watch_source, "_save", slow)

    async def run() -> None:
        await _follow(control_plane, tmp_path / "cache.json", _big_table(2, 11, "b"), 22)
        assert await _served_offline(tmp_path / "cache.json") == 22

    asyncio.run(run())
