"""Resumable streams: every event of a stream numbered, kept in a bounded log the gateway
replicas share, and followed live from any of them.

Two logs implement `EventLog`: `RedisEventLog` (one Redis stream per stream, entry id `0-(seq+1)`,
trimmed to `max_events` and expiring `retention_s` after its last write) and `SqlEventLog`
(the gateway's database, for a deployment without Redis; followers poll it). `LiveStreams` is
one replica's side: the streams it generates, held in memory for its own readers, and one
flusher per replica that writes every stream's new events to the log together, at most once
per `flush_interval_s` (one round trip per flush, not one per token).

Invariants:
- A stream's events have consecutive sequence numbers from 0 and are appended in order by one
  writer (the replica generating it); a reader gets each once, in order, with no gap: a resume
  point older than what the log still keeps raises StreamTrimmed rather than skipping, and a
  log refuses an append that would leave a hole.
- One writer at a time, fenced by epochs: a writer that takes a stream over (another replica
  continuing a response whose lease lapsed) first `fence`s it with an epoch higher than its
  predecessor's, then reads what the log holds and continues from there; from the fence on, the
  log refuses (FENCED) every append of a lower epoch. So a predecessor that still runs (its
  lease renewals failed, it never died) cannot mix its events into its successor's: the log is
  the predecessor's prefix, then the successor's events. The predecessor's local readers go on
  reading the log from where they were (`LiveStreams` ends its stream `fenced`).
- A reader on the generating replica gets an event only once the log holds it (or once the log
  has failed for that stream), so whatever a client was sent can be resumed from any replica.
- The last event of a stream is marked final; a reader stops after it, and a reader resuming
  at or past it gets that final event again (so it learns how the stream ended).
- A reader following the log of a stream that gets no new event for `writer_silence_s`, has
  not ended, and whose writer `writer_alive` does not vouch for (a response's lease; chat streams
  have none) is ended with an SSE comment saying so, instead of waiting for the stream to expire
  (its writer's replica was killed and nothing took the stream over). A chat stream's log opens
  only once its upstream streams, after which the upstream's idle timeout bounds every silence.
- Per tenant at most `max_streams_per_tenant` streams are kept (the oldest go first), each at
  most `max_events` events, for `retention_s` after its last event (the database: at least
  that, at most a tenth longer, so a flush need not rewrite every stream's row).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
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
# How often one replica writes its streams' new events to the log, at most: under load a
# flush carries several events of every stream at once; alone, an event waits at most this.
# The database's is longer: its cost per flush and stream is most of its cost per event (about
# 13 us of CPU per event at one event per stream and flush, 5 us at five, SQLite).
FLUSH_INTERVAL_S = 0.01
DB_FLUSH_INTERVAL_S = 0.025
# A Redis script call holds at most this many streams and, unless one stream alone has more,
# this many events (a call blocks Redis while it runs, and Redis bounds a command's arguments).
_STREAMS_PER_CALL = 256
_EVENTS_PER_CALL = 20_000

# The largest sequence number a log holds (the database's INTEGER column; Redis entry ids and
# SQLite integers hold more): a resume point past it is a client error, not a read to try.
MAX_SEQ = 2**31 - 1

# Per stream in an append: the sequence number the log now ends at, or one of these.
GONE = -2  # the stream is no longer in the log (deleted, evicted by the tenant's cap, expired)
HOLE = -3  # the append starts after the log's end: refused, so the log never has a gap
FENCED = -4  # a writer of a higher epoch took the stream over: this one writes no more


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


@dataclass(frozen=True)
class Append:
    """New events of one stream (consecutive sequence numbers); `ended`: its last is final;
    `epoch`: its writer's (0: the stream's first writer). Appending events the log already
    holds again is harmless (they are skipped), so a failed append can be retried as it was."""

    stream_id: str
    events: list[tuple[int, bytes]]
    ended: bool
    epoch: int = 0


class EventLog(Protocol):
    # How often LiveStreams flushes to this log, at most (seconds).
    flush_interval_s: float

    async def open(self, stream_id: str, tenant: str) -> None: ...
    async def append_many(self, appends: list[Append]) -> list[int]:
        """All `appends` in one round trip; per append, the last sequence number the log now
        holds for that stream, or GONE / HOLE / FENCED (the stream's epoch is above the
        append's; an append of a higher epoch fences the stream at it)."""
        ...

    async def append(
        self, stream_id: str, events: list[tuple[int, bytes]], ended: bool, epoch: int = 0
    ) -> int:
        """One stream's append_many."""
        ...

    async def fence(self, stream_id: str, epoch: int) -> int:
        """Take the stream over at `epoch`: from now on appends of a lower epoch are refused.
        Returns the last sequence number the log holds (what the taker continues after, -1:
        none), GONE, or FENCED when a writer of a higher epoch already took it."""
        ...

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
        self.flush_interval_s = FLUSH_INTERVAL_S
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
        self._append_sha: str | None = None

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

    async def append(
        self, stream_id: str, events: list[tuple[int, bytes]], ended: bool, epoch: int = 0
    ) -> int:
        return (await self.append_many([Append(stream_id, events, ended, epoch)]))[0]

    async def fence(self, stream_id: str, epoch: int) -> int:
        async with _unavailable_as_503():
            return int(await self._redis.eval(_FENCE_LUA, 1, f"pvd:em:{stream_id}", epoch))

    async def append_many(self, appends: list[Append]) -> list[int]:
        from redis.exceptions import NoScriptError

        if not appends:
            return []
        for a in appends:
            if a.events and a.events[-1][0] - a.events[0][0] != len(a.events) - 1:
                raise ValueError("an append's sequence numbers must be consecutive")
        if self._append_sha is None:
            self._append_sha = await self._redis.script_load(_APPEND_LUA)
        try:
            return await self._append_many(appends)
        except NoScriptError:
            # Redis restarted (or its scripts were flushed): the script again, then the same
            # appends (idempotent, so the ones that went through before are skipped).
            self._append_sha = await self._redis.script_load(_APPEND_LUA)
            return await self._append_many(appends)

    async def _append_many(self, appends: list[Append]) -> list[int]:
        ttl = int(self.bounds.retention_s) + 1
        # A few script calls, not a command per event: the per-command cost (client and server)
        # was most of an append's.
        calls: list[list[Append]] = [[]]
        events = 0
        for a in appends:
            if calls[-1] and (
                len(calls[-1]) == _STREAMS_PER_CALL or events + len(a.events) > _EVENTS_PER_CALL
            ):
                calls.append([])
                events = 0
            calls[-1].append(a)
            events += len(a.events)
        async with self._redis.pipeline(transaction=False) as p:
            for call in calls:
                keys: list[str] = []
                args: list[Any] = [self.bounds.max_events, ttl]
                for a in call:
                    keys.append(f"pvd:es:{a.stream_id}")
                    keys.append(f"pvd:em:{a.stream_id}")
                    args.append(len(a.events))
                    args.append(1 if a.ended else 0)
                    args.append(a.epoch)
                    for seq, data in a.events:
                        args.append(seq)
                        args.append(data)
                p.evalsha(self._append_sha, len(keys), *keys, *args)
            return [int(r) for replies in await p.execute() for r in replies]

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
        """The events after `after` (at most a batch), waiting up to `wait_s` for one."""
        client = self._blocking if wait_s > 0 else self._redis
        block = max(1, int(min(wait_s, READ_BLOCK_S) * 1000)) if wait_s > 0 else None
        async with _unavailable_as_503():
            got = await client.xread({f"pvd:es:{stream_id}": f"0-{after + 1}"}, count=_BATCH, block=block)
        out: list[tuple[int, bytes, bool]] = []
        for _, entries in got or ():
            for entry_id, fields in entries:
                seq = int(entry_id.split(b"-")[1]) - 1
                out.append((seq, fields[b"d"], fields.get(b"e") == b"1"))
        _check_contiguous(out, after)
        return out

    async def touch(self, stream_id: str) -> None:
        async with _unavailable_as_503():
            await self._redis.hset(f"pvd:em:{stream_id}", "reader", time.time())

    async def delete(self, stream_id: str) -> None:
        """The stream's events and meta, and its place in its tenant's index: a deleted
        stream no longer counts toward the tenant's cap (it would evict live ones)."""
        meta = f"pvd:em:{stream_id}"
        async with _unavailable_as_503():
            tenant = await self._redis.hget(meta, "tenant")
            async with self._redis.pipeline(transaction=True) as p:
                p.delete(f"pvd:es:{stream_id}", meta)
                if tenant is not None:
                    p.zrem(f"pvd:et:{tenant.decode()}", stream_id)
                await p.execute()

    async def close(self) -> None:
        await self._redis.aclose()
        await self._blocking.aclose()


# Appends for many streams in one call, each atomic in Redis: events the log has are skipped (a
# retried append), an append that would leave a hole is refused whole (-3), a stream gone is not
# brought back (-2), an append below the stream's writer epoch (meta field `w`, absent: 0) is
# refused (-4) and one above it fences the stream there; else the stream's last sequence number.
# KEYS: per stream, its events then its meta. ARGV: max_events, ttl, then per stream: its
# number of events, ended (0/1), epoch, then seq, data pairs (consecutive sequence numbers).
_APPEND_LUA = """
local maxlen, ttl = ARGV[1], ARGV[2]
local out = {}
local a = 3
for k = 1, #KEYS, 2 do
  local n, ended, epoch = tonumber(ARGV[a]), ARGV[a + 1] == '1', tonumber(ARGV[a + 2])
  local first = a + 3
  a = first + 2 * n
  local last = redis.call('HGET', KEYS[k + 1], 'last')
  local w = tonumber(redis.call('HGET', KEYS[k + 1], 'w') or '0')
  if not last then
    out[#out + 1] = -2
  elseif epoch < w then
    out[#out + 1] = -4
  else
    if epoch > w then redis.call('HSET', KEYS[k + 1], 'w', epoch) end
    last = tonumber(last)
    local i = first
    while i < a and tonumber(ARGV[i]) <= last do i = i + 2 end
    if i < a and tonumber(ARGV[i]) ~= last + 1 then
      out[#out + 1] = -3
    else
      for j = i, a - 1, 2 do
        local seq = tonumber(ARGV[j])
        if ended and j == a - 2 then
          redis.call('XADD', KEYS[k], 'MAXLEN', maxlen, '0-' .. (seq + 1), 'd', ARGV[j + 1], 'e', '1')
        else
          redis.call('XADD', KEYS[k], 'MAXLEN', maxlen, '0-' .. (seq + 1), 'd', ARGV[j + 1])
        end
        last = seq
      end
      if ended then
        redis.call('HSET', KEYS[k + 1], 'last', last, 'ended', 1)
      else
        redis.call('HSET', KEYS[k + 1], 'last', last)
      end
      redis.call('EXPIRE', KEYS[k], ttl)
      redis.call('EXPIRE', KEYS[k + 1], ttl)
      out[#out + 1] = last
    end
  end
end
return out
"""

# A takeover's fence (KEYS: the stream's meta; ARGV: the epoch): -2 gone, -4 a higher epoch
# holds it, else the stream's last sequence number, with the epoch raised to ARGV[1].
_FENCE_LUA = """
local last = redis.call('HGET', KEYS[1], 'last')
if not last then return -2 end
local epoch = tonumber(ARGV[1])
local w = tonumber(redis.call('HGET', KEYS[1], 'w') or '0')
if epoch < w then return -4 end
redis.call('HSET', KEYS[1], 'w', epoch)
return tonumber(last)
"""


def _check_contiguous(events: list[tuple[int, bytes, bool]], after: int) -> None:
    """Raise StreamTrimmed unless `events` continue `after` one by one (a trimmed log)."""
    if events and (events[0][0] != after + 1 or events[-1][0] != after + len(events)):
        raise StreamTrimmed


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
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("last", sa.Integer, nullable=False),
    sa.Column("reader_at", sa.Float, nullable=False),
    # A tenant's streams newest first: opening one finds those past the cap without a sort.
    sa.Index("ix_gateway_streams_tenant_created", "tenant", "created_at"),
)
_events_table = sa.Table(
    "gateway_stream_events",
    _metadata,
    sa.Column("stream_id", sa.String(64), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("final", sa.Boolean, nullable=False),
)
# A stream's writer epoch once a takeover fenced it (no row: 0). A table of its own: a database
# made before fencing existed gains it through create_tables, with no migration.
_writers_table = sa.Table(
    "gateway_stream_writers",
    _metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("epoch", sa.Integer, nullable=False),
)


def _raise_epoch(conn: sa.Connection, stream_id: str, epoch: int, has_row: bool) -> None:
    """The stream's writer epoch is now `epoch` (under its row's lock)."""
    w = _writers_table
    if has_row:
        conn.execute(w.update().where(w.c.id == stream_id).values(epoch=epoch))
    else:
        conn.execute(w.insert().values(id=stream_id, epoch=epoch))


class SqlEventLog:
    """Streams in the gateway's database (SQLite for one host, PostgreSQL for many replicas)."""

    def __init__(self, store: GatewayStore, bounds: LogBounds):
        self._store = store
        self.bounds = bounds
        self.flush_interval_s = DB_FLUSH_INTERVAL_S
        # Streams by id with the last sequence number their events hold (None: no event yet;
        # trimming keeps the newest, so the highest is always there): the primary key's index
        # answers it, and no write per flush has to keep a copy up to date.
        m, t, w = _meta_table, _events_table, _writers_table
        last_seq = (
            sa.select(sa.func.max(t.c.seq)).where(t.c.stream_id == m.c.id).scalar_subquery().label("last_seq")
        )
        epoch = sa.select(w.c.epoch).where(w.c.id == m.c.id).scalar_subquery().label("epoch")
        self._lasts = sa.select(
            m.c.id, m.c.tenant, m.c.ended, m.c.expires_at, m.c.reader_at, last_seq, epoch
        ).where(m.c.id.in_(sa.bindparam("ids", expanding=True)))
        # PostgreSQL (SQLite's writer is single): an append holds its streams' rows shared and
        # a fence or delete holds them exclusively, each taken by a statement of its own, in id
        # order, BEFORE the statement that reads epochs and last events: under READ COMMITTED
        # that read gets a snapshot from after the lock, so an append that waited out a fence
        # sees the fence's epoch (one statement would lock, then return what it read before).
        ids: sa.BindParameter[list[str]] = sa.bindparam("ids", expanding=True)
        locking = sa.select(m.c.id).where(m.c.id.in_(ids)).order_by(m.c.id)
        self._lock_shared = locking.with_for_update(read=True, key_share=True)
        self._lock_exclusive = locking.with_for_update()
        # Built once (building a statement costs more than running it on SQLite).
        now: sa.BindParameter[float] = sa.bindparam("now")
        self._expired = sa.select(m.c.id).where(m.c.expires_at < now)
        self._overflow = (
            sa.select(m.c.id)
            .where(m.c.tenant == sa.bindparam("tenant"), m.c.expires_at >= now)
            .order_by(m.c.created_at.desc())
            .offset(sa.bindparam("keep"))
        )
        gone: sa.BindParameter[list[str]] = sa.bindparam("gone", expanding=True)
        self._drop_events = t.delete().where(t.c.stream_id.in_(gone))
        self._drop_writers = w.delete().where(w.c.id.in_(gone))
        self._drop_streams = m.delete().where(m.c.id.in_(gone))
        self._insert_stream = m.insert()
        # Expired streams are swept away when a stream opens, at most this often: a reader
        # never sees one (info() checks the expiry), so the sweep only bounds the storage.
        self.sweep_interval_s = min(60.0, bounds.retention_s / 10)
        self._swept_at = -math.inf
        # Opens waiting for the next transaction (the ones arriving together share one).
        self._opening: list[tuple[str, str, asyncio.Future[None]]] = []
        self._opener: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._store.create_tables(_metadata)

    async def open(self, stream_id: str, tenant: str) -> None:
        """Returns once the stream is in the database (and its tenant within the cap). Opens
        that arrive while another transaction runs share the next one: a burst of new streams
        costs a few transactions, not one each."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opening.append((stream_id, tenant, done))
        if self._opener is None or self._opener.done():
            self._opener = asyncio.create_task(self._open_batches())
        await done

    async def _open_batches(self) -> None:
        while self._opening:
            # At most the cap per transaction, so each tenant's cap holds within one.
            batch = self._opening[: self.bounds.max_streams_per_tenant]
            del self._opening[: len(batch)]
            try:
                await self._store.run(self._open_sync, [(sid, tenant) for sid, tenant, _ in batch])
            except Exception as e:  # noqa: BLE001 - every waiter gets it (a 503), the opener goes on
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(e)
            else:
                for _, _, done in batch:
                    if not done.done():
                        done.set_result(None)

    def _open_sync(self, streams: list[tuple[str, str]]) -> None:
        now = time.time()
        with self._store.engine.begin() as conn:
            gone: list[str] = []
            for tenant, n in collections.Counter(tenant for _, tenant in streams).items():
                keep = self.bounds.max_streams_per_tenant - n
                gone += [
                    r[0] for r in conn.execute(self._overflow, {"tenant": tenant, "now": now, "keep": keep})
                ]
            if time.monotonic() - self._swept_at >= self.sweep_interval_s:
                self._swept_at = time.monotonic()
                gone += [r[0] for r in conn.execute(self._expired, {"now": now})]
            if gone:
                conn.execute(self._lock_exclusive, {"ids": gone})
                conn.execute(self._drop_events, {"gone": gone})
                conn.execute(self._drop_writers, {"gone": gone})
                conn.execute(self._drop_streams, {"gone": gone})
            expires = now + self.bounds.retention_s * 1.1
            conn.execute(
                self._insert_stream,
                [
                    {"id": sid, "tenant": tenant, "created_at": now, "ended": False, "last": -1,
                     "reader_at": now, "expires_at": expires}
                    for sid, tenant in streams
                ],
            )  # fmt: skip

    async def append(
        self, stream_id: str, events: list[tuple[int, bytes]], ended: bool, epoch: int = 0
    ) -> int:
        return (await self.append_many([Append(stream_id, events, ended, epoch)]))[0]

    async def append_many(self, appends: list[Append]) -> list[int]:
        if not appends:
            return []
        return await self._store.run(self._append_many_sync, appends)

    async def fence(self, stream_id: str, epoch: int) -> int:
        return await self._store.run(self._fence_sync, stream_id, epoch)

    def _fence_sync(self, stream_id: str, epoch: int) -> int:
        with self._store.engine.begin() as conn:
            conn.execute(self._lock_exclusive, {"ids": [stream_id]})
            row = conn.execute(self._lasts, {"ids": [stream_id]}).first()
            if row is None or row.expires_at < time.time():
                return GONE
            if epoch < (row.epoch or 0):
                return FENCED
            _raise_epoch(conn, stream_id, epoch, row.epoch is not None)
            return -1 if row.last_seq is None else int(row.last_seq)

    def _append_many_sync(self, appends: list[Append]) -> list[int]:
        """One transaction for every stream's new events: all of them or none. Per flush the
        work is one select and one insert: a stream's row is written only when it ends, when its
        expiry needs pushing (at most every tenth of the retention) and when it is trimmed."""
        meta, t = _meta_table, _events_table
        now = time.time()
        retention = self.bounds.retention_s
        with self._store.engine.begin() as conn:
            found: dict[str, tuple[int, float]] = {}
            epochs: dict[str, int | None] = {}  # None: no writer row yet (epoch 0)
            ids = list({a.stream_id for a in appends})
            conn.execute(self._lock_shared, {"ids": ids})
            for r in conn.execute(self._lasts, {"ids": ids}):
                found[r.id] = (-1 if r.last_seq is None else int(r.last_seq), r.expires_at)
                epochs[r.id] = r.epoch
            rows: list[tuple[str, int, bytes, bool]] = []
            updates: list[dict[str, Any]] = []
            trims: list[dict[str, Any]] = []
            out: list[int] = []
            for a in appends:
                if a.stream_id not in found:
                    out.append(GONE)
                    continue
                held = epochs[a.stream_id]
                if a.epoch < (held or 0):
                    out.append(FENCED)
                    continue
                if a.epoch > (held or 0):  # an append of a higher epoch fences the stream too
                    _raise_epoch(conn, a.stream_id, a.epoch, held is not None)
                    epochs[a.stream_id] = a.epoch
                last, expires_at = found[a.stream_id]
                new = [(seq, data) for seq, data in a.events if seq > last]
                if new and new[0][0] != last + 1:
                    out.append(HOLE)
                    continue
                final_i = len(new) - 1 if a.ended else -1
                rows.extend((a.stream_id, seq, data, i == final_i) for i, (seq, data) in enumerate(new))
                last = new[-1][0] if new else last
                found[a.stream_id] = (last, expires_at)
                if a.ended or expires_at < now + retention:
                    # Kept at least `retention` after its last event, at most a tenth longer.
                    expires_at = now + retention * 1.1
                    found[a.stream_id] = (last, expires_at)
                    updates.append(
                        {"b_id": a.stream_id, "b_last": last, "b_ended": a.ended, "b_exp": expires_at}
                    )
                if new and last >= self.bounds.max_events:
                    trims.append({"b_id": a.stream_id, "b_below": last - self.bounds.max_events})
                out.append(last)
            if rows:
                # The driver's own executemany: SQLAlchemy's per-row parameter processing was
                # most of a flush's CPU, and these four columns need none.
                conn.exec_driver_sql(self._insert_sql(conn), rows)
            if updates:
                conn.execute(
                    meta.update()
                    .where(meta.c.id == sa.bindparam("b_id"))
                    .values(last=sa.bindparam("b_last"), ended=sa.bindparam("b_ended"),
                            expires_at=sa.bindparam("b_exp")),
                    updates,
                )  # fmt: skip
            if trims:
                conn.execute(
                    t.delete().where(
                        t.c.stream_id == sa.bindparam("b_id"), t.c.seq <= sa.bindparam("b_below")
                    ),
                    trims,
                )
        return out

    @staticmethod
    def _insert_sql(conn: sa.Connection) -> str:
        # The gateway's two drivers: sqlite3 (qmark) and psycopg (format / pyformat).
        marks = "?, ?, ?, ?" if conn.dialect.paramstyle == "qmark" else "%s, %s, %s, %s"
        return f"INSERT INTO gateway_stream_events (stream_id, seq, data, final) VALUES ({marks})"  # noqa: S608 - constant names

    async def info(self, stream_id: str) -> StreamInfo | None:
        return await self._store.run(self._info_sync, stream_id)

    def _info_sync(self, stream_id: str) -> StreamInfo | None:
        with self._store.engine.connect() as conn:
            row = conn.execute(self._lasts, {"ids": [stream_id]}).first()
        if row is None or row.expires_at < time.time():
            return None
        return StreamInfo(
            tenant=row.tenant,
            ended=bool(row.ended),
            last=-1 if row.last_seq is None else int(row.last_seq),
            reader_at=row.reader_at,
        )

    async def read(self, stream_id: str, after: int, wait_s: float) -> list[tuple[int, bytes, bool]]:
        deadline = time.monotonic() + min(wait_s, READ_BLOCK_S)
        while True:
            rows = await self._store.run(self._read_sync, stream_id, after)
            if rows or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        _check_contiguous(rows, after)
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
            conn.execute(self._lock_exclusive, {"ids": [stream_id]})
            conn.execute(_events_table.delete().where(_events_table.c.stream_id == stream_id))
            conn.execute(_writers_table.delete().where(_writers_table.c.id == stream_id))
            conn.execute(_meta_table.delete().where(_meta_table.c.id == stream_id))

    async def close(self) -> None:
        return None


@dataclass
class LiveStream:
    """A stream this replica generates: its events in memory, for its own readers.

    `events[:durable]` may be read: the log holds them, or the log has failed for this stream
    (`unlogged`) and they are delivered from memory only. `events[logged:]` are not yet written.
    `fenced`: another writer took the stream over; nothing more is written from here, and
    readers here continue from the log."""

    id: str
    tenant: str
    events: list[bytes] = field(default_factory=list)
    ended: bool = False
    readers: int = 0
    durable: int = 0
    logged: int = 0
    unlogged: bool = False
    fenced: bool = False
    # Set when the last local reader leaves (the generation's owner decides on a grace).
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Set (and replaced) when `durable` grows: each reader waits on the one current when it
    # caught up.
    _notify: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the stream ended and every event is durable (and a lost log forgot it).
    _drained: asyncio.Event = field(default_factory=asyncio.Event)
    _forgetting: bool = False

    @property
    def next_seq(self) -> int:
        return len(self.events)

    def _fence(self) -> None:
        self.fenced = True
        self._notify.set()
        self._notify = asyncio.Event()
        self._drained.set()

    def _advance(self, durable: int) -> None:
        if durable > self.durable:
            self.durable = durable
            self._notify.set()
            self._notify = asyncio.Event()
        if self.ended and self.durable == len(self.events) and not self._forgetting:
            self._drained.set()


class LiveStreams:
    """This replica's generating streams, over the shared log. One flusher task writes the new
    events of every stream at once, at most once per `flush_interval_s` (by default the log's),
    one flush at a time (so a stream's appends reach the log in order)."""

    def __init__(
        self,
        log: EventLog,
        grace_s: float = 30.0,
        flush_interval_s: float | None = None,
        writer_silence_s: float = 600.0,
        writer_alive: Callable[[str], Awaitable[bool]] | None = None,
    ):
        self.log = log
        self.grace_s = grace_s
        self.writer_silence_s = writer_silence_s
        self.writer_alive = writer_alive
        self.flush_interval_s = log.flush_interval_s if flush_interval_s is None else flush_interval_s
        self._live: dict[str, LiveStream] = {}
        # Streams with events not yet written, in the order they got them.
        self._dirty: dict[str, LiveStream] = {}
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    async def create(self, stream_id: str, tenant: str) -> LiveStream:
        await self.log.open(stream_id, tenant)
        live = LiveStream(stream_id, tenant)
        self._live[stream_id] = live
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop())
        return live

    def push(self, live: LiveStream, data: bytes, *, end: bool = False) -> int:
        """Append one event (its sequence number is the next one); `end`: the stream's last."""
        if live.ended:
            raise RuntimeError("stream already ended")
        seq = len(live.events)
        live.events.append(data)
        if end:
            live.ended = True
        if live.unlogged:
            live._advance(len(live.events))
        elif not live.fenced:
            self._dirty[live.id] = live
            self._wake.set()
        return seq

    async def flushed(self, live: LiveStream) -> None:
        """Every event pushed so far (the stream has ended) is in the log, or will never be."""
        await live._drained.wait()
        self._live.pop(live.id, None)

    def hand_over(self, live: LiveStream) -> None:
        """Another writer took the stream over (its generation here stops): nothing more of it
        is written from here; its readers here go on from the log where they were (or, when
        the log had already failed for it, end, since the log lacks what they got)."""
        if self._live.get(live.id) is live:
            del self._live[live.id]
        live._fence()

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_flush = -self.flush_interval_s
        while True:
            await self._wake.wait()
            # Let the events of a few milliseconds gather: one write carries them all.
            wait = last_flush + self.flush_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            last_flush = loop.time()
            dirty, self._dirty = list(self._dirty.values()), {}
            try:
                await self._flush(dirty)
            except Exception:  # the flusher must outlive any one flush: writers wait on it
                logger.exception("event log flush failed")
                for live in dirty:
                    live.unlogged = True
                    live._advance(len(live.events))

    async def _flush(self, dirty: list[LiveStream]) -> None:
        streams: list[LiveStream] = []
        appends: list[Append] = []
        for live in dirty:
            if live.unlogged or live.fenced:
                continue
            upto = len(live.events)
            events = [(seq, live.events[seq]) for seq in range(live.logged, upto)]
            streams.append(live)
            appends.append(Append(live.id, events, live.ended and upto == len(live.events)))
        for attempt in range(2):
            try:
                results = await self.log.append_many(appends)
                break
            except Exception as e:  # noqa: BLE001 - a log outage costs resumability, not the stream
                if attempt == 0:
                    # Once more (appends are idempotent): one slow reply should not cost every
                    # stream of the flush its resumability.
                    await asyncio.sleep(self.flush_interval_s)
                    continue
                logger.warning("could not write %d streams to the event log: %s", len(streams), e)
                results = [HOLE] * len(streams)
        lost: list[LiveStream] = []
        for live, result in zip(streams, results, strict=True):
            if result >= 0:
                live.logged = result + 1
                live._advance(live.logged)
                continue
            if result == FENCED:
                # A successor continues the log from what it held (its prefix is ours, durable
                # here); the generation here learns of it from its lease.
                logger.warning(
                    "stream %s was taken over by another writer; this replica stops writing it", live.id
                )
                self.hand_over(live)
                continue
            # The log lost this stream (or refused a hole): its readers here get the rest from
            # memory; elsewhere the stream is gone (a clear 404), never resumed with a gap.
            live.unlogged = live._forgetting = True
            live._advance(len(live.events))
            lost.append(live)
        for live in lost:
            with contextlib.suppress(Exception):
                await self.log.delete(live.id)
            live._forgetting = False
            live._advance(len(live.events))

    def local(self, stream_id: str) -> LiveStream | None:
        return self._live.get(stream_id)

    async def follow(self, stream_id: str, after: int) -> AsyncIterator[bytes]:
        """The events after `after`, then live ones until the final one; from memory when this
        replica generates the stream, else from the log. A resume at or past the end gets the
        final event again. A chunk yielded may hold several whole events."""
        live = self._live.get(stream_id)
        if live is not None:
            async for data in self._follow_local(live, after):
                yield data
            return
        async for data in self._follow_log(stream_id, after):
            yield data

    async def _vouched(self, stream_id: str) -> bool:
        """`writer_alive` says the writer lives (an error reading it counts as alive: a reader
        is not cut off for a store's hiccup)."""
        if self.writer_alive is None:
            return False
        try:
            return await self.writer_alive(stream_id)
        except Exception:  # noqa: BLE001 - see above
            return True

    async def _follow_local(self, live: LiveStream, after: int) -> AsyncIterator[bytes]:
        live.readers += 1
        live.idle.clear()
        try:
            position = after + 1
            sent = False
            while True:
                if live.ended and sent and position >= live.next_seq:
                    return  # it has the final event (a hand-over now must not send it again)
                if live.fenced:
                    break
                if live.ended and position >= live.next_seq and not sent:
                    # Resumed at or past the end (also of a stream that was still running
                    # then): the final event again, so the reader learns how it ended.
                    position = live.next_seq - 1
                durable = live.durable
                if position < durable:
                    # Whatever piled up since the last wake goes out as one write.
                    chunk = b"".join(live.events[position:durable])
                    position = durable
                    sent = True
                    yield chunk
                    continue
                await live._notify.wait()
        finally:
            live.readers -= 1
            if live.readers == 0:
                live.idle.set()
        if live.unlogged:
            yield (
                b": this stream was taken over by another gateway replica, and the events sent here "
                b"were not all logged; it ends here unfinished\n\n"
            )
            return
        # Everything sent so far is in the log, where the successor goes on.
        async for data in self._follow_log(live.id, position - 1):
            yield data

    async def _follow_log(self, stream_id: str, after: int) -> AsyncIterator[bytes]:
        info = await self.log.info(stream_id)
        if info is not None and info.ended and after >= info.last >= 0:
            after = info.last - 1
        last_touch = 0.0
        sent = False
        heard = time.monotonic()  # when the log last gave this reader an event (or it began)
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
            if batch:
                sent = True
                heard = time.monotonic()
                continue
            info = await self.log.info(stream_id)
            if info is None:
                return
            silent = time.monotonic() - heard
            if not info.ended and silent >= self.writer_silence_s and not await self._vouched(stream_id):
                logger.warning("stream %s: silent %.0f s and not ended: its reader ends", stream_id, silent)
                yield (
                    b": the stream's writer has sent nothing for %d s (its gateway replica may have "
                    b"stopped); it ends here unfinished\n\n" % int(silent)
                )
                return
            if info.ended and info.last <= after:
                if sent or info.last < 0:
                    return
                # Resumed past the end of a stream that was still running then: the final
                # event again, as a resume past the end of a finished one gets it.
                after = info.last - 1
