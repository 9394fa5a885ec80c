"""Database engines for paved's stores (the gateway's keys and tenants, the control plane's
fleet): SQLite for one process, PostgreSQL (psycopg 3) for several replicas.

Invariants callers rely on: SQLite transactions are `BEGIN IMMEDIATE` (a read-then-write
transaction holds the write lock from its first statement, so compare-and-set holds across
processes), foreign keys are on and files use WAL; PostgreSQL connections have a 5 s connect
timeout and a 10 s statement timeout, and dead pooled connections are replaced.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine


def engine_for(url: str, *, what: str = "store") -> Engine:
    """A SQLAlchemy engine for sqlite:///PATH (or sqlite://, in memory) or postgresql://...
    (psycopg 3, with connect and statement timeouts)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"the {what} needs a database URL: sqlite:///PATH or postgresql://...")
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        is_memory = parsed.database in (None, "", ":memory:")
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 10}}
        if is_memory:
            # One shared connection, else each pooled connection would see its own empty DB.
            kwargs["poolclass"] = sa.pool.StaticPool
        engine = sa.create_engine(parsed, **kwargs)

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            # pysqlite's own transaction handling would BEGIN lazily (DEFERRED); _begin below
            # takes the write lock up front instead.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if not is_memory:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            # IMMEDIATE: a read-then-write transaction (compare-and-set, publish) holds the
            # write lock from its first read, so another process cannot slip in between and
            # the busy timeout applies instead of an instant SQLITE_BUSY_SNAPSHOT.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if backend == "postgresql":
        if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        return sa.create_engine(
            parsed,
            pool_pre_ping=True,
            pool_timeout=10,
            connect_args={"connect_timeout": 5, "options": "-c statement_timeout=10000"},
        )
    raise ValueError(f"unsupported {what} URL scheme '{parsed.drivername}': use sqlite:/// or postgresql://")


def utc(value: datetime | None) -> datetime | None:
    """UTC-aware form of a datetime read back (SQLite drops the offset; PostgreSQL returns the
    session's zone)."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def utc_now() -> datetime:
    return datetime.now(UTC)
