"""Resumable streams: every event of a stream numbered, kept in a bounded log the gateway
replicas share, and followed live from any of them.

Two logs implement `EventLog`: `RedisEventLog` (one Redis stream per stream, entry id `0-(seq+1)`,
trimmed to `max_events` and expiring `retention_s` after its last write) and `SqlEventLog`
(the gateway's database, for a deployment without Redis; followers poll it). `LiveStreams` is
one replica's side: the streams it generates, held in memory for its own readers, written to
the log in batches by one flusher per stream (so a token costs the generation no round trip).

Invariants:
- A stream's events have consecutive sequence numbers from 0 and are appended in order by one
  writer (the replica generating it); a reader gets each once, in order, with no gap: a resume
  point older than what the log still keeps raises StreamTrimmed rather than skipping.
- The last event of a stream is marked final; a reader stops after it, and a reader resuming
  at or past it gets that final event again (so it learns how the stream ended).
- Per tenant at most `max_streams_per_tenant` streams are kept (the oldest go first), each at
  most `max_events` events, for `retention_s` after its last event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa

from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError

logger = logging.getLogger("paved.gateway.responses")

# The longest one read blocks on the log before it looks again.
READ_BLOCK_S = 1.0
_POLL_S = 0.05
_BATCH = 512


@dataclass(frozen=True)
class LogBounds:
    max_events: int = 20_000
    retention_s: float = 3600.0
    max_streams_per_tenant: int = 1000


class StreamTrimmed(Exception):
    """The events after the resume point are no longer all kept."""


@dataclass
class StreamInfo:
    tenant: str
    ended: bool
    last: int
    reader_at: float


class EventLog(Protocol):
    async def open(self, stream_id: str, tenant: str) -> None: ...
    async def append(self, stream_id: str, events: list[tuple[int, bytes]], ended: bool) -> None: ...
    async def info(self, stream_id: str) -> StreamInfo | None: ...
    async def read(self, stream_id: str, after: int, wait_s: float) -> list[tuple[int, bytes, bool]]: ...
    async def touch(self, stream_id: str) -> None: ...
    async def delete(self, stream_id: str) -> None: ...
    async def close(self) -> None: ...


class RedisEventLog:
    """Streams in Redis: `pvd:es:{id}` (the events), `pvd:em:{id}` (tenant, last, ended, the
    last reader's heartbeat), `pvd:et:{tenant}` (the tenant's streams by age)."""

    def __init__(self, url: str, bounds: LogBounds, timeout_s: float = 2.0):
        import redis.asyncio as aioredis

        self.bounds = bounds
        # Typed Any: redis-py's stubs type replies as str | bytes | int whatever the decoding.
        # Pools as large as the streams one replica serves at once (a full pool raises).
        self._redis: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=4096
        )
        # Blocking reads need a socket timeout longer than their block.
        self._blocking: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=READ_BLOCK_S + timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=4096,
        )

    async def open(self, stream_id: str, tenant: str) -> None:
        async with _unavailable_as_503():
            await self._open(stream_id, tenant)

    async def _open(self, stream_id: str, tenant: str) -> None:
        ttl = int(self.bounds.retention_s) + 1
        now = time.time()
        meta = f"pvd:em:{stream_id}"
        by_age = f"pvd:et:{tenant}"
        async with self._redis.pipeline(transaction=True) as p:
            p.hset(meta, mapping={"tenant": tenant, "last": -1, "ended": 0, "reader": now})
            p.expire(meta, ttl)
            p.zadd(by_age, {stream_id: now})
            p.zremrangebyscore(by_age, 0, now - self.bounds.retention_s)
            p.zcard(by_age)
            p.expire(by_age, ttl)
            results = await p.execute()
        extra = int(results[4]) - self.bounds.max_streams_per_tenant
        if extra > 0:
            # The tenant's oldest streams make room: a bound per tenant, not per replica.
            for old in await self._redis.zpopmin(by_age, extra):
                await self.delete(old[0].decode())

    async def append(self, stream_id: str, events: list[tuple[int, bytes]], ended: bool) -> None:
        key, meta = f"pvd:es:{stream_id}", f"pvd:em:{stream_id}"
        ttl = int(self.bounds.retention_s) + 1
        async with self._redis.pipeline(transaction=False) as p:
            for i, (seq, data) in enumerate(events):
                fields: dict[str, Any] = {"d": data}
                if ended and i == len(events) - 1:
                    fields["e"] = b"1"
                p.xadd(key, fields, id=f"0-{seq + 1}", maxlen=self.bounds.max_events, approximate=False)
            mapping: dict[str, Any] = {"last": events[-1][0]} if events else {}
            if ended:
                mapping["ended"] = 1
            if mapping:
                p.hset(meta, mapping=mapping)
            p.expire(key, ttl)
            p.expire(meta, ttl)
            await p.execute()

    async def info(self, stream_id: str) -> StreamInfo | None:
        async with _unavailable_as_503():
            raw = await self._redis.hgetall(f"pvd:em:{stream_id}")
        if not raw:
            return None
        return StreamInfo(
            tenant=raw[b"tenant"].decode(),
            ended=raw.get(b"ended") == b"1",
            last=int(raw.get(b"last", b"-1")),
            reader_at=float(raw.get(b"reader", b"0")),
        )

    async def read(self, stream_id: str, after: int, wait_s: float) -> list[tuple[int, bytes, bool]]:
        client = self._blocking if wait_s > 0 else self._redis
        block = max(1, int(min(wait_s, READ_BLOCK_S) * 1000)) if wait_s > 0 else None
        got = await client.xread({f"pvd:es:{stream_id}": f"0-{after + 1}"}, count=_BATCH, block=block)
        out: list[tuple[int, bytes, bool]] = []
        for _, entries in got or ():
            for entry_id, fields in entries:
                seq = int(entry_id.split(b"-")[1]) - 1
                out.append((seq, fields[b"d"], fields.get(b"e") == b"1"))
        if out and out[0][0] != after + 1:
            raise StreamTrimmed
        return out

    async def touch(self, stream_id: str) -> None:
        await self._redis.hset(f"pvd:em:{stream_id}", "reader", time.time())

    async def delete(self, stream_id: str) -> None:
        await self._redis.delete(f"pvd:es:{stream_id}", f"pvd:em:{stream_id}")

    async def close(self) -> None:
        await self._redis.aclose()
        await self._blocking.aclose()


@contextlib.asynccontextmanager
async def _unavailable_as_503() -> AsyncIterator[None]:
    """Redis down, slow or out of connections: a 503 the client may retry, never a 500."""
    from redis.exceptions import RedisError

    try:
        yield
    except (RedisError, OSError) as e:
        raise GatewayError(503, "the stream store is unavailable", code="stream_store_unavailable") from e


_metadata = sa.MetaData()
_meta_table = sa.Table(
    "gateway_streams",
    _metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(63), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("last", sa.Integer, nullable=False),
    sa.Column("reader_at", sa.Float, nullable=False),
)
_events_table = sa.Table(
    "gateway_stream_events",
    _metadata,
    sa.Column("stream_id", sa.String(64), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("final", sa.Boolean, nullable=False),
)


class SqlEventLog:
    """Streams in the gateway's database (SQLite for one host, PostgreSQL for many replicas)."""

    def __init__(self, store: GatewayStore, bounds: LogBounds):
        self._store = store
        self.bounds = bounds

    async def start(self) -> None:
        await self._store.create_tables(_metadata)

    async def open(self, stream_id: str, tenant: str) -> None:
        await self._store.run(self._open_sync, stream_id, tenant)

    def _open_sync(self, stream_id: str, tenant: str) -> None:
        now = time.time()
        with self._store.engine.begin() as conn:
            expired = [
                r[0] for r in conn.execute(sa.select(_meta_table.c.id).where(_meta_table.c.expires_at < now))
            ]
            mine = list(
                conn.execute(
                    sa.select(_meta_table.c.id)
                    .where(_meta_table.c.tenant == tenant, _meta_table.c.expires_at >= now)
                    .order_by(_meta_table.c.created_at.desc())
                    .offset(self.bounds.max_streams_per_tenant - 1)
                )
            )
            gone = expired + [r[0] for r in mine]
            if gone:
                conn.execute(_events_table.delete().where(_events_table.c.stream_id.in_(gone)))
                conn.execute(_meta_table.delete().where(_meta_table.c.id.in_(gone)))
            conn.execute(
                _meta_table.insert().values(
                    id=stream_id, tenant=tenant, created_at=now, expires_at=now + self.bounds.retention_s,
                    ended=False, last=-1, reader_at=now,
                )
            )  # fmt: skip

    async def append(self, stream_id: str, events: list[tuple[int, bytes]], ended: bool) -> None:
        await self._store.run(self._append_sync, stream_id, events, ended)

    def _append_sync(self, stream_id: str, events: list[tuple[int, bytes]], ended: bool) -> None:
        with self._store.engine.begin() as conn:
            if events:
                last_i = len(events) - 1
                conn.execute(
                    _events_table.insert(),
                    [
                        {
                            "stream_id": stream_id,
                            "seq": seq,
                            "data": data,
                            "final": ended and i == last_i,
                        }
                        for i, (seq, data) in enumerate(events)
                    ],
                )
                last = events[-1][0]
                conn.execute(
                    _events_table.delete().where(
                        _events_table.c.stream_id == stream_id,
                        _events_table.c.seq <= last - self.bounds.max_events,
                    )
                )
            values: dict[str, Any] = {"expires_at": time.time() + self.bounds.retention_s}
            if events:
                values["last"] = events[-1][0]
            if ended:
                values["ended"] = True
            conn.execute(_meta_table.update().where(_meta_table.c.id == stream_id).values(**values))

    async def info(self, stream_id: str) -> StreamInfo | None:
        return await self._store.run(self._info_sync, stream_id)

    def _info_sync(self, stream_id: str) -> StreamInfo | None:
        with self._store.engine.connect() as conn:
            row = conn.execute(sa.select(_meta_table).where(_meta_table.c.id == stream_id)).first()
        if row is None or row.expires_at < time.time():
            return None
        return StreamInfo(
            tenant=row.tenant, ended=bool(row.ended), last=int(row.last), reader_at=row.reader_at
        )

    async def read(self, stream_id: str, after: int, wait_s: float) -> list[tuple[int, bytes, bool]]:
        deadline = time.monotonic() + min(wait_s, READ_BLOCK_S)
        while True:
            rows = await self._store.run(self._read_sync, stream_id, after)
            if rows or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        if rows and rows[0][0] != after + 1:
            raise StreamTrimmed
        return rows

    def _read_sync(self, stream_id: str, after: int) -> list[tuple[int, bytes, bool]]:
        t = _events_table
        with self._store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.seq, t.c.data, t.c.final)
                .where(t.c.stream_id == stream_id, t.c.seq > after)
                .order_by(t.c.seq)
                .limit(_BATCH)
            )
            return [(int(r.seq), bytes(r.data), bool(r.final)) for r in rows]

    async def touch(self, stream_id: str) -> None:
        await self._store.run(self._touch_sync, stream_id)

    def _touch_sync(self, stream_id: str) -> None:
        with self._store.engine.begin() as conn:
            conn.execute(
                _meta_table.update().where(_meta_table.c.id == stream_id).values(reader_at=time.time())
            )

    async def delete(self, stream_id: str) -> None:
        await self._store.run(self._delete_sync, stream_id)

    def _delete_sync(self, stream_id: str) -> None:
        with self._store.engine.begin() as conn:
            conn.execute(_events_table.delete().where(_events_table.c.stream_id == stream_id))
            conn.execute(_meta_table.delete().where(_meta_table.c.id == stream_id))

    async def close(self) -> None:
        return None


@dataclass
class LiveStream:
    """A stream this replica generates: its events in memory (for its own readers) and the
    ones not yet written to the log."""

    id: str
    tenant: str
    events: list[tuple[int, bytes]] = field(default_factory=list)
    ended: bool = False
    readers: int = 0
    # Set when the last local reader leaves (the generation's owner decides on a grace).
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set (and replaced) on every push: each reader waits on the one current when it caught up.
    _notify: asyncio.Event = field(default_factory=asyncio.Event)
    _pending: list[tuple[int, bytes]] = field(default_factory=list)
    _flusher: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return len(self.events)


class LiveStreams:
    """This replica's generating streams, over the shared log."""

    def __init__(self, log: EventLog, grace_s: float = 30.0):
        self.log = log
        self.grace_s = grace_s
        self._live: dict[str, LiveStream] = {}

    async def create(self, stream_id: str, tenant: str) -> LiveStream:
        await self.log.open(stream_id, tenant)
        live = LiveStream(stream_id, tenant)
        live._flusher = asyncio.create_task(self._flush(live))
        self._live[stream_id] = live
        return live

    def push(self, live: LiveStream, data: bytes, *, end: bool = False) -> int:
        """Append one event (its sequence number is the next one); `end`: the stream's last."""
        if live.ended:
            raise RuntimeError("stream already ended")
        seq = live.next_seq
        live.events.append((seq, data))
        live._pending.append((seq, data))
        if end:
            live.ended = True
        live._changed.set()
        live._notify.set()
        live._notify = asyncio.Event()
        return seq

    async def flushed(self, live: LiveStream) -> None:
        """Every event pushed so far (the stream has ended) is in the log."""
        if live._flusher is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(live._flusher)
        self._live.pop(live.id, None)

    async def _flush(self, live: LiveStream) -> None:
        while True:
            await live._changed.wait()
            live._changed.clear()
            batch, live._pending = live._pending, []
            ended = live.ended
            if batch or ended:
                try:
                    await self.log.append(live.id, batch, ended)
                except Exception as e:  # noqa: BLE001 - a log outage costs resumability, not the stream
                    logger.warning("could not write stream %s to the event log: %s", live.id, e)
            if ended and not live._pending:
                return

    def local(self, stream_id: str) -> LiveStream | None:
        return self._live.get(stream_id)

    async def follow(self, stream_id: str, after: int) -> AsyncIterator[bytes]:
        """The events after `after`, then live ones until the final one; from memory when this
        replica generates the stream, else from the log. A resume at or past the end gets the
        final event again."""
        live = self._live.get(stream_id)
        if live is not None:
            async for data in self._follow_local(live, after):
                yield data
            return
        async for data in self._follow_log(stream_id, after):
            yield data

    async def _follow_local(self, live: LiveStream, after: int) -> AsyncIterator[bytes]:
        live.readers += 1
        live.idle.clear()
        try:
            position = after + 1
            if live.ended and position >= live.next_seq:
                position = live.next_seq - 1
            while True:
                while position < live.next_seq:
                    yield live.events[position][1]
                    position += 1
                if live.ended:
                    return
                await live._notify.wait()
        finally:
            live.readers -= 1
            if live.readers == 0:
                live.idle.set()

    async def _follow_log(self, stream_id: str, after: int) -> AsyncIterator[bytes]:
        info = await self.log.info(stream_id)
        if info is not None and info.ended and after >= info.last >= 0:
            after = info.last - 1
        last_touch = 0.0
        while True:
            now = time.monotonic()
            if now - last_touch > max(0.5, self.grace_s / 3):
                last_touch = now
                with contextlib.suppress(Exception):
                    await self.log.touch(stream_id)
            batch = await self.log.read(stream_id, after, READ_BLOCK_S)
            for seq, data, final in batch:
                yield data
                after = seq
                if final:
                    return
            if not batch:
                info = await self.log.info(stream_id)
                if info is None:
                    return
                if info.ended and info.last <= after:
                    return
