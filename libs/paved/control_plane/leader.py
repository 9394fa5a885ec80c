"""Leader election between control-plane replicas sharing one store.

`LeaderLock(url)` names the same database as the ControlStore. Only the holder runs the
reconcile loops (rollouts, autoscaling, GC); the others serve the API and wait.

- PostgreSQL: a session-level `pg_try_advisory_lock` on a dedicated connection that stays
  open while held. The server drops the lock when that connection ends, so a crashed or
  partitioned holder loses it without any lease timing; `check()` asks the server whether this
  connection still holds it (a broken connection means "no").
- SQLite: an exclusive `fcntl.flock` on `<database path>.leader`, which the kernel drops when
  the process dies. flock belongs to the open file, so two LeaderLocks in one process also
  exclude each other (another lock name uses `<database path>.<hash>.leader`). An in-memory
  database has no file: the lock is then process-local.

Invariants: at most one LeaderLock per (database, name) is leader at any moment; every call
is bounded (connect and statement timeouts, a client-side deadline on each statement,
non-blocking flock); `is_leader` is this object's last known state and `check()` re-verifies
it. Blocking work runs in a worker thread.

A holder cut off from PostgreSQL (a partition, not a crash) must stop leading before anyone
else can lead: its `check()` answers False within `STATEMENT_DEADLINE_S` (libpq itself would
wait for the lost server for as long as TCP retransmits, ~15 minutes), while the server keeps
the lock until TCP tells it the session is dead, which the session's keepalive settings make
~25 s after the last packet (the defaults make it 2 hours without a leader).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa

from paved.control_plane.errors import BadRequest

DEFAULT_NAME = "paved-control-plane"
# A statement on the lock's connection that has no answer after this long means the server is
# unreachable: the connection is cut (the statement_timeout below answers well before it).
STATEMENT_DEADLINE_S = 8.0
# tcp_keepalives_*: probes after 10 s of silence, every 5 s, 3 lost = dead (25 s);
# tcp_user_timeout: the same 25 s when the server's last reply went unacknowledged.
_SESSION_OPTIONS = (
    "-c statement_timeout=5000 -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5"
    " -c tcp_keepalives_count=3 -c tcp_user_timeout=25000"
)
_MEMORY_HELD: set[str] = set()
_MEMORY_GUARD = threading.Lock()


logger = logging.getLogger("paved.control_plane")


async def lead(
    lock: LeaderLock,
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    report: Callable[[str | None], None],
    *,
    poll_s: float = 1.0,
    retry_max_s: float = 30.0,
) -> None:
    """Wait for `lock`, then `start` what the leader runs, then hold the lock; returns once it
    is lost, after `stop`.

    A `start` that raises (the database blipped, a cluster unreachable while its replicas are
    adopted) is retried, backing off from `poll_s` to `retry_max_s`, for as long as the lock is
    held; `report` gets each failure (what /health/ready shows), then None once started. So a
    leader never sits on the lock with nothing running. `stop` runs as soon as the loss is
    seen (within `poll_s`), before the caller winds anything else down: the next leader may be
    starting already, and two controllers must not act at once."""
    # Polled: a lock held by another process signals nothing here.
    while not await lock.try_acquire():  # noqa: ASYNC110
        await asyncio.sleep(poll_s)
    logger.info("this control plane is the leader")
    delay = poll_s
    try:
        while True:
            try:
                await start()
            except Exception as e:  # retried below, and reported
                report(f"starting as the leader failed: {type(e).__name__}: {e}")
                logger.exception("could not start as the leader; retrying in %.0f s", delay)
                await asyncio.sleep(delay)
                delay = min(retry_max_s, delay * 2)
                if not await lock.check():
                    return
                continue
            report(None)
            break
        while await lock.check():  # noqa: ASYNC110
            await asyncio.sleep(poll_s)
    finally:
        await stop()


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a lock name."""
    digest = hashlib.sha256(("paved-leader:" + name).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class LeaderLock:
    def __init__(self, url: str, *, name: str = DEFAULT_NAME):
        if not isinstance(name, str) or not 0 < len(name) <= 128 or not name.isprintable():
            raise BadRequest("leader lock name must be a printable string of 1 to 128 characters")
        if not isinstance(url, str) or not url:
            raise ValueError("LeaderLock needs a database URL: sqlite:///PATH or postgresql://...")
        parsed = sa.make_url(url)
        self._name = name
        self._backend = parsed.get_backend_name()
        if self._backend == "postgresql":
            # psycopg wants a libpq URL: drop SQLAlchemy's "+driver" suffix.
            self._pg_url = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
            self._key = lock_key(name)
        elif self._backend == "sqlite":
            db = parsed.database
            # The default name keeps the plain `<db>.leader`; another name gets its own file.
            suffix = ".leader" if name == DEFAULT_NAME else f".{lock_key(name) & 0xFFFFFFFF:08x}.leader"
            self._path = None if db in (None, "", ":memory:") else os.path.abspath(db) + suffix
        else:
            raise ValueError(f"unsupported leader lock URL scheme '{parsed.drivername}'")
        self._conn: Any = None  # psycopg.Connection while held (PostgreSQL)
        self._fd: int | None = None  # the flocked file while held (SQLite file)
        self._memory = False  # held in _MEMORY_HELD (SQLite in memory)
        self._held = False
        # One caller at a time on the dedicated connection / fd.
        self._guard = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def is_leader(self) -> bool:
        return self._held

    async def try_acquire(self) -> bool:
        """Take the lock if free (never waits for it); True if this object holds it now."""
        return await asyncio.to_thread(self._acquire_sync)

    async def check(self) -> bool:
        """Whether the lock is still held (re-verified with the database / the file)."""
        return await asyncio.to_thread(self._check_sync)

    async def release(self) -> None:
        """Give the lock up (idempotent)."""
        await asyncio.to_thread(self._release_sync)

    async def close(self) -> None:
        await self.release()

    # -- sync ------------------------------------------------------------------------------

    def _acquire_sync(self) -> bool:
        with self._guard:
            if self._held and self._check_locked():
                return True
            self._drop_locked()
            if self._backend == "postgresql":
                self._held = self._acquire_pg()
            elif self._path is None:
                with _MEMORY_GUARD:
                    if self._name not in _MEMORY_HELD:
                        _MEMORY_HELD.add(self._name)
                        self._memory = self._held = True
            else:
                self._held = self._acquire_file(self._path)
            return self._held

    def _acquire_pg(self) -> bool:
        import psycopg

        try:
            conn = psycopg.connect(
                self._pg_url,
                autocommit=True,
                connect_timeout=5,
                options=_SESSION_OPTIONS,
                application_name="paved-leader",
            )
        except psycopg.Error:
            return False
        try:
            row = _bounded(conn, "SELECT pg_try_advisory_lock(%s)", (self._key,))
        except psycopg.Error:
            conn.close()
            return False
        if not (row and row[0]):
            conn.close()
            return False
        self._conn = conn
        return True

    def _acquire_file(self, path: str) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        # Locked a file that was since unlinked (by a holder cleaning up): retry on the new one.
        if not self._same_file(fd, path):
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    @staticmethod
    def _same_file(fd: int, path: str) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _check_sync(self) -> bool:
        with self._guard:
            if not self._held:
                return False
            if not self._check_locked():
                self._drop_locked()
            return self._held

    def _check_locked(self) -> bool:
        if self._backend == "postgresql":
            import psycopg

            if self._conn is None or self._conn.closed:
                return False
            hi, lo = (self._key >> 32) & 0xFFFFFFFF, self._key & 0xFFFFFFFF
            try:
                # A bigint advisory key is stored as classid (high half), objid (low half).
                row = _bounded(
                    self._conn,
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND pid = pg_backend_pid() AND classid = %s AND objid = %s AND objsubid = 1",
                    (hi, lo),
                )
            except psycopg.Error:
                return False
            return bool(row and row[0])
        if self._memory:
            return True
        return self._fd is not None and self._path is not None and self._same_file(self._fd, self._path)

    def _release_sync(self) -> None:
        with self._guard:
            self._drop_locked()

    def _drop_locked(self) -> None:
        """Let go of whatever is held; never raises."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                # Closing the session frees the lock; unlock first so it is free at once even if
                # the close is slow.
                _bounded(self._conn, "SELECT pg_advisory_unlock(%s)", (self._key,))
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None
        if self._memory:
            with _MEMORY_GUARD:
                _MEMORY_HELD.discard(self._name)
            self._memory = False
        self._held = False


def _bounded(conn: Any, query: str, params: tuple[int, ...]) -> Any:
    """The first row of `query` on `conn`, or psycopg.OperationalError once STATEMENT_DEADLINE_S
    has passed without an answer: the connection's socket is then shut down, which ends libpq's
    wait (the connection is unusable afterwards, as it would be once TCP gave up)."""
    settled = threading.Lock()
    done = False

    def cut() -> None:
        with settled:
            if done:
                return
            with contextlib.suppress(OSError, ValueError):
                sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.close()

    timer = threading.Timer(STATEMENT_DEADLINE_S, cut)
    timer.daemon = True
    timer.start()
    try:
        return conn.execute(query, params).fetchone()
    finally:
        with settled:
            done = True
        timer.cancel()
