"""The resumable streams' event log in the database, without Redis: on a real PostgreSQL 15 and
on SQLite, each.

Without processes (two replicas = two GatewayStores on one database, each with its own
SqlEventLog and LiveStreams): append and replay from N, a follower on the other replica live
until the final event, a resume past the end gets the final event again (of a stream still
running: once it ends, from memory and from the log), a local reader gets
an event only once the log holds it, the per-tenant cap, the per-stream bound (StreamTrimmed,
never a gap), retention (an expired stream is gone and swept), appends that are retried,
that would leave a hole or that reach a stream gone; one failed flush is retried (the stream
stays resumable), a log that keeps failing costs the stream its resumability, not its
delivery; a deleted stream counts toward no cap. The Redis log's append (a Lua script) keeps
the same contract; its delete leaves its tenant's index, and an unreachable Redis is a 503.

With processes: two gateway mains sharing the database and no Redis, in front of a paved
frontend on the simulated engine: a chat stream cut mid-way on one and resumed with
Last-Event-ID on the other (no gap, no duplicate, the same events as a full replay), a
Responses stream resumed with starting_after on the other, and the clear 404s of a stream
expired and of a resume point trimmed away.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError
from paved.gateway.responses import events as ev
from paved.testing.postgres import create_database, postgres_server
from paved.testing.redis import redis_server

MODEL = "tiny"
_db_names = itertools.count()


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    """A fresh database per test: a SQLite file, or a new database on the module's server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gw.sqlite'}"
    return create_database(request.getfixturevalue("pg_server"), f"ev_{next(_db_names)}")


class _Replica:
    """One gateway replica's side of the log: its own store (connection pool), log and streams."""

    def __init__(self, url: str, bounds: ev.LogBounds):
        self.store = GatewayStore(url)
        self.log = ev.SqlEventLog(self.store, bounds)
        self.streams = ev.LiveStreams(self.log, grace_s=5, flush_interval_s=0.002)

    async def start(self) -> None:
        await self.store.start()
        await self.log.start()

    async def close(self) -> None:
        await self.store.close()


async def _replicas(url: str, bounds: ev.LogBounds | None = None) -> tuple[_Replica, _Replica]:
    bounds = bounds or ev.LogBounds()
    a, b = _Replica(url, bounds), _Replica(url, bounds)
    await a.start()
    await b.start()
    return a, b


def _event(seq: int, text: str = "t") -> bytes:
    return b"id: %d\ndata: %s\n\n" % (seq, text.encode())


def _ids(chunks: list[bytes]) -> list[int]:
    """The ids of the events in `chunks` (a chunk may hold several whole events)."""
    events = [e for e in b"".join(chunks).split(b"\n\n") if e]
    return [int(e.split(b"\n", 1)[0].removeprefix(b"id: ")) for e in events]


async def _collect(events: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in events]


def test_append_replay_follow_live_from_the_other_replica_and_resume_past_the_end(db_url):
    async def go():
        a, b = await _replicas(db_url)
        live = await a.streams.create("s1", "acme")
        for seq in range(5):
            a.streams.push(live, _event(seq))
        # B is not generating s1: it follows from the log, from event 2 on, while A goes on.
        follower = asyncio.create_task(_collect(b.streams.follow("s1", 1)))
        for seq in range(5, 12):
            a.streams.push(live, _event(seq))
            await asyncio.sleep(0)
        a.streams.push(live, _event(12, "[DONE]"), end=True)
        await a.streams.flushed(live)
        assert _ids(await follower) == list(range(2, 13))
        # Replay from N on either replica (A no longer holds it in memory once flushed).
        assert _ids(await _collect(a.streams.follow("s1", 6))) == list(range(7, 13))
        assert _ids(await _collect(b.streams.follow("s1", -1))) == list(range(13))
        # At or past the end: the final event again, so the reader learns how it ended.
        assert _ids(await _collect(b.streams.follow("s1", 12))) == [12]
        assert _ids(await _collect(b.streams.follow("s1", 40))) == [12]
        info = await b.log.info("s1")
        assert info is not None and info.ended and info.last == 12 and info.tenant == "acme"
        rows = await b.log.read("s1", 10, 0)
        assert [(seq, final) for seq, _, final in rows] == [(11, False), (12, True)]
        await a.close()
        await b.close()

    asyncio.run(go())


def test_a_reader_of_a_stream_whose_writer_went_silent_is_ended_not_left_waiting(db_url):
    """The replica writing a stream was killed (nothing ends it in the log): a reader following
    it elsewhere gets what was written, then a comment saying it ends unfinished, instead of
    polling until the stream expires (an hour)."""

    async def go():
        a, b = await _replicas(db_url)
        b.streams.writer_silence_s = 0.5
        live = await a.streams.create("s-silent", "acme")
        for seq in range(3):
            a.streams.push(live, _event(seq))
        await asyncio.sleep(0.1)  # flushed; then A "dies": nothing more, no final event
        chunks = await asyncio.wait_for(_collect(b.streams.follow("s-silent", -1)), 30)
        body = b"".join(chunks)
        assert _ids([body.split(b": the stream")[0]]) == [0, 1, 2]
        assert body.endswith(b"it ends here unfinished\n\n"), body
        await a.close()
        await b.close()

    asyncio.run(go())


def test_a_silent_writer_that_is_vouched_for_keeps_its_readers(db_url):
    """A response's writer holding its lease is alive however long it says nothing (a reasoning
    model thinking, a takeover waking its model): its reader waits; once nothing vouches for
    it, the reader ends. A store that cannot be read counts as vouching."""

    async def go():
        a, b = await _replicas(db_url)
        alive = {"s-think": True}

        async def writer_alive(stream_id: str) -> bool:
            if alive[stream_id] is None:
                raise ConnectionError("the store is down")
            return bool(alive[stream_id])

        b.streams.writer_silence_s = 0.3
        b.streams.writer_alive = writer_alive
        live = await a.streams.create("s-think", "acme")
        a.streams.push(live, _event(0))
        follower = asyncio.create_task(_collect(b.streams.follow("s-think", -1)))
        await asyncio.sleep(1.5)
        alive["s-think"] = None
        await asyncio.sleep(1.5)
        assert not follower.done()  # vouched for, then unknown: still following
        alive["s-think"] = False
        body = b"".join(await asyncio.wait_for(follower, 30))
        assert _ids([body.split(b": the stream")[0]]) == [0]
        assert body.endswith(b"it ends here unfinished\n\n"), body
        await a.close()
        await b.close()

    asyncio.run(go())


def test_a_resume_past_the_end_of_a_running_stream_gets_its_final_event(db_url):
    """Past the end while the stream still runs: the reader waits, then gets the final event
    (as a resume past the end of a finished stream does), from memory on the generating
    replica and from the log on the other; it used to get nothing."""

    async def go():
        a, b = await _replicas(db_url)
        live = await a.streams.create("p1", "acme")
        for seq in range(3):
            a.streams.push(live, _event(seq))
        local = asyncio.create_task(_collect(a.streams.follow("p1", 50)))
        before = (await b.log.info("p1")).reader_at
        remote = asyncio.create_task(_collect(b.streams.follow("p1", 50)))
        # Both readers are attached before the stream ends (the remote one's heartbeat).
        while live.readers < 1 or (await b.log.info("p1")).reader_at == before:
            await asyncio.sleep(0.01)
        assert not local.done() and not remote.done()
        a.streams.push(live, _event(3))
        a.streams.push(live, _event(4, "[DONE]"), end=True)
        await a.streams.flushed(live)
        assert _ids(await local) == [4]
        assert _ids(await remote) == [4]
        # The largest resume point a log holds reads as past the end (no driver overflow).
        assert await b.log.read("p1", ev.MAX_SEQ, 0) == []
        await a.close()
        await b.close()

    asyncio.run(go())


class _GatedLog:
    """A log whose appends wait for `gate` (and say when one is waiting); the first `failures`
    of them fail."""

    def __init__(self, inner: ev.SqlEventLog, failures: int = 0):
        self.inner = inner
        self.failures = failures
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def append_many(self, appends: list[ev.Append]) -> list[int]:
        self.entered.set()
        await self.gate.wait()
        if self.failures > 0:
            self.failures -= 1
            raise OSError("the database went away")
        return await self.inner.append_many(appends)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_local_reader_gets_an_event_only_once_the_log_holds_it(db_url):
    async def go():
        a, b = await _replicas(db_url)
        gated = _GatedLog(a.log)
        streams = ev.LiveStreams(gated, flush_interval_s=0.002)  # type: ignore[arg-type]
        live = await streams.create("s2", "acme")
        reader = asyncio.create_task(_collect(streams.follow("s2", -1)))
        for seq in range(3):
            streams.push(live, _event(seq))
        await gated.entered.wait()
        # The flush is under way but not done: nothing was delivered that a resume elsewhere
        # could not find.
        assert live.durable == 0 and not reader.done()
        assert await b.log.read("s2", -1, 0) == []
        streams.push(live, _event(3, "[DONE]"), end=True)
        gated.gate.set()
        await streams.flushed(live)
        assert _ids(await reader) == [0, 1, 2, 3]
        assert [seq for seq, _, _ in await b.log.read("s2", -1, 0)] == [0, 1, 2, 3]
        await a.close()
        await b.close()

    asyncio.run(go())


def _over_a_failing_log(replica: _Replica) -> ev.LiveStreams:
    """Streams whose every append to `replica`'s log fails."""
    failing = _GatedLog(replica.log, failures=1_000_000)
    failing.gate.set()
    return ev.LiveStreams(failing, flush_interval_s=0.002)  # type: ignore[arg-type]


def test_a_failing_log_costs_resumability_not_the_stream(db_url):
    async def go():
        a, b = await _replicas(db_url)
        streams = _over_a_failing_log(a)
        live = await streams.create("s3", "acme")
        reader = asyncio.create_task(_collect(streams.follow("s3", -1)))
        for seq in range(4):
            streams.push(live, _event(seq))
        streams.push(live, _event(4, "[DONE]"), end=True)
        await streams.flushed(live)
        assert _ids(await reader) == [0, 1, 2, 3, 4]
        # Elsewhere the stream is gone (a clear 404), never resumable with a hole in it.
        assert await b.log.info("s3") is None
        await a.close()
        await b.close()

    asyncio.run(go())


def test_one_failed_flush_is_retried_and_the_stream_stays_resumable(db_url):
    async def go():
        a, b = await _replicas(db_url)
        flaky = _GatedLog(a.log, failures=1)
        flaky.gate.set()
        streams = ev.LiveStreams(flaky, flush_interval_s=0.002)  # type: ignore[arg-type]
        live = await streams.create("s5", "acme")
        for seq in range(3):
            streams.push(live, _event(seq))
        streams.push(live, _event(3, "[DONE]"), end=True)
        await streams.flushed(live)
        assert flaky.failures == 0 and not live.unlogged
        assert _ids(await _collect(b.streams.follow("s5", 0))) == [1, 2, 3]
        await a.close()
        await b.close()

    asyncio.run(go())


def test_appends_retried_with_a_hole_or_to_a_stream_gone(db_url):
    async def go():
        a, b = await _replicas(db_url)
        await a.log.open("s4", "acme")
        first = [(0, _event(0)), (1, _event(1))]
        assert await a.log.append("s4", first, False) == 1
        # A retry of what already went through (an ambiguous failure) adds nothing twice.
        assert await a.log.append_many([ev.Append("s4", [*first, (2, _event(2))], False)]) == [2]
        # One that would leave a hole is refused, and changes nothing.
        assert await a.log.append("s4", [(5, _event(5))], False) == ev.HOLE
        assert [seq for seq, _, _ in await b.log.read("s4", -1, 0)] == [0, 1, 2]
        # A stream deleted (or evicted) is not brought back by its writer's next append.
        await b.log.delete("s4")
        assert await a.log.append("s4", [(3, _event(3))], True) == ev.GONE
        assert await b.log.info("s4") is None and await b.log.read("s4", -1, 0) == []
        await a.close()
        await b.close()

    asyncio.run(go())


def _events_of(chunks: list[bytes]) -> list[tuple[int, str]]:
    """(id, data) of each event in `chunks`."""
    out = []
    for e in b"".join(chunks).split(b"\n\n"):
        if e:
            head, data = e.split(b"\n", 1)
            out.append((int(head.removeprefix(b"id: ")), data.removeprefix(b"data: ").decode()))
    return out


async def _until(check, what: str) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 10 s: {what}")


async def _fencing_contract(a: ev.LiveStreams, b_log) -> None:
    """Replica A generates stream f1; replica B takes it over while A still runs (A's lease
    renewals failed, it never died): the log holds A's prefix, then only B's events, and A's
    reader goes on from the log where it was."""
    live = await a.create("f1", "acme")
    reader = asyncio.create_task(_collect(a.follow("f1", -1)))
    for seq in range(3):
        a.push(live, _event(seq, "a"))
    await _until(lambda: live.logged == 3, "A's first events logged")
    assert await b_log.fence("f1", 1) == 2  # what B rebuilds from and continues after
    assert await b_log.fence("f1", 0) == ev.FENCED  # an older writer cannot take it back
    a.push(live, _event(3, "a"))  # A goes on until it learns: its flush is refused
    await _until(lambda: live.fenced, "A fenced")
    assert a.local("f1") is None
    assert await b_log.append("f1", [(3, _event(3, "b"))], False, epoch=1) == 3
    # An append of the old epoch is refused whole, even one that would continue the log.
    assert await a.log.append("f1", [(4, _event(4, "a"))], True) == ev.FENCED
    late = asyncio.create_task(_collect(a.follow("f1", 1)))  # a reader arriving at A now
    # An append of a higher epoch fences too (a takeover's first write after its fence).
    assert await b_log.append("f1", [], False, epoch=2) == 3
    assert await b_log.append("f1", [(4, _event(4, "b"))], True, epoch=1) == ev.FENCED
    assert await b_log.append("f1", [(4, _event(4, "b"))], True, epoch=2) == 4
    mixed = [(0, "a"), (1, "a"), (2, "a"), (3, "b"), (4, "b")]
    assert _events_of(await asyncio.wait_for(reader, 20)) == mixed
    assert _events_of(await asyncio.wait_for(late, 20)) == mixed[2:]
    await asyncio.wait_for(a.flushed(live), 5)  # it waits for nothing the log refused
    assert _events_of([data for _, data, _ in await b_log.read("f1", -1, 0)]) == mixed


def test_a_takeover_fences_out_a_predecessor_that_still_writes(db_url):
    async def go():
        a, b = await _replicas(db_url)
        await _fencing_contract(a.streams, b.log)
        assert await b.log.fence("gone", 1) == ev.GONE
        await b.log.delete("f1")
        assert await b.log.fence("f1", 3) == ev.GONE
        await a.close()
        await b.close()

    asyncio.run(go())


def test_an_append_that_waited_out_a_fence_is_refused(db_url):
    """A flush that arrives while a takeover's fence is still in its transaction waits for it,
    then sees its epoch (not what was there when the flush began): refused, never slipped in
    after the successor read the log."""

    async def go():
        a, b = await _replicas(db_url)
        await a.log.open("w1", "acme")
        assert await a.log.append("w1", [(0, _event(0))], False) == 0
        conn = b.store.engine.connect()
        tx = conn.begin()
        conn.execute(b.log._lock_exclusive, {"ids": ["w1"]})
        conn.execute(ev._writers_table.insert().values(id="w1", epoch=1))
        appending = asyncio.create_task(a.log.append("w1", [(1, _event(1, "a"))], False))
        await asyncio.sleep(0.5)
        assert not appending.done()  # it waits on the fence
        tx.commit()
        conn.close()
        assert await asyncio.wait_for(appending, 10) == ev.FENCED
        assert await b.log.append("w1", [(1, _event(1, "b"))], False, epoch=1) == 1
        assert _events_of([data for _, data, _ in await b.log.read("w1", -1, 0)]) == [(0, "t"), (1, "b")]
        # Two fences in turn: the later epoch wins, the earlier is refused.
        assert await b.log.fence("w1", 3) == 1
        assert await a.log.fence("w1", 2) == ev.FENCED
        await a.close()
        await b.close()

    asyncio.run(go())


def test_the_redis_log_fences_under_the_same_contract():
    async def go(url: str):
        a_log = ev.RedisEventLog(url, ev.LogBounds())
        b_log = ev.RedisEventLog(url, ev.LogBounds())
        await _fencing_contract(ev.LiveStreams(a_log, flush_interval_s=0.002), b_log)
        assert await b_log.fence("gone", 1) == ev.GONE
        await a_log.close()
        await b_log.close()

    with redis_server() as url:
        asyncio.run(go(url))


def test_a_fenced_stream_whose_log_had_failed_ends_its_readers_with_a_comment(db_url):
    """Delivered from memory after its log failed, a stream's local readers cannot go on from
    the log when its generation is taken over: they end, saying so, instead of waiting."""

    async def go():
        a, b = await _replicas(db_url)
        streams = _over_a_failing_log(a)
        live = await streams.create("u1", "acme")
        reader = asyncio.create_task(_collect(streams.follow("u1", -1)))
        streams.push(live, _event(0))
        await _until(lambda: live.unlogged, "the log failed")
        streams.hand_over(live)
        chunks = await asyncio.wait_for(reader, 5)
        assert _ids(chunks[:1]) == [0] and chunks[-1].startswith(b": this stream was taken over")
        await a.close()
        await b.close()

    asyncio.run(go())


def test_the_redis_log_appends_under_the_same_contract(monkeypatch):
    async def go(url: str):
        log = ev.RedisEventLog(url, ev.LogBounds(max_events=5, retention_s=60))
        await log.open("r1", "acme")
        first = [(0, _event(0)), (1, _event(1))]
        assert await log.append("r1", first, False) == 1
        assert await log.append_many([ev.Append("r1", [*first, (2, _event(2))], False)]) == [2]
        assert await log.append("r1", [(5, _event(5))], False) == ev.HOLE
        assert [seq for seq, _, _ in await log.read("r1", -1, 0)] == [0, 1, 2]
        # Redis lost its scripts (a restart): the append loads it again and goes through.
        await log._redis.script_flush()
        tail = [(seq, _event(seq)) for seq in range(3, 9)]
        assert await log.append("r1", tail, True) == 8
        with pytest.raises(ev.StreamTrimmed):
            await log.read("r1", 1, 0)
        rows = await log.read("r1", 5, 0)
        assert [(seq, final) for seq, _, final in rows] == [(6, False), (7, False), (8, True)]
        info = await log.info("r1")
        assert info is not None and info.ended and info.last == 8
        await log.delete("r1")
        assert await log.append("r1", [(9, _event(9))], False) == ev.GONE
        assert await log.info("r1") is None and await log.read("r1", -1, 0) == []

        # A flush larger than one script call holds is split over several, in order.
        monkeypatch.setattr(ev, "_STREAMS_PER_CALL", 2)
        monkeypatch.setattr(ev, "_EVENTS_PER_CALL", 3)
        sizes = {"m0": 1, "m1": 4, "m2": 2, "m3": 1, "m4": 3}
        for sid in sizes:
            await log.open(sid, "acme")
        appends = [ev.Append(sid, [(seq, _event(seq)) for seq in range(n)], True) for sid, n in sizes.items()]
        assert await log.append_many(appends) == [n - 1 for n in sizes.values()]
        for sid, n in sizes.items():
            rows = await log.read(sid, -1, 0)
            assert [(seq, final) for seq, _, final in rows] == [(seq, seq == n - 1) for seq in range(n)]
        await log.close()

    with redis_server() as url:
        asyncio.run(go(url))


def test_the_redis_log_forgets_a_deleted_stream_in_its_tenant_index():
    """A deleted stream no longer counts toward the tenant's cap (it evicted a live one)."""

    async def go(url: str):
        log = ev.RedisEventLog(url, ev.LogBounds(max_streams_per_tenant=2))
        await log.open("k1", "acme")
        await log.open("gone", "acme")
        await log.delete("gone")
        await log.open("k2", "acme")
        assert await log.info("k1") is not None and await log.info("k2") is not None
        assert await log._redis.zrange("pvd:et:acme", 0, -1) == [b"k1", b"k2"]
        await log.close()

    with redis_server() as url:
        asyncio.run(go(url))


def test_an_unreachable_redis_log_is_a_503_on_every_call():
    async def go():
        log = ev.RedisEventLog("redis://127.0.0.1:1", ev.LogBounds(), timeout_s=0.5)
        calls = (
            lambda: log.read("x", -1, 0), lambda: log.read("x", -1, 0.1), lambda: log.touch("x"),
            lambda: log.delete("x"), lambda: log.info("x"), lambda: log.open("x", "acme"),
        )  # fmt: skip
        for call in calls:
            with pytest.raises(GatewayError) as e:
                await call()
            assert e.value.status == 503
        await log.close()

    asyncio.run(go())


def test_a_deleted_stream_counts_toward_no_cap_in_the_database_log(db_url):
    async def go():
        a, b = await _replicas(db_url, ev.LogBounds(max_streams_per_tenant=2))
        await a.log.open("k1", "acme")
        await a.log.open("gone", "acme")
        await b.log.delete("gone")
        await a.log.open("k2", "acme")
        assert await b.log.info("k1") is not None and await b.log.info("k2") is not None
        await a.close()
        await b.close()

    asyncio.run(go())


def test_bounds_per_tenant_per_stream_and_retention(db_url):
    async def go():
        bounds = ev.LogBounds(max_events=5, retention_s=3600, max_streams_per_tenant=2)
        a, b = await _replicas(db_url, bounds)
        for sid in ("t1", "t2", "t3"):
            await a.log.open(sid, "acme")
        await a.log.open("o1", "other")
        # The tenant's oldest went first; another tenant's streams do not count.
        assert await b.log.info("t1") is None
        assert await b.log.info("t2") is not None and await b.log.info("t3") is not None
        assert await b.log.info("o1") is not None
        # Opened at once (they share a transaction): the cap holds all the same.
        burst = [f"burst{i}" for i in range(5)]
        await asyncio.gather(*(a.log.open(sid, "burst") for sid in burst))
        kept = [sid for sid in burst if await b.log.info(sid) is not None]
        assert len(kept) == 2

        # At most max_events per stream: a resume point older than that is StreamTrimmed.
        await a.log.append("t3", [(seq, _event(seq)) for seq in range(12)], True)
        with pytest.raises(ev.StreamTrimmed):
            await b.log.read("t3", -1, 0)
        with pytest.raises(ev.StreamTrimmed):
            await _collect(b.streams.follow("t3", 2))
        assert [seq for seq, _, _ in await b.log.read("t3", 6, 0)] == [7, 8, 9, 10, 11]

        # Retention: once a stream's time is up (set in the table: no waiting in a test), it
        # is gone for every reader, and the next stream opened sweeps its events away.
        with a.store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE gateway_streams SET expires_at = 0 WHERE id = 't3'"))
        assert await b.log.info("t3") is None
        b.log.sweep_interval_s = 0
        await b.log.open("t4", "other")
        with a.store.engine.connect() as conn:
            left = conn.execute(sa.text("SELECT count(*) FROM gateway_stream_events WHERE stream_id = 't3'"))
            assert left.scalar() == 0
            assert conn.execute(sa.text("SELECT count(*) FROM gateway_streams WHERE id = 't3'")).scalar() == 0
        await a.close()
        await b.close()

    asyncio.run(go())


# ---- two gateway processes on one database, no Redis ------------------------------------------


@pytest.fixture(scope="module")
def frontend() -> Iterator[ServerProcess]:
    # Slow enough that a stream can be cut in its middle.
    server = ServerProcess("--engine", "sim://tiny?tokens_per_s=200&max_num_seqs=64", ready_timeout_s=120)
    try:
        yield server
    finally:
        server.terminate()


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def fleet(request, frontend, tmp_path_factory) -> Iterator[dict]:
    tmp: Path = tmp_path_factory.mktemp("events_db")
    if request.param == "postgres":
        state = create_database(request.getfixturevalue("pg_server"), f"fleet_{next(_db_names)}")
    else:
        state = f"sqlite:///{tmp / 'gw.sqlite'}"
    backends = [{"url": frontend.url, "version": "v1"}]
    routes = write_routes(tmp / "routes.json", [{"alias": MODEL, "backends": backends}])
    admin = "adm-" + secrets.token_hex(16)
    gateways: list[GatewayProcess] = []
    try:
        for _ in range(2):
            # No --redis: the event log is the database the replicas share.
            flags = ["--state", state, "--stream-grace", "20", "--stream-max-events", "40"]
            gateways.append(GatewayProcess(routes, *flags, admin_key=admin, state_dir=tmp))
        gateways[0].tenant("acme", models=[MODEL])
        yield {"gateways": gateways, "key": gateways[0].key("acme"), "state": state}
    finally:
        for gw in gateways:
            gw.stop()


def _sse_events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e.strip()]


def _first_events(url: str, path: str, body: dict, auth: dict, n: int) -> tuple[httpx.Headers, list[bytes]]:
    """The first `n` events of a stream, then the connection dropped."""
    got: list[bytes] = []
    with httpx.stream("POST", url + path, json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200, r.read()
        buffer = b""
        for chunk in r.iter_bytes():
            buffer += chunk
            *whole, buffer = buffer.split(b"\n\n")
            got.extend(e for e in whole if e.strip())
            if len(got) >= n:
                return r.headers, got[:n]
    raise AssertionError(f"the stream ended after {len(got)} events")


def test_chat_stream_cut_on_one_replica_resumes_on_the_other_without_redis(fleet):
    a, b = fleet["gateways"]
    auth = {"authorization": f"Bearer {fleet['key']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
    headers, got = _first_events(a.url, "/v1/chat/completions", body, auth, 8)
    stream_id = headers["x-paved-stream-id"]
    assert [e.split(b"\n")[0] for e in got] == [b"id: %d" % i for i in range(8)]
    rest = httpx.get(
        f"{b.url}/v1/chat/completions/streams/{stream_id}", headers={**auth, "last-event-id": "7"}, timeout=60
    )
    assert rest.status_code == 200, rest.text
    events = _sse_events(rest.content)
    ids = [int(e.split(b"\n")[0].removeprefix(b"id: ")) for e in events]
    assert ids == list(range(8, 8 + len(ids)))  # no gap, no duplicate
    assert events[-1].endswith(b"data: [DONE]")
    # The whole stream replayed from the first replica is exactly what the client was sent.
    full = httpx.get(f"{a.url}/v1/chat/completions/streams/{stream_id}", headers=auth, timeout=60)
    assert _sse_events(full.content) == got + events

    # A resume point the per-stream bound (--stream-max-events 40) no longer keeps: a clear 404.
    long_body = {**body, "max_tokens": 60}
    r = httpx.post(f"{a.url}/v1/chat/completions", json=long_body, headers=auth, timeout=60)
    assert r.status_code == 200 and len(_sse_events(r.content)) > 41
    trimmed = httpx.get(
        f"{b.url}/v1/chat/completions/streams/{r.headers['x-paved-stream-id']}",
        headers={**auth, "last-event-id": "0"},
        timeout=60,
    )
    assert trimmed.status_code == 404 and trimmed.json()["error"]["code"] == "stream_events_expired"

    # Expired (its retention over; set in the shared table): a clear 404 from either replica.
    store = GatewayStore(fleet["state"])
    try:
        with store.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE gateway_streams SET expires_at = 0 WHERE id = :id"), {"id": stream_id}
            )
    finally:
        asyncio.run(store.close())
    for gw in (a, b):
        gone = httpx.get(
            f"{gw.url}/v1/chat/completions/streams/{stream_id}",
            headers={**auth, "last-event-id": "3"},
            timeout=60,
        )
        assert gone.status_code == 404
        error = gone.json()["error"]
        assert error["code"] == "stream_not_found" and "expired" in error["message"]


def test_responses_stream_resumes_with_starting_after_on_the_other_replica_without_redis(fleet):
    a, b = fleet["gateways"]
    auth = {"authorization": f"Bearer {fleet['key']}"}
    body = {"model": MODEL, "input": "count", "max_output_tokens": 20, "stream": True}
    _, got = _first_events(a.url, "/v1/responses", body, auth, 6)
    first = [json.loads(e.split(b"data: ", 1)[1]) for e in got]
    response_id = first[0]["response"]["id"]
    after = first[-1]["sequence_number"]
    rest = httpx.get(
        f"{b.url}/v1/responses/{response_id}?stream=true&starting_after={after}", headers=auth, timeout=60
    )
    assert rest.status_code == 200, rest.text
    resumed = [json.loads(e.split(b"data: ", 1)[1]) for e in _sse_events(rest.content)]
    numbers = [e["sequence_number"] for e in first + resumed]
    assert numbers == list(range(len(numbers)))
    # The output token cap ends it as incomplete: either way its terminal event, once.
    assert resumed[-1]["type"] in ("response.completed", "response.incomplete")
    assert [e["type"] for e in first + resumed].count(resumed[-1]["type"]) == 1
