"""Stored responses: the Responses API's objects in the gateway's database, so any replica
answers for them, also after a restart.

Invariants:
- A response is read, cancelled or deleted only by its tenant; another tenant's id, an expired
  one and an unknown one are the same None (the caller answers one 404).
- A response in `queued` / `in_progress` is held by one writer's lease (`owner`,
  `lease_until`), renewed while it generates; only the owner renews, moves or finishes it. The
  owner names the replica and the writer's epoch (its claim's number, 0 for the creator), so a
  replica that claims a response it was itself still writing (stalled past the lease) does not
  let the stalled writer pass for the new one. A
  background response keeps its job (`gateway_response_jobs`: the key id it runs for, the
  request, the chat body, the passed headers) while active: when its lease lapses (the replica
  died) `sweep` hands it to exactly one live replica (a conditional update claims it), which
  continues it; after `max_takeovers` claims it ends `failed` instead. A lapsed response
  without a job (not background: its client's connection died with the replica) ends `failed`.
- At most `max_per_tenant` responses per tenant are kept (the oldest finished ones go first)
  and each expires `retention_s` after it was created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from paved.gateway.access.auth import live_principal
from paved.gateway.access.state import GatewayStore
from paved.gateway.types import Principal

ACTIVE = ("queued", "in_progress")
LEASE_LOST = "the gateway replica generating this response stopped before it finished"
TAKEOVERS_SPENT = (
    "the gateway replicas generating this response stopped {n} times; it was not continued again"
)

_metadata = sa.MetaData()
responses_table = sa.Table(
    "gateway_responses",
    _metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(63), nullable=False, index=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("lease_until", sa.Float, nullable=False),
    sa.Column("streamed", sa.Boolean, nullable=False),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("input_items", sa.JSON, nullable=False),
    sa.Column("messages", sa.JSON, nullable=False),
)
# A separate table (not columns of the one above): a database made before takeovers existed
# gains it through create_tables, with no migration.
jobs_table = sa.Table(
    "gateway_response_jobs",
    _metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("takeovers", sa.Integer, nullable=False),
    sa.Column("job", sa.JSON, nullable=False),
)


@dataclass(frozen=True)
class StoreBounds:
    max_per_tenant: int = 10_000
    retention_s: float = 30 * 24 * 3600.0
    lease_s: float = 15.0


@dataclass
class Claimed:
    """A background response this replica now holds the lease of, to continue it: `job` is
    what `create` stored (key_id, request, chat, headers, base), `takeovers` counts this one."""

    id: str
    tenant: str
    body: dict[str, Any]
    job: dict[str, Any]
    takeovers: int


@dataclass
class StoredResponse:
    id: str
    tenant: str
    status: str
    streamed: bool
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    lease_until: float = 0.0

    @property
    def lapsed(self) -> bool:
        """Active with a lease that lapsed: its replica stopped (a sweep hands it over)."""
        return self.status in ACTIVE and self.lease_until < time.time()


def _row(row: Any) -> StoredResponse:
    return StoredResponse(
        id=row.id, tenant=row.tenant, status=row.status, streamed=bool(row.streamed), body=row.body,
        input_items=row.input_items, messages=row.messages, lease_until=row.lease_until,
    )  # fmt: skip


def failed_body(body: dict[str, Any], message: str = LEASE_LOST) -> dict[str, Any]:
    """A response object ended `failed` with a server_error saying `message`."""
    return {**body, "status": "failed", "error": {"code": "server_error", "message": message}}


class ResponseStore:
    def __init__(self, store: GatewayStore, bounds: StoreBounds, owner: str):
        self._store = store
        self.bounds = bounds
        self.owner = owner

    def _owner(self, epoch: int) -> str:
        """The lease owner of this replica's writer at `epoch` (the creator's is the plain
        replica name, as rows written before epochs existed hold)."""
        return self.owner if epoch == 0 else f"{self.owner}#{epoch}"

    async def start(self) -> None:
        await self._store.create_tables(_metadata)

    async def create(
        self,
        tenant: str,
        body: dict[str, Any],
        items: list[dict[str, Any]],
        streamed: bool,
        job: dict[str, Any] | None = None,
    ) -> None:
        """Store a new response, leased to this replica; `job` (background responses): what
        another replica needs to continue it if this one dies."""
        await self._store.run(self._create_sync, tenant, body, items, streamed, job)

    def _create_sync(
        self,
        tenant: str,
        body: dict[str, Any],
        items: list[dict[str, Any]],
        streamed: bool,
        job: dict[str, Any] | None,
    ) -> None:
        t = responses_table
        now = time.time()
        with self._store.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.expires_at < now))
            over = list(
                conn.execute(
                    sa.select(t.c.id)
                    .where(t.c.tenant == tenant, t.c.status.not_in(ACTIVE))
                    .order_by(t.c.created_at.desc())
                    .offset(self.bounds.max_per_tenant - 1)
                )
            )
            if over:
                conn.execute(t.delete().where(t.c.id.in_([r[0] for r in over])))
            if job is not None:
                conn.execute(jobs_table.insert().values(id=body["id"], takeovers=0, job=job))
            conn.execute(
                t.insert().values(
                    id=body["id"], tenant=tenant, status=body["status"], created_at=now,
                    expires_at=now + self.bounds.retention_s, owner=self.owner,
                    lease_until=now + self.bounds.lease_s, streamed=streamed, body=body, input_items=items,
                    messages=[],
                )
            )  # fmt: skip

    async def principal(self, key_id: str) -> Principal | None:
        """Who a takeover runs as: the key that created the response, while it is neither
        revoked nor expired (else None)."""
        return await live_principal(self._store, key_id, time.time())

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._store.run(self._get_sync, tenant, response_id)

    async def writing(self, stream_id: str) -> bool:
        """Whether a replica holds a live lease on the response of this stream id (a response's
        stream is named by its id): its writer is alive, however long it has been silent
        (a reasoning model thinking, a takeover waking its model). False for any other id."""
        return await self._store.run(self._writing_sync, stream_id)

    def _writing_sync(self, stream_id: str) -> bool:
        t = responses_table
        with self._store.engine.connect() as conn:
            row = conn.execute(sa.select(t.c.status, t.c.lease_until).where(t.c.id == stream_id)).first()
        return row is not None and row.status in ACTIVE and row.lease_until >= time.time()

    def _get_sync(self, tenant: str, response_id: str) -> StoredResponse | None:
        t = responses_table
        now = time.time()
        with self._store.engine.begin() as conn:
            row = conn.execute(
                sa.select(t).where(t.c.id == response_id, t.c.tenant == tenant, t.c.expires_at >= now)
            ).first()
            if row is None:
                return None
            found = _row(row)
            if row.status in ACTIVE and row.lease_until < now:
                has_job = conn.execute(
                    sa.select(jobs_table.c.id).where(jobs_table.c.id == response_id)
                ).first()
                if has_job is None:
                    found.body, found.status = failed_body(row.body), "failed"
                    conn.execute(
                        t.update()
                        .where(t.c.id == response_id, t.c.status.in_(ACTIVE), t.c.lease_until < now)
                        .values(status="failed", body=found.body)
                    )
            return found

    async def set_status(self, response_id: str, status: str, body: dict[str, Any], epoch: int = 0) -> bool:
        """Move an active response to `status` (only while it is still active and ours)."""
        return await self._store.run(self._set_sync, response_id, status, body, None, epoch)

    async def finish(
        self,
        response_id: str,
        status: str,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        epoch: int = 0,
    ) -> bool:
        """Its final status, object and conversation. Cancelled meanwhile: the status stays
        `cancelled`, and the object's output and usage are the final ones all the same (what
        the terminal event says and the tenant was charged for, not the snapshot `cancel`
        took)."""
        return await self._store.run(self._set_sync, response_id, status, body, messages, epoch)

    def _set_sync(
        self,
        response_id: str,
        status: str,
        body: dict[str, Any],
        messages: list[dict[str, Any]] | None,
        epoch: int,
    ) -> bool:
        t = responses_table
        values: dict[str, Any] = {
            "status": status,
            "body": body,
            "lease_until": time.time() + self.bounds.lease_s,
        }
        if messages is not None:
            values["messages"] = messages
        with self._store.engine.begin() as conn:
            ours = sa.and_(t.c.id == response_id, t.c.owner == self._owner(epoch))
            done = conn.execute(t.update().where(ours, t.c.status.in_(ACTIVE)).values(**values)).rowcount
            if messages is None:
                return bool(done)
            ended = done
            if not done:
                # Cancelled meanwhile: the cancellation stays, with the final output and usage.
                cancelled = {**body, "status": "cancelled", "error": None}
                was_cancelled = sa.and_(ours, t.c.status == "cancelled")
                ended = conn.execute(
                    t.update().where(was_cancelled).values(messages=messages, body=cancelled)
                ).rowcount
                # Ended otherwise meanwhile (failed): its object stays; the conversation is kept.
                ended = ended or conn.execute(t.update().where(ours).values(messages=messages)).rowcount
            if ended:  # (another owner's job stays: it is still generating)
                conn.execute(jobs_table.delete().where(jobs_table.c.id == response_id))
            return bool(done)

    async def renew(self, response_id: str, epoch: int = 0) -> str:
        """Extend our lease: "renewed"; "ended" when the response is no longer active
        (cancelled or deleted on some replica: the generation stops and ends it); "taken" when
        it lapsed and another replica took it over (the generation stops and writes nothing
        more: the new owner continues the same stream)."""
        return await self._store.run(self._renew_sync, response_id, epoch)

    def _renew_sync(self, response_id: str, epoch: int) -> str:
        t = responses_table
        with self._store.engine.begin() as conn:
            if conn.execute(
                t.update()
                .where(t.c.id == response_id, t.c.status.in_(ACTIVE), t.c.owner == self._owner(epoch))
                .values(lease_until=time.time() + self.bounds.lease_s)
            ).rowcount:
                return "renewed"
            row = conn.execute(sa.select(t.c.status, t.c.owner).where(t.c.id == response_id)).first()
        return "taken" if row is not None and row.status in ACTIVE else "ended"

    async def release(self, response_id: str, epoch: int = 0) -> bool:
        """Give up our lease at once (this replica is stopping): the next sweep of any replica
        claims the response. False when it is no longer active or ours."""
        return await self._store.run(self._release_sync, response_id, epoch)

    def _release_sync(self, response_id: str, epoch: int) -> bool:
        t = responses_table
        with self._store.engine.begin() as conn:
            return bool(
                conn.execute(
                    t.update()
                    .where(t.c.id == response_id, t.c.status.in_(ACTIVE), t.c.owner == self._owner(epoch))
                    .values(lease_until=0.0)
                ).rowcount
            )

    async def cancel(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._store.run(self._cancel_sync, tenant, response_id)

    def _cancel_sync(self, tenant: str, response_id: str) -> StoredResponse | None:
        t = responses_table
        with self._store.engine.begin() as conn:
            row = conn.execute(sa.select(t).where(t.c.id == response_id, t.c.tenant == tenant)).first()
            if row is None:
                return None
            found = _row(row)
            if row.status in ACTIVE:
                found.body, found.status = {**row.body, "status": "cancelled"}, "cancelled"
                conn.execute(
                    t.update()
                    .where(t.c.id == response_id, t.c.status.in_(ACTIVE))
                    .values(status="cancelled", body=found.body)
                )
            return found

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._store.run(self._delete_sync, tenant, response_id)

    def _delete_sync(self, tenant: str, response_id: str) -> bool:
        t = responses_table
        with self._store.engine.begin() as conn:
            gone = conn.execute(t.delete().where(t.c.id == response_id, t.c.tenant == tenant)).rowcount
            if gone:
                conn.execute(jobs_table.delete().where(jobs_table.c.id == response_id))
            return bool(gone)

    async def sweep(self, max_takeovers: int = 0) -> list[Claimed]:
        """Drop expired responses; claim for this replica every background response whose
        lease lapsed and that was taken over fewer than `max_takeovers` times (the caller
        continues each one returned); end the other lapsed ones `failed`."""
        return await self._store.run(self._sweep_sync, max_takeovers)

    def _sweep_sync(self, max_takeovers: int) -> list[Claimed]:
        t, j = responses_table, jobs_table
        now = time.time()
        claimed: list[Claimed] = []
        with self._store.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.expires_at < now))
            conn.execute(j.delete().where(j.c.id.not_in(sa.select(t.c.id))))
            rows = list(
                conn.execute(
                    sa.select(t.c.id, t.c.tenant, t.c.body, j.c.takeovers, j.c.job)
                    .select_from(t.outerjoin(j, j.c.id == t.c.id))
                    .where(t.c.status.in_(ACTIVE), t.c.lease_until < now)
                )
            )
            for row in rows:
                lapsed = sa.and_(t.c.id == row.id, t.c.status.in_(ACTIVE), t.c.lease_until < now)
                if row.job is not None and row.takeovers < max_takeovers:
                    # Conditional: of the replicas sweeping at once, exactly one claims it; the
                    # count is bumped in SQL and read back under the claim (the epoch it gives
                    # the new writer is never one an earlier writer had).
                    taking = j.update().where(j.c.id == row.id).values(takeovers=j.c.takeovers + 1)
                    if conn.execute(
                        t.update().where(lapsed).values(lease_until=now + self.bounds.lease_s)
                    ).rowcount:
                        conn.execute(taking)
                        epoch = conn.execute(sa.select(j.c.takeovers).where(j.c.id == row.id)).scalar_one()
                        conn.execute(t.update().where(t.c.id == row.id).values(owner=self._owner(epoch)))
                        claimed.append(Claimed(row.id, row.tenant, row.body, row.job, epoch))
                    continue
                spent = row.job is not None and max_takeovers > 0
                message = TAKEOVERS_SPENT.format(n=row.takeovers + 1) if spent else LEASE_LOST
                if conn.execute(
                    t.update().where(lapsed).values(status="failed", body=failed_body(row.body, message))
                ).rowcount:
                    conn.execute(j.delete().where(j.c.id == row.id))
        return claimed
