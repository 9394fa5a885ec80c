"""Leader election between control planes that drive the same clusters (paved.control_plane.
leader) when the holder is cut off from PostgreSQL without its connection closing, as in a
network partition: the holder must learn it is no longer leader, in bounded time, before the
server gives the lock to another replica. A real PostgreSQL 15 behind a loopback TCP relay
that can stop relaying (its sockets stay open, so no side sees an end of stream)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import psycopg
import pytest

from paved.control_plane import leader as leader_module
from paved.control_plane.leader import LeaderLock
from paved.testing.postgres import create_database, postgres_server

# Only so that a hang fails the test instead of stalling the suite: many times the deadline.
HANG_S = 60.0
_db_names = itertools.count()
T = TypeVar("T")


class _Relay:
    """127.0.0.1:port -> target, byte for byte, until `cut()`: from then on whatever either side
    sends is read and dropped (a black hole, not a reset)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.dropping = threading.Event()
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut(self) -> None:
        self.dropping.set()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self.dropping.is_set():
                    dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture
def relayed(server: str) -> Iterator[tuple[str, str, _Relay]]:
    """(database url, the same database through a relay, the relay)."""
    url = create_database(server, f"leader_{next(_db_names)}")
    parsed = psycopg.conninfo.conninfo_to_dict(url)
    relay = _Relay((str(parsed["host"]), int(parsed["port"])))
    try:
        yield url, url.replace(f":{parsed['port']}/", f":{relay.port}/"), relay
    finally:
        relay.close()


def within(seconds: float, coro_fn: Callable[[], Awaitable[T]]) -> T:
    """coro_fn()'s result, run in a thread of its own: a call that hangs fails the test (an
    asyncio worker thread would keep the test's own loop from closing)."""
    result: list[T] = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(coro_fn())), daemon=True)
    t.start()
    t.join(seconds)
    assert result, f"no answer after {seconds} s"
    return result[0]


def test_a_holder_cut_off_from_postgres_steps_down_in_bounded_time(relayed, monkeypatch) -> None:
    _, through_relay, relay = relayed
    # A short deadline keeps the test short; what matters is that there is one.
    monkeypatch.setattr(leader_module, "STATEMENT_DEADLINE_S", 2.0)
    holder = LeaderLock(through_relay)
    assert within(HANG_S, holder.try_acquire) and within(HANG_S, holder.check)
    relay.cut()
    # Before: libpq waited on the silent server and check() never answered, so the holder
    # kept leading (and release() hung the same way at shutdown).
    assert within(HANG_S, holder.check) is False
    assert not holder.is_leader
    within(HANG_S, holder.release)
    assert within(HANG_S, holder.try_acquire) is False


def test_the_lock_session_has_keepalives_so_the_server_frees_a_lost_holders_lock(relayed) -> None:
    """A relay keeps both TCP ends alive, so the server side of a partition cannot be played
    here: what makes the server drop the lost holder's session (and its lock) in ~25 s rather
    than the kernel's 2 hours is the session's own TCP settings, read back from the server."""
    url, _, _ = relayed

    async def go() -> None:
        holder = LeaderLock(url)
        assert await holder.try_acquire()
        try:
            conn = holder._conn
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("tcp_keepalives_idle", "tcp_keepalives_count", "tcp_user_timeout")
            }
            assert settings["tcp_keepalives_idle"] not in ("0", "")
            assert settings["tcp_keepalives_count"] not in ("0", "")
            assert settings["tcp_user_timeout"] not in ("0", "")
        finally:
            await holder.release()

    asyncio.run(go())
