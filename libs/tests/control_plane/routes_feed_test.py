"""RoutesFeed and its HTTP API: publish validates and normalises, the long poll wakes on a
publish (no waiting for the poll interval), answers 204 when nothing comes, and two feeds on one
store (two control-plane replicas) see each other's publishes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from paved.control_plane.errors import BadRequest, ControlError, Unavailable
from paved.control_plane.routes_feed import MAX_WAIT_S, RoutesFeed, routes_api
from paved.gateway.routes import parse_routes


class FakeStore:
    """publish_routes/latest_routes with the ControlStore semantics: monotonic revisions,
    identical content returns the latest revision without a new row."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.reads = 0
        self.down = False

    async def publish_routes(self, table: dict[str, Any]) -> int:
        if self.down:
            raise Unavailable("database down")
        if self.rows and self.rows[-1] == table:
            return len(self.rows)
        self.rows.append(table)
        return len(self.rows)

    async def latest_routes(self) -> tuple[int, dict[str, Any]] | None:
        self.reads += 1
        if self.down:
            raise Unavailable("database down")
        return (len(self.rows), self.rows[-1]) if self.rows else None


def table(*ports: int, alias: str = "tiny") -> dict[str, Any]:
    return {
        "models": [
            {"alias": alias, "backends": [{"url": f"http://127.0.0.1:{p}", "version": "v1"} for p in ports]}
        ]
    }


def test_publish_validates_normalises_and_dedups() -> None:
    async def run() -> None:
        store = FakeStore()
        feed = RoutesFeed(store)
        rev = await feed.publish(table(8001))
        assert rev == 1 and feed.latest_revision == 1
        # Stored in the gateway's normalised form: what the gateway parses back is identical.
        assert store.rows[0] == parse_routes(table(8001)).to_obj()
        assert await feed.publish(table(8001)) == 1 and len(store.rows) == 1
        assert await feed.publish(table(8001, 8002)) == 2
        with pytest.raises(BadRequest, match=r"models\[0\]\.backends\[0\]\.url") as err:
            await feed.publish({"models": [{"alias": "x", "backends": [{"url": "ftp://h", "version": "v"}]}]})
        assert err.value.status == 400
        with pytest.raises(BadRequest, match="duplicate alias"):
            await feed.publish({"models": table(1)["models"] + table(2)["models"]})
        assert len(store.rows) == 2

    asyncio.run(run())


def test_wait_returns_at_once_wakes_on_publish_and_times_out() -> None:
    async def run() -> None:
        store = FakeStore()
        # A poll interval far beyond the test: only the in-process wake-up can answer.
        feed = RoutesFeed(store, poll_s=3600)
        assert await feed.wait(0, 0) is None
        assert await feed.wait(0, 0.05) is None  # nothing published: times out, None
        waiter = asyncio.create_task(feed.wait(0, 30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        rev = await feed.publish(table(8001))
        got = await asyncio.wait_for(waiter, 10)
        assert got is not None and got[0] == rev and got[1] == store.rows[-1]
        # Newer than `after` answers at once; equal does not.
        assert await feed.wait(0, 30) == got
        assert await feed.wait(rev, 0.05) is None
        # Many waiters all wake on one publish.
        waiters = [asyncio.create_task(feed.wait(rev, 30)) for _ in range(50)]
        await asyncio.sleep(0.05)
        rev2 = await feed.publish(table(8002))
        results = await asyncio.wait_for(asyncio.gather(*waiters), 10)
        assert {r[0] for r in results if r is not None} == {rev2} and None not in results
        # Republishing identical content wakes nobody (no new revision).
        waiter = asyncio.create_task(feed.wait(rev2, 0.3))
        await asyncio.sleep(0.05)
        assert await feed.publish(table(8002)) == rev2
        assert await waiter is None

    asyncio.run(run())


def test_two_feeds_on_one_store_see_each_others_publishes() -> None:
    async def run() -> None:
        store = FakeStore()
        a, b = RoutesFeed(store, poll_s=0.05), RoutesFeed(store, poll_s=0.05)
        waiter = asyncio.create_task(b.wait(0, 30))
        await asyncio.sleep(0.1)
        rev = await a.publish(table(8001))
        got = await asyncio.wait_for(waiter, 10)
        assert got is not None and got[0] == rev
        rev2 = await b.publish(table(8002))
        got = await a.wait(rev, 30)
        assert got is not None and got[0] == rev2 and got[1] == parse_routes(table(8002)).to_obj()

    asyncio.run(run())


def test_waiters_share_store_reads() -> None:
    async def run() -> None:
        store = FakeStore()
        feed = RoutesFeed(store, poll_s=3600)
        await asyncio.gather(*(feed.wait(0, 0.2) for _ in range(100)))
        # One read for all of them (the next is due only after poll_s).
        assert store.reads == 1

    asyncio.run(run())


@pytest.mark.parametrize(
    ("after", "timeout_s"), [(-1, 1), (True, 1), ("1", 1), (0, -1), (0, MAX_WAIT_S + 1), (0, float("nan"))]
)
def test_wait_rejects_bad_arguments(after: Any, timeout_s: Any) -> None:
    feed = RoutesFeed(FakeStore())
    with pytest.raises(BadRequest):
        asyncio.run(feed.wait(after, timeout_s))


def test_store_down_is_a_503_not_a_hang() -> None:
    async def run() -> None:
        store = FakeStore()
        store.down = True
        feed = RoutesFeed(store)
        with pytest.raises(Unavailable):
            await feed.wait(0, 5)
        with pytest.raises(Unavailable):
            await feed.publish(table(8001))

    asyncio.run(run())


def _check_auth(authorization: str | None) -> None:
    if authorization != "Bearer s3cret":
        raise ControlError(401, "missing or wrong token", code="unauthorized")


def test_http_api() -> None:
    async def run() -> None:
        store = FakeStore()
        feed = RoutesFeed(store, poll_s=3600)
        app = FastAPI()
        app.include_router(routes_api(feed, _check_auth))
        auth = {"Authorization": "Bearer s3cret"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            r = await client.get("/v1/routes", params={"timeout_s": 0})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert "s3cret" not in r.text
            r = await client.get("/v1/routes", params={"after": 0, "timeout_s": 0}, headers=auth)
            assert r.status_code == 204 and r.content == b""
            pending = asyncio.create_task(
                client.get("/v1/routes", params={"after": 0, "timeout_s": 30}, headers=auth)
            )
            await asyncio.sleep(0.05)
            rev = await feed.publish(table(8001))
            r = await asyncio.wait_for(pending, 10)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body == {"revision": rev, "table": parse_routes(table(8001)).to_obj()}
            assert parse_routes(body["table"]).revision == parse_routes(table(8001)).revision
            r = await client.get("/v1/routes", params={"after": rev, "timeout_s": 0.05}, headers=auth)
            assert r.status_code == 204
            for params in (
                {"after": "-1"},
                {"after": "x"},
                {"timeout_s": "99"},
                {"timeout_s": "nan"},
                {"after": "9" * 30},
            ):
                r = await client.get("/v1/routes", params=params, headers=auth)
                assert r.status_code == 400, (params, r.text)
                assert r.json()["error"]["message"]
            store.down = True
            feed2 = RoutesFeed(store)
            app2 = FastAPI()
            app2.include_router(routes_api(feed2, _check_auth))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url="http://cp") as c2:
                r = await c2.get("/v1/routes", params={"timeout_s": 1}, headers=auth)
                assert r.status_code == 503 and r.headers["retry-after"]

    asyncio.run(run())
