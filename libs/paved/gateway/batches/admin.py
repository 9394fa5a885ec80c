"""The operators' view of every tenant's batches (read-only), for the control plane's dashboard.

    GET /admin/v1/batches[?limit=N&status=S]
        -> {"object": "list", "data": [batch row, ...], "has_more": bool, "now": UNIX seconds}

A batch row: id, tenant, model, endpoint, status, request_counts {total, completed, failed},
created_at, in_progress_at, expires_at, finished_at (completed, expired or cancelled; else
null), and age_s (seconds since it started running, for a batch still active; else null).

Invariants callers rely on:
- The admin key is checked before anything else about the request (401 without it, as every
  /admin/v1 endpoint answers), so an unauthenticated caller learns nothing about the input.
- Bounded: at most MAX_LIMIT batches per answer (newest first, by created_at then id), and
  the line counts are read only for the batches of the answer that are not finished (a finished
  batch carries its final counts on its row). `limit` out of 1..MAX_LIMIT, or a `status` that
  no batch can have, is a 400 with an OpenAI-style error body.
- Read-only, and its own SQL over the tables paved.gateway.batches.store owns: nothing here
  takes a lease or changes a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from paved.gateway.access.auth import AdminAuth
from paved.gateway.access.state import GatewayStore
from paved.gateway.batches.api import _limit, _ts
from paved.gateway.batches.store import ACTIVE, batches_table, lines_table
from paved.gateway.errors import GatewayError

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
# Every status a batch row can hold (OpenAI's), plus "active": any of store.ACTIVE.
STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
_FINISHED_AT = ("completed_at", "expired_at", "cancelled_at")


def admin_batch_routes(
    accounts: GatewayStore, admin: AdminAuth, clock: Callable[[], float] = time.time
) -> list[Route]:
    """The route above, over the gateway's database (`accounts`, the one BatchStore uses)."""
    engine = accounts.engine

    def read(status: tuple[str, ...] | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        with engine.connect() as c:
            q = sa.select(batches_table)
            if status is not None:
                q = q.where(batches_table.c.status.in_(status))
            rows = [
                dict(r._mapping)
                for r in c.execute(
                    q.order_by(batches_table.c.created_at.desc(), batches_table.c.id.desc()).limit(limit + 1)
                ).all()
            ]
            more = len(rows) > limit
            rows = rows[:limit]
            open_ids = [r["id"] for r in rows if r["completed"] is None]
            counts: dict[str, dict[str, int]] = {}
            if open_ids:
                for batch_id, state, n in c.execute(
                    sa.select(lines_table.c.batch_id, lines_table.c.state, sa.func.count())
                    .where(lines_table.c.batch_id.in_(open_ids))
                    .group_by(lines_table.c.batch_id, lines_table.c.state)
                ).all():
                    counts.setdefault(batch_id, {})[state] = int(n)
        for r in rows:
            if r["completed"] is None:
                by_state = counts.get(r["id"], {})
                r["completed"], r["failed"] = by_state.get("done", 0), by_state.get("failed", 0)
        return rows, more

    async def list_batches(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        q = request.query_params
        limit = _limit(q.get("limit"), default=DEFAULT_LIMIT, most=MAX_LIMIT)
        raw = q.get("status")
        status: tuple[str, ...] | None = None
        if raw is not None:
            if raw == "active":
                status = ACTIVE
            elif raw in STATUSES:
                status = (raw,)
            else:
                raise GatewayError(
                    400, "status must be one of: active, " + ", ".join(STATUSES), param="status"
                )
        rows, more = await accounts.run(read, status, limit)
        now = clock()
        return JSONResponse(
            {"object": "list", "data": [_row(r, now) for r in rows], "has_more": more, "now": now}
        )

    return [Route("/admin/v1/batches", list_batches, methods=["GET"])]


def _row(r: dict[str, Any], now: float) -> dict[str, Any]:
    started = r["in_progress_at"] if r["in_progress_at"] is not None else r["created_at"]
    finished = next((r[k] for k in _FINISHED_AT if r[k] is not None), None)
    return {
        "id": r["id"],
        "object": "batch",
        "tenant": r["tenant"],
        "model": r["model"],
        "endpoint": r["endpoint"],
        "status": r["status"],
        "request_counts": {"total": r["total"], "completed": r["completed"], "failed": r["failed"]},
        "created_at": _ts(r["created_at"]),
        "in_progress_at": _ts(r["in_progress_at"]),
        "expires_at": _ts(r["expires_at"]),
        "finished_at": _ts(finished),
        "age_s": max(0.0, now - started) if r["status"] in ACTIVE else None,
    }
