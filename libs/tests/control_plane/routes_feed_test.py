"""RoutesFeed and its HTTP API: publish validates and normalises, the long poll wakes on a
publish (no waiting for the poll interval), answers 204 when nothing comes, and two feeds on one
store (two control-plane replicas) see each other's publishes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from paved.control_plane.errors import BadRequest, ControlError, Unavailable
from paved.control_plane.routes_feed import MAX_WAIT_S, RoutesFeed, routes_api
from paved.control_plane.store import ControlStore
from paved.gateway.routing.routes import parse_routes


class CountingStore(ControlStore):
    """The real SQLite ControlStore, counting routes reads."""

    reads = 0

    async def latest_routes(self) -> tuple[int, dict[str, Any]] | None:
        self.reads += 1
        return await super().latest_routes()


@contextlib.asynccontextmanager
async def sqlite_store(path: Path) -> AsyncIterator[CountingStore]:
    store = CountingStore(f"sqlite:///{path}")
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def down_store(tmp_path: Path) -> ControlStore:
    # A database that cannot be opened (its directory does not exist): every call is a 503.
    return ControlStore(f"sqlite:///{tmp_path / 'missing' / 'cp.sqlite'}")


def table(*ports: int, alias: str = "tiny") -> dict[str, Any]:
    return {
        "models": [
            {"alias": alias, "backends": [{"url": f"http://127.0.0.1:{p}", "version": "v1"} for p in ports]}
        ]
    }


def test_publish_validates_normalises_and_dedups(tmp_path: Path) -> None:
    async def run() -> None:
        async with sqlite_store(tmp_path / "cp.sqlite") as store:
            feed = RoutesFeed(store)
            rev = await feed.publish(table(8001))
            assert feed.latest_revision == rev
            # Stored in the gateway's normalised form: what the gateway parses back is identical.
            assert await store.latest_routes() == (rev, parse_routes(table(8001)).to_obj())
            assert await feed.publish(table(8001)) == rev
            rev2 = await feed.publish(table(8001, 8002))
            assert rev2 > rev
            with pytest.raises(BadRequest, match=r"models\[0\]\.backends\[0\]\.url") as err:
                await feed.publish(
                    {"models": [{"alias": "x", "backends": [{"url": "ftp://h", "version": "v"}]}]}
                )
            assert err.value.status == 400
            with pytest.raises(BadRequest, match="duplicate alias"):
                await feed.publish({"models": table(1)["models"] + table(2)["models"]})
            latest = await store.latest_routes()
            assert latest is not None and latest[0] == rev2

    asyncio.run(run())


def test_wait_returns_at_once_wakes_on_publish_and_times_out(tmp_path: Path) -> None:
    async def run() -> None:
        async with sqlite_store(tmp_path / "cp.sqlite") as store:
            # A poll interval far beyond the test: only the in-process wake-up can answer.
            feed = RoutesFeed(store, poll_s=3600)
            assert await feed.wait(0, 0) is None
            assert await feed.wait(0, 0.05) is None  # nothing published: times out, None
            waiter = asyncio.create_task(feed.wait(0, 30))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            rev = await feed.publish(table(8001))
            got = await asyncio.wait_for(waiter, 10)
            assert got == (rev, parse_routes(table(8001)).to_obj())
            # Newer than `after` answers at once; equal does not.
            assert await feed.wait(0, 30) == got
            assert await feed.wait(rev, 0.05) is None
            # Many waiters all wake on one publish.
            waiters = [asyncio.create_task(feed.wait(rev, 30)) for _ in range(50)]
            await asyncio.sleep(0.05)
            rev2 = await feed.publish(table(8002))
            results = await asyncio.wait_for(asyncio.gather(*waiters), 10)
            assert None not in results and {r[0] for r in results if r is not None} == {rev2}
            # Republishing identical content wakes nobody (no new revision).
            waiter = asyncio.create_task(feed.wait(rev2, 0.3))
            await asyncio.sleep(0.05)
            assert await feed.publish(table(8002)) == rev2
            assert await waiter is None

    asyncio.run(run())


def test_two_feeds_on_one_store_see_each_others_publishes(tmp_path: Path) -> None:
    async def run() -> None:
        # Two control-plane replicas: two stores (engines) on one database file, one feed each.
        async with sqlite_store(tmp_path / "cp.sqlite") as sa, sqlite_store(tmp_path / "cp.sqlite") as sb:
            a, b = RoutesFeed(sa, poll_s=0.05), RoutesFeed(sb, poll_s=0.05)
            waiter = asyncio.create_task(b.wait(0, 30))
            await asyncio.sleep(0.1)
            rev = await a.publish(table(8001))
            got = await asyncio.wait_for(waiter, 10)
            assert got is not None and got[0] == rev
            rev2 = await b.publish(table(8002))
            assert rev2 > rev
            got = await a.wait(rev, 30)
            assert got == (rev2, parse_routes(table(8002)).to_obj())

    asyncio.run(run())


def test_waiters_share_store_reads(tmp_path: Path) -> None:
    async def run() -> None:
        async with sqlite_store(tmp_path / "cp.sqlite") as store:
            feed = RoutesFeed(store, poll_s=3600)
            await asyncio.gather(*(feed.wait(0, 0.2) for _ in range(100)))
            # One read for all of them (the next is due only after poll_s).
            assert store.reads == 1

    asyncio.run(run())


@pytest.mark.parametrize(
    ("after", "timeout_s"),
    [(-1, 1), (True, 1), ("1", 1), (0, -1), (0, MAX_WAIT_S + 1), (0, float("nan"))],
)
def test_wait_rejects_bad_arguments(tmp_path: Path, after: Any, timeout_s: Any) -> None:
    feed = RoutesFeed(down_store(tmp_path))
    with pytest.raises(BadRequest):
        asyncio.run(feed.wait(after, timeout_s))


def test_store_down_is_a_503_not_a_hang(tmp_path: Path) -> None:
    async def run() -> None:
        store = down_store(tmp_path)
        feed = RoutesFeed(store)
        with pytest.raises(Unavailable):
            await feed.wait(0, 5)
        with pytest.raises(Unavailable):
            await feed.publish(table(8001))
        await store.close()

    asyncio.run(run())


def _check_auth(authorization: str | None) -> None:
    if authorization != "Bearer s3cret":
        raise ControlError(401, "missing or wrong token", code="unauthorized")


def _client(feed: RoutesFeed) -> httpx.AsyncClient:
    app = FastAPI()
    app.include_router(routes_api(feed, _check_auth))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp")


def test_http_api(tmp_path: Path) -> None:
    auth = {"Authorization": "Bearer s3cret"}

    async def run() -> None:
        async with sqlite_store(tmp_path / "cp.sqlite") as store:
            feed = RoutesFeed(store, poll_s=3600)
            async with _client(feed) as client:
                r = await client.get("/v1/routes", params={"timeout_s": 0})
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
                r = await client.get("/v1/routes", params={"after": 0, "timeout_s": 0}, headers=auth)
                assert r.status_code == 204 and r.content == b""
                pending = asyncio.create_task(
                    client.get("/v1/routes", params={"after": 0, "timeout_s": 30}, headers=auth)
                )
                await asyncio.sleep(0.05)
                assert not pending.done()
                rev = await feed.publish(table(8001))
                r = await asyncio.wait_for(pending, 10)
                assert r.status_code == 200, r.text
                assert r.json() == {"revision": rev, "table": parse_routes(table(8001)).to_obj()}
                r = await client.get("/v1/routes", params={"after": rev, "timeout_s": 0.05}, headers=auth)
                assert r.status_code == 204
                for params in (
                    {"after": "-1"},
                    {"after": "x"},
                    {"after": "9" * 30},
                    {"timeout_s": "99"},
                    {"timeout_s": "nan"},
                    {"timeout_s": "abc"},
                ):
                    r = await client.get("/v1/routes", params=params, headers=auth)
                    assert r.status_code == 400, (params, r.text)
                    assert r.json()["error"]["message"]
        store = down_store(tmp_path)
        async with _client(RoutesFeed(store)) as client:
            r = await client.get("/v1/routes", params={"timeout_s": 1}, headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
        await store.close()

    asyncio.run(run())
