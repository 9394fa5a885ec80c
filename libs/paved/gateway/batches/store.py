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
- A batch is finalized by one runner at a time (a finalize lease on the batch row); the files
  it writes are derived from committed line rows only, with ids fixed by the batch id, so a
  finalization redone after a crash writes the same files.
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

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
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

    async def add_file(self, row: dict[str, Any]) -> None:
        def go() -> None:
            with self._engine.begin() as c:
                c.execute(files_table.insert().values(**row))

        await self._store.run(go)

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        def go() -> dict[str, Any] | None:
            with self._engine.connect() as c:
                row = c.execute(
                    sa.select(files_table).where(files_table.c.id == file_id, files_table.c.tenant == tenant)
                ).first()
            return dict(row._mapping) if row is not None else None

        found = await self._store.run(go)
        if found is None:
            raise _not_found("file", file_id)
        return found

    async def list_files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        return await self._page(files_table, tenant, after, limit, ascending, purpose=purpose)

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        def go() -> dict[str, Any] | None:
            with self._engine.begin() as c:
                row = c.execute(
                    sa.select(files_table).where(files_table.c.id == file_id, files_table.c.tenant == tenant)
                ).first()
                if row is None:
                    return None
                c.execute(files_table.delete().where(files_table.c.id == file_id))
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

    async def create_batch(self, row: dict[str, Any], lines: Iterator[tuple[str, str]]) -> None:
        """Insert the batch and all its lines in one transaction: a batch is visible only with
        every line queued (a crash mid-insert leaves nothing)."""
        now = row["created_at"]

        def go() -> None:
            with self._engine.begin() as c:
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
        self, owner: str, outcomes: list[tuple[Lease, str, str | None, float]]
    ) -> list[bool]:
        """`settle` for many lines in one transaction (the runner commits its answers in groups:
        one write per group, not per line); per line, whether the lease was still ours."""

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

    def results(self, batch_id: str) -> Iterator[tuple[str, str]]:
        """(state, output line) of every line, in input order, read in pages (blocking: call
        from a worker thread)."""
        last = -1
        while True:
            with self._engine.connect() as c:
                rows = c.execute(
                    sa.select(lines_table.c.line_no, lines_table.c.state, lines_table.c.result)
                    .where(lines_table.c.batch_id == batch_id, lines_table.c.line_no > last)
                    .order_by(lines_table.c.line_no)
                    .limit(2000)
                ).all()
            if not rows:
                return
            for line_no, state, result in rows:
                last = line_no
                yield state, result or ""

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
    ) -> bool:
        """Publish the files and the final status, if the finalize lease is still ours."""

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
                for f in files:
                    c.execute(files_table.delete().where(files_table.c.id == f["id"]))
                    c.execute(files_table.insert().values(**f))
                return True

        return await self._store.run(go)

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
