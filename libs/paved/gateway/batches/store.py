"""The durable state of files and batches, in the gateway's database (SQLite or PostgreSQL).

Tables: `batch_files` (metadata; the bytes are in the object store), `batches`, and
`batch_lines`, one row per request line with its state machine

    pending --lease--> leased --(answer committed by the lease holder)--> done | failed
       ^                  |
       +--(retryable answer, lease expired, abandoned on cancel/expiry)--+

Invariants callers rely on:
- A line is leased by at most one runner at a time: leasing is one transaction that selects
  pending lines (or leased ones whose lease expired) with `FOR UPDATE SKIP LOCKED` on
  PostgreSQL, and under SQLite's single writer (`BEGIN IMMEDIATE`, paved.sql) otherwise; each
  lease bumps `attempt`.
- A line's result is committed only by the holder of its current lease (`owner` and `attempt`
  match): a runner whose lease expired and was taken over cannot write, so each line gets
  exactly one result, and a result once committed is never redone.
- Output is written in chunks: a settled line's output line waits in its row (`result`) until
  a runner writes it into a chunk object (`batches/<batch id>/chunks/<chunk id>`) and then
  commits, in ONE transaction, the chunk's manifest row (`batch_chunks`) and `result = NULL` on
  exactly those lines, conditionally on each still holding its result. So a line's output is in
  its row or in exactly one committed chunk, never both, never neither: a chunk object written
  but not committed (a crash, or a runner that lost a race for the same lines) has no manifest
  row and is ignored; its lines keep their results and go into a later chunk.
- A batch is finalized by one runner at a time (a finalize lease on the batch row); it chunks
  the lines still holding results, then concatenates the committed chunks into the output and
  error files, with ids fixed by the batch id, so a finalization redone after a crash writes
  the same files. `finish` publishes them only if no line is open or unchunked.
- Retention: a finished batch older than the retention is deleted with its line rows, manifest
  rows and output/error file rows (`delete_batch`, idempotent; the caller deletes the objects
  first, so nothing is orphaned by a crash in between).
- `batch_token_use` counts each tenant's batch tokens per minute over all replicas (committed
  with the answers that used them): the tenant token share is enforced across replicas.
- Times are UNIX seconds (floats), as the OpenAI objects carry them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from paved.gateway.access.state import GatewayStore
from paved.gateway.errors import GatewayError

metadata = sa.MetaData()

files_table = sa.Table(
    "batch_files",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(63), nullable=False, index=True),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("filename", sa.String(255), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("object_key", sa.String(255), nullable=False),
    sa.Column("lines", sa.Integer, nullable=False),
    sa.Column("url", sa.String(64), nullable=True),
    sa.Column("model", sa.String(256), nullable=True),
)

batches_table = sa.Table(
    "batches",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(63), nullable=False, index=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(8), nullable=False),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("total", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("in_progress_at", sa.Float, nullable=True),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("finalizing_at", sa.Float, nullable=True),
    sa.Column("completed_at", sa.Float, nullable=True),
    sa.Column("expired_at", sa.Float, nullable=True),
    sa.Column("cancelling_at", sa.Float, nullable=True),
    sa.Column("cancelled_at", sa.Float, nullable=True),
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("completed", sa.Integer, nullable=True),
    sa.Column("failed", sa.Integer, nullable=True),
    # The finalizer's lease on the batch (who writes the files, until when).
    sa.Column("finalize_owner", sa.String(64), nullable=True),
    sa.Column("finalize_until", sa.Float, nullable=True),
)

lines_table = sa.Table(
    "batch_lines",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line_no", sa.Integer, primary_key=True),
    sa.Column("custom_id", sa.String(512), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("state", sa.String(8), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
    sa.Column("owner", sa.String(64), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("next_at", sa.Float, nullable=False, default=0.0),
    sa.Column("queued_at", sa.Float, nullable=False),
    # The output (or error) file's line for this request, once done or failed.
    sa.Column("result", sa.Text, nullable=True),
    sa.Index("batch_lines_state", "batch_id", "state", "line_no"),
)

# One row per committed chunk of a batch's output: the object holds `out_bytes` bytes of output
# lines (`out_lines` of them) followed by `err_bytes` bytes of error-file lines.
chunks_table = sa.Table(
    "batch_chunks",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("chunk_id", sa.String(64), primary_key=True),
    sa.Column("object_key", sa.String(255), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("out_lines", sa.Integer, nullable=False),
    sa.Column("out_bytes", sa.BigInteger, nullable=False),
    sa.Column("err_lines", sa.Integer, nullable=False),
    sa.Column("err_bytes", sa.BigInteger, nullable=False),
)

# Batch tokens per tenant and minute (UNIX seconds // 60), summed over every replica.
token_use_table = sa.Table(
    "batch_token_use",
    metadata,
    sa.Column("tenant", sa.String(63), primary_key=True),
    sa.Column("minute", sa.Integer, primary_key=True),
    sa.Column("tokens", sa.BigInteger, nullable=False),
)

# When a file is deleted (OpenAI's `expires_after` at upload; a batch's output and error files:
# their batch's retention). A table of its own: a database made before expiries existed gains
# it through create_tables, with no migration.
file_expiry_table = sa.Table(
    "batch_file_expiry",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class TooManyBatches(Exception):
    """The tenant has as many unfinished batches as it may (the count is the argument)."""


FINISHED = ("completed", "failed", "expired", "cancelled")
SETTLED = ("done", "failed")
_INSERT_CHUNK = 500


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Lease:
    batch_id: str
    line_no: int
    custom_id: str
    body: dict[str, Any]
    attempt: int
    queued_at: float


@dataclass(frozen=True)
class Chunk:
    """A committed chunk of a batch's output (a `batch_chunks` row)."""

    chunk_id: str
    object_key: str
    out_lines: int
    out_bytes: int
    err_lines: int
    err_bytes: int


def chunk_prefix(batch_id: str) -> str:
    """The object-store folder of a batch's chunks (every object under it is the batch's)."""
    return f"batches/{batch_id}/"


class _Conflict(Exception):
    """Rolls a chunk's commit back: another runner committed some of its lines first."""


def _not_found(kind: str, ident: str) -> GatewayError:
    return GatewayError(404, f"No such {kind}: '{ident}'", code="not_found")


class BatchStore:
    """Files and batches of every tenant; every method checks the tenant (another tenant's
    object is a 404, worded like one that does not exist)."""

    def __init__(self, store: GatewayStore):
        self._store = store
        self._engine = store.engine
        self._pg = store.dialect == "postgresql"

    async def start(self) -> None:
        await self._store.create_tables(metadata)

    # -- files -----------------------------------------------------------------------------

    async def add_file(self, row: dict[str, Any], expires_at: float | None = None) -> None:
        def go() -> None:
            with self._engine.begin() as c:
                c.execute(files_table.insert().values(**row))
                if expires_at is not None:
                    c.execute(file_expiry_table.insert().values(id=row["id"], expires_at=expires_at))

        await self._store.run(go)

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        """The file's row, with `expires_at` (None: kept until deleted)."""

        def go() -> dict[str, Any] | None:
            with self._engine.connect() as c:
                row = c.execute(
                    sa.select(files_table, file_expiry_table.c.expires_at)
                    .select_from(
                        files_table.outerjoin(file_expiry_table, file_expiry_table.c.id == files_table.c.id)
                    )
                    .where(files_table.c.id == file_id, files_table.c.tenant == tenant)
                ).first()
            return dict(row._mapping) if row is not None else None

        found = await self._store.run(go)
        if found is None:
            raise _not_found("file", file_id)
        return found

    async def list_files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        rows, more = await self._page(files_table, tenant, after, limit, ascending, purpose=purpose)
        ids = [r["id"] for r in rows]

        def go() -> dict[str, float]:
            with self._engine.connect() as c:
                found = c.execute(
                    sa.select(file_expiry_table.c.id, file_expiry_table.c.expires_at).where(
                        file_expiry_table.c.id.in_(ids)
                    )
                ).all()
            return {r[0]: r[1] for r in found}

        expiry = await self._store.run(go) if ids else {}
        for r in rows:
            r["expires_at"] = expiry.get(r["id"])
        return rows, more

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        def go() -> dict[str, Any] | None:
            with self._engine.begin() as c:
                row = c.execute(
                    sa.select(files_table).where(files_table.c.id == file_id, files_table.c.tenant == tenant)
                ).first()
                if row is None:
                    return None
                c.execute(files_table.delete().where(files_table.c.id == file_id))
                c.execute(file_expiry_table.delete().where(file_expiry_table.c.id == file_id))
                return dict(row._mapping)

        found = await self._store.run(go)
        if found is None:
            raise _not_found("file", file_id)
        return found

    async def _page(
        self,
        table: sa.Table,
        tenant: str,
        after: str | None,
        limit: int,
        ascending: bool,
        purpose: str | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """A cursor page, newest first (or oldest first): the rows after the row `after`."""

        def go() -> tuple[list[dict[str, Any]], bool]:
            with self._engine.connect() as c:
                q = sa.select(table).where(table.c.tenant == tenant)
                if purpose is not None:
                    q = q.where(table.c.purpose == purpose)
                if after is not None:
                    ref = c.execute(
                        sa.select(table.c.created_at).where(table.c.id == after, table.c.tenant == tenant)
                    ).first()
                    if ref is not None:
                        t = ref[0]
                        if ascending:
                            q = q.where(
                                sa.or_(
                                    table.c.created_at > t,
                                    sa.and_(table.c.created_at == t, table.c.id > after),
                                )
                            )
                        else:
                            q = q.where(
                                sa.or_(
                                    table.c.created_at < t,
                                    sa.and_(table.c.created_at == t, table.c.id < after),
                                )
                            )
                order = (
                    (table.c.created_at, table.c.id)
                    if ascending
                    else (table.c.created_at.desc(), table.c.id.desc())
                )
                rows = c.execute(q.order_by(*order).limit(limit + 1)).all()
            out = [dict(r._mapping) for r in rows]
            return out[:limit], len(out) > limit

        return await self._store.run(go)

    # -- batches ---------------------------------------------------------------------------

    async def create_batch(
        self, row: dict[str, Any], lines: Iterator[tuple[str, str]], max_active: int | None = None
    ) -> None:
        """Insert the batch and all its lines in one transaction: a batch is visible only with
        every line queued (a crash mid-insert leaves nothing). `max_active`: TooManyBatches
        when the tenant already has that many batches not yet finished (counted in the same
        transaction, which on PostgreSQL first takes the tenant's advisory lock: creates of one
        tenant take turns there, as SQLite's single writer makes them everywhere)."""
        now = row["created_at"]

        def go() -> None:
            with self._engine.begin() as c:
                if max_active is not None:
                    if c.dialect.name == "postgresql":
                        # READ COMMITTED alone lets two creates count the same rows and both pass.
                        c.execute(
                            sa.text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
                            {"key": "paved.gateway.batches:" + row["tenant"]},
                        )
                    active = c.execute(
                        sa.select(sa.func.count())
                        .select_from(batches_table)
                        .where(batches_table.c.tenant == row["tenant"], batches_table.c.status.in_(ACTIVE))
                    ).scalar_one()
                    if active >= max_active:
                        raise TooManyBatches(active)
                c.execute(batches_table.insert().values(**row))
                chunk: list[dict[str, Any]] = []
                for n, (custom_id, body) in enumerate(lines):
                    chunk.append(
                        {
                            "batch_id": row["id"],
                            "line_no": n,
                            "custom_id": custom_id,
                            "body": body,
                            "state": "pending",
                            "attempt": 0,
                            "next_at": 0.0,
                            "queued_at": now,
                        }
                    )
                    if len(chunk) >= _INSERT_CHUNK:
                        c.execute(lines_table.insert(), chunk)
                        chunk = []
                if chunk:
                    c.execute(lines_table.insert(), chunk)

        await self._store.run(go)

    async def get_batch(self, tenant: str | None, batch_id: str) -> dict[str, Any]:
        def go() -> dict[str, Any] | None:
            with self._engine.connect() as c:
                q = sa.select(batches_table).where(batches_table.c.id == batch_id)
                if tenant is not None:
                    q = q.where(batches_table.c.tenant == tenant)
                row = c.execute(q).first()
                if row is None:
                    return None
                out = dict(row._mapping)
                out["counts"] = self._counts(c, [batch_id]).get(batch_id, {})
                return out

        found = await self._store.run(go)
        if found is None:
            raise _not_found("batch", batch_id)
        return found

    def _counts(self, c: sa.Connection, ids: list[str]) -> dict[str, dict[str, int]]:
        rows = c.execute(
            sa.select(lines_table.c.batch_id, lines_table.c.state, sa.func.count())
            .where(lines_table.c.batch_id.in_(ids))
            .group_by(lines_table.c.batch_id, lines_table.c.state)
        ).all()
        out: dict[str, dict[str, int]] = {}
        for batch_id, state, n in rows:
            out.setdefault(batch_id, {})[state] = int(n)
        return out

    async def list_batches(
        self, tenant: str, *, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], bool]:
        rows, more = await self._page(batches_table, tenant, after, limit, ascending=False)
        ids = [r["id"] for r in rows if r["completed"] is None]
        if ids:

            def go() -> dict[str, dict[str, int]]:
                with self._engine.connect() as c:
                    return self._counts(c, ids)

            counts = await self._store.run(go)
            for r in rows:
                r["counts"] = counts.get(r["id"], {})
        return rows, more

    async def cancel(self, tenant: str, batch_id: str, now: float) -> dict[str, Any]:
        """in_progress / validating -> cancelling (runners stop leasing its lines); a batch
        already finished or cancelling is returned as it is."""

        def go() -> bool:
            with self._engine.begin() as c:
                res = c.execute(
                    batches_table.update()
                    .where(
                        batches_table.c.id == batch_id,
                        batches_table.c.tenant == tenant,
                        batches_table.c.status.in_(("validating", "in_progress")),
                    )
                    .values(status="cancelling", cancelling_at=now)
                )
                return res.rowcount > 0

        await self._store.run(go)
        return await self.get_batch(tenant, batch_id)

    # -- the runner's side -----------------------------------------------------------------

    async def runnable(self, now: float) -> list[dict[str, Any]]:
        """Batches with lines to lease now (in progress, inside their window)."""

        def go() -> list[dict[str, Any]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(
                        batches_table.c.id,
                        batches_table.c.tenant,
                        batches_table.c.key_id,
                        batches_table.c.model,
                        batches_table.c.endpoint,
                        batches_table.c.metadata,
                        batches_table.c.created_at,
                    )
                    .where(batches_table.c.status == "in_progress", batches_table.c.expires_at > now)
                    .order_by(batches_table.c.created_at)
                ).all()
            return [dict(r._mapping) for r in rows]

        return await self._store.run(go)

    async def batch_states(self, ids: set[str]) -> dict[str, tuple[str, float]]:
        """(status, expires_at) of these batches (one query, no line counts: the runner asks
        every maintenance round whether to abandon the lines it holds)."""

        def go() -> dict[str, tuple[str, float]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(batches_table.c.id, batches_table.c.status, batches_table.c.expires_at).where(
                        batches_table.c.id.in_(sorted(ids))
                    )
                ).all()
            return {r[0]: (r[1], r[2]) for r in rows}

        return await self._store.run(go)

    async def lease(self, batch_id: str, owner: str, n: int, now: float, lease_s: float) -> list[Lease]:
        def go() -> list[Lease]:
            with self._engine.begin() as c:
                q = (
                    sa.select(lines_table.c.line_no)
                    .where(
                        lines_table.c.batch_id == batch_id,
                        sa.or_(
                            lines_table.c.state == "pending",
                            sa.and_(lines_table.c.state == "leased", lines_table.c.lease_until < now),
                        ),
                        lines_table.c.next_at <= now,
                    )
                    .order_by(lines_table.c.line_no)
                    .limit(n)
                )
                if self._pg:
                    q = q.with_for_update(skip_locked=True)
                nos = [r[0] for r in c.execute(q).all()]
                if not nos:
                    return []
                c.execute(
                    lines_table.update()
                    .where(lines_table.c.batch_id == batch_id, lines_table.c.line_no.in_(nos))
                    .values(
                        state="leased",
                        owner=owner,
                        lease_until=now + lease_s,
                        attempt=lines_table.c.attempt + 1,
                    )
                )
                rows = c.execute(
                    sa.select(
                        lines_table.c.line_no,
                        lines_table.c.custom_id,
                        lines_table.c.body,
                        lines_table.c.attempt,
                        lines_table.c.queued_at,
                    ).where(lines_table.c.batch_id == batch_id, lines_table.c.line_no.in_(nos))
                ).all()
            return [Lease(batch_id, r[0], r[1], json.loads(r[2]), r[3], r[4]) for r in rows]

        return await self._store.run(go)

    async def renew(self, owner: str, until: float) -> None:
        def go() -> None:
            with self._engine.begin() as c:
                c.execute(
                    lines_table.update()
                    .where(lines_table.c.owner == owner, lines_table.c.state == "leased")
                    .values(lease_until=until)
                )

        await self._store.run(go)

    async def settle(
        self, lease: Lease, owner: str, state: str, result: str | None, next_at: float = 0.0
    ) -> bool:
        """Commit a leased line's outcome: `done` / `failed` with its output line, or back to
        `pending` (retry at `next_at`). False when the lease is no longer ours."""
        (ours,) = await self.settle_many(owner, [(lease, state, result, next_at)])
        return ours

    async def settle_many(
        self,
        owner: str,
        outcomes: list[tuple[Lease, str, str | None, float]],
        tokens: dict[str, int] | None = None,
        now: float = 0.0,
    ) -> list[bool]:
        """`settle` for many lines in one transaction (the runner commits its answers in groups:
        one write per group, not per line); per line, whether the lease was still ours.
        `tokens`: batch tokens per tenant the answers used, added to the minute of `now` in the
        same transaction (see `token_use`)."""

        def go() -> list[bool]:
            out = []
            with self._engine.begin() as c:
                for lease, state, result, next_at in outcomes:
                    res = c.execute(
                        lines_table.update()
                        .where(
                            lines_table.c.batch_id == lease.batch_id,
                            lines_table.c.line_no == lease.line_no,
                            lines_table.c.state == "leased",
                            lines_table.c.owner == owner,
                            lines_table.c.attempt == lease.attempt,
                        )
                        .values(
                            state=state,
                            result=result,
                            next_at=next_at,
                            owner=None if state == "pending" else owner,
                        )
                    )
                    out.append(res.rowcount > 0)
                if tokens:
                    # Last: every replica's answers for the tenant add to this one row, held
                    # locked from here to the commit only.
                    self._add_tokens(c, tokens, int(now // 60))
            return out

        return await self._store.run(go)

    async def to_finalize(self, now: float) -> list[dict[str, Any]]:
        """Batches ready for their files: in progress with every line done or failed,
        cancelling, or past their window; not being finalized by a live runner."""

        def go() -> list[dict[str, Any]]:
            with self._engine.connect() as c:
                open_lines = (
                    sa.select(sa.literal(1))
                    .where(
                        lines_table.c.batch_id == batches_table.c.id,
                        lines_table.c.state.in_(("pending", "leased")),
                    )
                    .exists()
                )
                rows = c.execute(
                    sa.select(batches_table.c.id, batches_table.c.status, batches_table.c.expires_at).where(
                        batches_table.c.status.in_(("in_progress", "finalizing", "cancelling")),
                        sa.or_(
                            batches_table.c.finalize_until.is_(None), batches_table.c.finalize_until < now
                        ),
                        sa.or_(
                            ~open_lines,
                            batches_table.c.status == "cancelling",
                            batches_table.c.expires_at <= now,
                        ),
                    )
                ).all()
            return [dict(r._mapping) for r in rows]

        return await self._store.run(go)

    async def begin_finalize(
        self, batch_id: str, owner: str, now: float, lease_s: float, line_error: dict[str, dict[str, str]]
    ) -> str | None:
        """Take the batch's finalize lease and close its open lines; the final status
        ('completed', 'cancelled', 'expired'), or None when it is not ready (a live lease on a
        line of a cancelled or expired batch: its runner abandons it first) or taken.
        `line_error[kind]`: the error object of a line closed unanswered."""

        def go() -> str | None:
            with self._engine.begin() as c:
                q = sa.select(batches_table).where(batches_table.c.id == batch_id)
                if self._pg:
                    q = q.with_for_update()
                row = c.execute(q).first()
                if row is None:
                    return None
                b = row._mapping
                if b["status"] not in ("in_progress", "finalizing", "cancelling"):
                    return None
                if b["finalize_until"] is not None and b["finalize_until"] >= now:
                    return None
                if b["status"] == "cancelling":
                    final = "cancelled"
                elif b["status"] == "finalizing":
                    final = "completed"
                elif b["expires_at"] <= now:
                    final = "expired"
                else:
                    final = "completed"
                # Completed: every line must have its result. Cancelled / expired: only the
                # lines some live runner holds are waited for (it abandons them shortly).
                still_open = (
                    lines_table.c.state.in_(("pending", "leased"))
                    if final == "completed"
                    else sa.and_(lines_table.c.state == "leased", lines_table.c.lease_until >= now)
                )
                live = c.execute(
                    sa.select(sa.func.count()).where(lines_table.c.batch_id == batch_id, still_open)
                ).scalar_one()
                if live:
                    return None
                if final != "completed":
                    error = line_error[final]
                    opened = c.execute(
                        sa.select(lines_table.c.line_no, lines_table.c.custom_id).where(
                            lines_table.c.batch_id == batch_id, lines_table.c.state.in_(("pending", "leased"))
                        )
                    ).all()
                    for line_no, custom_id in opened:
                        c.execute(
                            lines_table.update()
                            .where(lines_table.c.batch_id == batch_id, lines_table.c.line_no == line_no)
                            .values(
                                state="failed",
                                owner=None,
                                result=error_line(batch_id, line_no, custom_id, error),
                            )
                        )
                values: dict[str, Any] = {"finalize_owner": owner, "finalize_until": now + lease_s}
                if final == "completed":
                    values["status"] = "finalizing"
                    values["finalizing_at"] = b["finalizing_at"] or now
                c.execute(batches_table.update().where(batches_table.c.id == batch_id).values(**values))
                return final

        return await self._store.run(go)

    async def renew_finalize(self, batch_id: str, owner: str, until: float) -> bool:
        """Extend the finalize lease `owner` holds on the batch; False when it holds none (it
        lapsed and another runner took the batch, or the batch was published)."""

        def go() -> bool:
            with self._engine.begin() as c:
                res = c.execute(
                    batches_table.update()
                    .where(
                        batches_table.c.id == batch_id,
                        batches_table.c.finalize_owner == owner,
                        batches_table.c.finalize_until.is_not(None),
                    )
                    .values(finalize_until=until)
                )
                return bool(res.rowcount)

        return await self._store.run(go)

    # -- output chunks ---------------------------------------------------------------------

    async def unchunked(self, batch_id: str, limit: int) -> list[tuple[int, str, str]]:
        """(line_no, state, output line) of up to `limit` settled lines whose output is in no
        committed chunk yet, in input order."""

        def go() -> list[tuple[int, str, str]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(lines_table.c.line_no, lines_table.c.state, lines_table.c.result)
                    .where(
                        lines_table.c.batch_id == batch_id,
                        lines_table.c.state.in_(SETTLED),
                        lines_table.c.result.is_not(None),
                    )
                    .order_by(lines_table.c.line_no)
                    .limit(limit)
                ).all()
            return [(r[0], r[1], r[2]) for r in rows]

        return await self._store.run(go)

    async def commit_chunk(self, batch_id: str, chunk: Chunk, line_nos: list[int], now: float) -> bool:
        """Record `chunk` in the manifest and take its lines' results out of their rows, in one
        transaction; False (nothing changed) when any of the lines no longer holds its result
        (another runner chunked it first): the caller deletes its object."""

        def go() -> None:
            with self._engine.begin() as c:
                taken = 0
                for i in range(0, len(line_nos), _INSERT_CHUNK):
                    part = line_nos[i : i + _INSERT_CHUNK]
                    taken += c.execute(
                        lines_table.update()
                        .where(
                            lines_table.c.batch_id == batch_id,
                            lines_table.c.line_no.in_(part),
                            lines_table.c.state.in_(SETTLED),
                            lines_table.c.result.is_not(None),
                        )
                        .values(result=None)
                    ).rowcount
                if taken != len(line_nos):
                    raise _Conflict
                c.execute(
                    chunks_table.insert().values(
                        batch_id=batch_id,
                        chunk_id=chunk.chunk_id,
                        object_key=chunk.object_key,
                        created_at=now,
                        out_lines=chunk.out_lines,
                        out_bytes=chunk.out_bytes,
                        err_lines=chunk.err_lines,
                        err_bytes=chunk.err_bytes,
                    )
                )

        try:
            await self._store.run(go)
        except _Conflict:
            return False
        return True

    async def chunks(self, batch_id: str) -> list[Chunk]:
        """The batch's committed chunks, oldest first."""

        def go() -> list[Chunk]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(
                        chunks_table.c.chunk_id,
                        chunks_table.c.object_key,
                        chunks_table.c.out_lines,
                        chunks_table.c.out_bytes,
                        chunks_table.c.err_lines,
                        chunks_table.c.err_bytes,
                    )
                    .where(chunks_table.c.batch_id == batch_id)
                    .order_by(chunks_table.c.created_at, chunks_table.c.chunk_id)
                ).all()
            return [Chunk(*r) for r in rows]

        return await self._store.run(go)

    async def finish(
        self,
        batch_id: str,
        owner: str,
        final: str,
        now: float,
        files: list[dict[str, Any]],
        output_file_id: str | None,
        error_file_id: str | None,
        completed: int,
        failed: int,
        files_expire_at: float | None = None,
    ) -> bool:
        """Publish the files (deleted at `files_expire_at`, if given) and the final status, if
        the finalize lease is still ours."""

        def go() -> bool:
            with self._engine.begin() as c:
                res = c.execute(
                    batches_table.update()
                    .where(batches_table.c.id == batch_id, batches_table.c.finalize_owner == owner)
                    .where(batches_table.c.status.in_(("finalizing", "cancelling", "in_progress")))
                    .values(
                        status=final,
                        output_file_id=output_file_id,
                        error_file_id=error_file_id,
                        completed=completed,
                        failed=failed,
                        finalize_until=None,
                        **{f"{final}_at": now},
                    )
                )
                if res.rowcount == 0:
                    return False
                unchunked = c.execute(
                    sa.select(sa.func.count()).where(
                        lines_table.c.batch_id == batch_id,
                        sa.or_(
                            lines_table.c.state.in_(("pending", "leased")),
                            lines_table.c.result.is_not(None),
                        ),
                    )
                ).scalar_one()
                if unchunked:
                    raise _Conflict  # a line was reopened or rechunked since: not published
                c.execute(chunks_table.delete().where(chunks_table.c.batch_id == batch_id))
                for f in files:
                    c.execute(files_table.delete().where(files_table.c.id == f["id"]))
                    c.execute(files_table.insert().values(**f))
                    c.execute(file_expiry_table.delete().where(file_expiry_table.c.id == f["id"]))
                    if files_expire_at is not None:
                        c.execute(file_expiry_table.insert().values(id=f["id"], expires_at=files_expire_at))
                return True

        try:
            return await self._store.run(go)
        except _Conflict:
            return False

    # -- the tenant token share, over every replica -------------------------------------------

    def _add_tokens(self, c: sa.Connection, tokens: dict[str, int], minute: int) -> None:
        rows = [{"tenant": t, "minute": minute, "tokens": n} for t, n in sorted(tokens.items()) if n > 0]
        if not rows:
            return
        if self._pg:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            pq = pg_insert(token_use_table)
            c.execute(
                pq.on_conflict_do_update(
                    index_elements=["tenant", "minute"],
                    set_={"tokens": token_use_table.c.tokens + pq.excluded.tokens},
                ),
                rows,
            )
            return
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        sq = sqlite_insert(token_use_table)
        c.execute(
            sq.on_conflict_do_update(
                index_elements=["tenant", "minute"],
                set_={"tokens": token_use_table.c.tokens + sq.excluded.tokens},
            ),
            rows,
        )

    async def token_use(self, now: float) -> dict[str, float]:
        """Each tenant's batch tokens over the last minute, all replicas together: this minute's
        count plus the previous minute's, weighted by the part of it still inside the window."""
        minute = int(now // 60)
        weight = 1.0 - (now - minute * 60) / 60

        def go() -> dict[str, float]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(
                        token_use_table.c.tenant, token_use_table.c.minute, token_use_table.c.tokens
                    ).where(token_use_table.c.minute >= minute - 1)
                ).all()
            out: dict[str, float] = {}
            for tenant, m, n in rows:
                out[tenant] = out.get(tenant, 0.0) + (n if m >= minute else n * weight)
            return out

        return await self._store.run(go)

    # -- retention -------------------------------------------------------------------------

    async def retired(self, cutoff: float, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` finished batches that finished before `cutoff`, with the object keys
        of their output and error files (`keys`)."""
        finished_at = sa.func.coalesce(
            batches_table.c.completed_at, batches_table.c.cancelled_at, batches_table.c.expired_at
        )

        def go() -> list[dict[str, Any]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(
                        batches_table.c.id, batches_table.c.output_file_id, batches_table.c.error_file_id
                    )
                    .where(batches_table.c.status.in_(FINISHED), finished_at < cutoff)
                    .order_by(finished_at)
                    .limit(limit)
                ).all()
                out = []
                for batch_id, output_id, error_id in rows:
                    ids = [i for i in (output_id, error_id) if i]
                    keys = (
                        [
                            r[0]
                            for r in c.execute(
                                sa.select(files_table.c.object_key).where(files_table.c.id.in_(ids))
                            )
                        ]
                        if ids
                        else []
                    )
                    out.append({"id": batch_id, "file_ids": ids, "keys": keys})
            return out

        return await self._store.run(go)

    async def delete_batch(self, batch_id: str, file_ids: list[str]) -> bool:
        """Delete a retired batch's rows: lines, chunks, its output/error files, the batch.
        Idempotent; on PostgreSQL a batch another replica is deleting is skipped (SKIP LOCKED)."""

        def go() -> bool:
            with self._engine.begin() as c:
                q = sa.select(batches_table.c.id).where(
                    batches_table.c.id == batch_id, batches_table.c.status.in_(FINISHED)
                )
                if self._pg:
                    q = q.with_for_update(skip_locked=True)
                if c.execute(q).first() is None:
                    return False
                c.execute(lines_table.delete().where(lines_table.c.batch_id == batch_id))
                c.execute(chunks_table.delete().where(chunks_table.c.batch_id == batch_id))
                if file_ids:
                    # Expiry rows before file rows, in the order delete_expired_file takes them:
                    # a replica expiring the same output file at once then waits instead of
                    # deadlocking (PostgreSQL aborted one of the two).
                    c.execute(file_expiry_table.delete().where(file_expiry_table.c.id.in_(file_ids)))
                    c.execute(files_table.delete().where(files_table.c.id.in_(file_ids)))
                c.execute(batches_table.delete().where(batches_table.c.id == batch_id))
                return True

        return await self._store.run(go)

    async def expired_files(self, now: float, limit: int) -> list[tuple[str, str]]:
        """(id, object key) of up to `limit` files past their expiry."""

        def go() -> list[tuple[str, str]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(files_table.c.id, files_table.c.object_key)
                    .select_from(
                        files_table.join(file_expiry_table, file_expiry_table.c.id == files_table.c.id)
                    )
                    .where(file_expiry_table.c.expires_at < now)
                    .order_by(file_expiry_table.c.expires_at)
                    .limit(limit)
                ).all()
            return [(r[0], r[1]) for r in rows]

        return await self._store.run(go)

    async def delete_expired_file(self, file_id: str, now: float) -> bool:
        """Delete an expired file's rows (idempotent: False when already gone)."""

        def go() -> bool:
            with self._engine.begin() as c:
                gone = c.execute(
                    file_expiry_table.delete().where(
                        file_expiry_table.c.id == file_id, file_expiry_table.c.expires_at < now
                    )
                ).rowcount
                if gone:
                    c.execute(files_table.delete().where(files_table.c.id == file_id))
                return gone > 0

        return await self._store.run(go)

    async def prune_token_use(self, now: float) -> None:
        def go() -> None:
            with self._engine.begin() as c:
                c.execute(token_use_table.delete().where(token_use_table.c.minute < int(now // 60) - 2))

        await self._store.run(go)

    async def line_stats(self) -> list[tuple[str, str, str, int, float | None]]:
        """(tenant, model, state, lines, oldest queued_at) over active batches: the metrics."""

        def go() -> list[tuple[str, str, str, int, float | None]]:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(
                        batches_table.c.tenant,
                        batches_table.c.model,
                        lines_table.c.state,
                        sa.func.count(),
                        sa.func.min(lines_table.c.queued_at),
                    )
                    .select_from(
                        lines_table.join(batches_table, batches_table.c.id == lines_table.c.batch_id)
                    )
                    .where(batches_table.c.status.in_(ACTIVE))
                    .group_by(batches_table.c.tenant, batches_table.c.model, lines_table.c.state)
                ).all()
            return [(r[0], r[1], r[2], int(r[3]), r[4]) for r in rows]

        return await self._store.run(go)


def output_line(batch_id: str, line_no: int, custom_id: str, status: int, request_id: str, body: Any) -> str:
    """One line of an output or error file for a request that got an answer (OpenAI's format)."""
    return json.dumps(
        {
            "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )


def error_line(batch_id: str, line_no: int, custom_id: str, error: dict[str, str]) -> str:
    """One line of the error file for a request that got no answer (cancelled, expired)."""
    return json.dumps(
        {
            "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}",
            "custom_id": custom_id,
            "response": None,
            "error": error,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )
