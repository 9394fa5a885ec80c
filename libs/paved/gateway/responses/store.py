"""Stored responses: the Responses API's objects in the gateway's database, so any replica
answers for them, also after a restart.

Invariants:
- A response is read, cancelled or deleted only by its tenant; another tenant's id, an expired
  one and an unknown one are the same None (the caller answers one 404).
- A response in `queued` / `in_progress` is held by one replica's lease (`owner`,
  `lease_until`), renewed while it generates. A lease that lapsed (the replica died) ends the
  response `failed` the next time any replica reads or sweeps it.
- At most `max_per_tenant` responses per tenant are kept (the oldest finished ones go first)
  and each expires `retention_s` after it was created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from paved.gateway.access.state import GatewayStore

ACTIVE = ("queued", "in_progress")
LEASE_LOST = "the gateway replica generating this response stopped before it finished"

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


@dataclass(frozen=True)
class StoreBounds:
    max_per_tenant: int = 10_000
    retention_s: float = 30 * 24 * 3600.0
    lease_s: float = 15.0


@dataclass
class StoredResponse:
    id: str
    tenant: str
    status: str
    streamed: bool
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]


def _row(row: Any) -> StoredResponse:
    return StoredResponse(
        id=row.id, tenant=row.tenant, status=row.status, streamed=bool(row.streamed), body=row.body,
        input_items=row.input_items, messages=row.messages,
    )  # fmt: skip


def _failed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "status": "failed", "error": {"code": "server_error", "message": LEASE_LOST}}


class ResponseStore:
    def __init__(self, store: GatewayStore, bounds: StoreBounds, owner: str):
        self._store = store
        self.bounds = bounds
        self.owner = owner

    async def start(self) -> None:
        await self._store.create_tables(_metadata)

    async def create(
        self, tenant: str, body: dict[str, Any], items: list[dict[str, Any]], streamed: bool
    ) -> None:
        await self._store.run(self._create_sync, tenant, body, items, streamed)

    def _create_sync(
        self, tenant: str, body: dict[str, Any], items: list[dict[str, Any]], streamed: bool
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
            conn.execute(
                t.insert().values(
                    id=body["id"], tenant=tenant, status=body["status"], created_at=now,
                    expires_at=now + self.bounds.retention_s, owner=self.owner,
                    lease_until=now + self.bounds.lease_s, streamed=streamed, body=body, input_items=items,
                    messages=[],
                )
            )  # fmt: skip

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._store.run(self._get_sync, tenant, response_id)

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
                found.body, found.status = _failed(row.body), "failed"
                conn.execute(
                    t.update()
                    .where(t.c.id == response_id, t.c.status.in_(ACTIVE), t.c.lease_until < now)
                    .values(status="failed", body=found.body)
                )
            return found

    async def set_status(self, response_id: str, status: str, body: dict[str, Any]) -> bool:
        """Move an active response to `status` (only while it is still active and ours)."""
        return await self._store.run(self._set_sync, response_id, status, body, None)

    async def finish(
        self, response_id: str, status: str, body: dict[str, Any], messages: list[dict[str, Any]]
    ) -> bool:
        """Its final status, object and conversation (kept even when cancelled meanwhile: the
        body then says so)."""
        return await self._store.run(self._set_sync, response_id, status, body, messages)

    def _set_sync(
        self, response_id: str, status: str, body: dict[str, Any], messages: list[dict[str, Any]] | None
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
            done = conn.execute(
                t.update().where(t.c.id == response_id, t.c.status.in_(ACTIVE)).values(**values)
            ).rowcount
            if not done and messages is not None:
                # Cancelled meanwhile: keep the cancellation, store what was generated.
                conn.execute(t.update().where(t.c.id == response_id).values(messages=messages))
            return bool(done)

    async def renew(self, response_id: str) -> bool:
        """Extend our lease; False when the response is no longer active (cancelled or deleted
        on some replica): the generation stops."""
        return await self._store.run(self._renew_sync, response_id)

    def _renew_sync(self, response_id: str) -> bool:
        t = responses_table
        with self._store.engine.begin() as conn:
            return bool(
                conn.execute(
                    t.update()
                    .where(t.c.id == response_id, t.c.status.in_(ACTIVE))
                    .values(lease_until=time.time() + self.bounds.lease_s, owner=self.owner)
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
            return bool(conn.execute(t.delete().where(t.c.id == response_id, t.c.tenant == tenant)).rowcount)

    async def sweep(self) -> int:
        """End every response whose lease lapsed (its replica died); drop expired ones."""
        return await self._store.run(self._sweep_sync)

    def _sweep_sync(self) -> int:
        t = responses_table
        now = time.time()
        with self._store.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.expires_at < now))
            rows = list(
                conn.execute(sa.select(t.c.id, t.c.body).where(t.c.status.in_(ACTIVE), t.c.lease_until < now))
            )
            for row in rows:
                conn.execute(
                    t.update()
                    .where(t.c.id == row.id, t.c.status.in_(ACTIVE), t.c.lease_until < now)
                    .values(status="failed", body=_failed(row.body))
                )
            return len(rows)
