"""The routes feed: the control plane publishes gateway routes tables, gateways long-poll them.

`RoutesFeed.publish` validates a table with the gateway's own parser (a table the gateway would
reject never reaches the store) and stores its normalised form; `wait` answers a gateway's
"anything newer than revision N?" at once, or when a table is published, or after timeout_s.

Invariants:
- revisions are the store's: monotonic, and publishing content equal to the latest returns the
  latest revision (no new row, no wake-up), so a controller may republish freely;
- `wait(after)` returns only a revision > after (or None), never an older table;
- a table published by another control-plane replica on the same store is seen within
  `poll_s` (each feed re-reads the store at most once per poll_s however many gateways wait:
  one read in flight at a time, shared by every waiter).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paved.control_plane.errors import BadRequest, ControlError
from paved.gateway.routing.routes import RoutesError, parse_routes
from paved.http.errors import error_body

# A gateway's long poll is bounded so a stuck connection is noticed and load balancers in
# between (idle timeouts of ~60 s are common) do not cut it first.
MAX_WAIT_S = 55.0
MAX_REVISION = 2**63 - 1


class RoutesStore(Protocol):
    """The part of ControlStore the feed uses."""

    async def publish_routes(self, table: dict[str, Any]) -> int: ...

    async def latest_routes(self) -> tuple[int, dict[str, Any]] | None: ...


class RoutesFeed:
    def __init__(
        self, store: RoutesStore, *, poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic
    ):
        if not (poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError("poll_s must be > 0")
        self._store = store
        self._poll = poll_s
        self._clock = clock
        self._latest: tuple[int, dict[str, Any]] | None = None
        # Set (and replaced) whenever `_latest` moves forward: waiters hold the event of the
        # moment they checked, so a publish between their check and their wait still wakes them.
        self._changed = asyncio.Event()
        self._read: asyncio.Task[None] | None = None
        self._read_at: float | None = None

    @property
    def latest_revision(self) -> int | None:
        """The newest revision this feed has seen (None before any)."""
        return self._latest[0] if self._latest is not None else None

    async def publish(self, table: dict[str, Any]) -> int:
        """Validate and store `table` (the routes file form); returns its revision. BadRequest
        (400) names the offending field; the store's errors (503 when it is down) pass through."""
        try:
            parsed = parse_routes(table)
        except RoutesError as e:
            raise BadRequest(f"routes table rejected: {e}", code="invalid_routes") from None
        normalised = parsed.to_obj()
        revision = await self._store.publish_routes(normalised)
        self._advance(revision, normalised)
        return revision

    async def wait(self, after: int, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
        """The latest (revision, table) if its revision > `after`, waiting up to `timeout_s`
        (0..MAX_WAIT_S) for one; None when nothing newer came."""
        if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= MAX_REVISION:
            raise BadRequest(f"after must be an integer in 0..{MAX_REVISION}", code="invalid_after")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not 0 <= timeout_s <= MAX_WAIT_S  # NaN fails this too
        ):
            raise BadRequest(f"timeout_s must be a number in 0..{MAX_WAIT_S:g}", code="invalid_timeout")
        deadline = self._clock() + timeout_s
        while True:
            changed = self._changed
            if self._latest is not None and self._latest[0] > after:
                return self._latest
            await self._refresh()
            if self._latest is not None and self._latest[0] > after:
                return self._latest
            remaining = deadline - self._clock()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, self._poll))

    async def _refresh(self) -> None:
        """Re-read the store unless it was read less than poll_s ago; concurrent callers share
        one read (the task is shielded so a waiter that gives up does not cancel the others')."""
        now = self._clock()
        if self._read is None and self._read_at is not None and now - self._read_at < self._poll:
            return
        if self._read is None:
            self._read = asyncio.ensure_future(self._read_store())
        task = self._read
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._read is task:
                self._read = None

    async def _read_store(self) -> None:
        try:
            latest = await self._store.latest_routes()
        finally:
            # A failed read also waits poll_s before the next: a down database is not hammered.
            self._read_at = self._clock()
        if latest is not None:
            self._advance(*latest)

    def _advance(self, revision: int, table: dict[str, Any]) -> None:
        if self._latest is not None and revision <= self._latest[0]:
            return
        self._latest = (revision, table)
        event, self._changed = self._changed, asyncio.Event()
        event.set()


def _error(e: ControlError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, None, e.code), e.status, headers=e.headers or None)


def _query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or len(raw) > 19:
        raise BadRequest(f"{name} must be a non-negative integer, got {raw[:40]!r}", code=f"invalid_{name}")
    return int(raw)


def _query_float(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw) if len(raw) <= 32 else math.nan
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_WAIT_S:
        raise BadRequest(
            f"{name} must be a number in 0..{MAX_WAIT_S:g}, got {raw[:40]!r}", code="invalid_timeout"
        )
    return value


def routes_api(feed: RoutesFeed, check_auth: Callable[[str | None], None]) -> APIRouter:
    """`GET /v1/routes?after=N&timeout_s=T`: 200 `{"revision": N, "table": {...}}` when the
    latest revision is > after (at once, or as soon as one is published within T seconds,
    default 25), else 204. `check_auth(authorization_header)` raises ControlError to refuse;
    every error is an OpenAI-style error body with its status."""
    router = APIRouter()

    @router.get("/v1/routes")
    async def get_routes(request: Request) -> Response:
        try:
            check_auth(request.headers.get("authorization"))
            after = _query_int(request, "after", 0)
            timeout_s = _query_float(request, "timeout_s", 25.0)
            latest = await feed.wait(after, timeout_s)
        except ControlError as e:
            return _error(e)
        if latest is None:
            return Response(status_code=204)
        revision, table = latest
        return JSONResponse({"revision": revision, "table": table}, headers={"Cache-Control": "no-store"})

    return router
