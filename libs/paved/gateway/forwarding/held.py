"""Requests held for models scaled to zero, shared by every protocol the gateway forwards (the
OpenAI proxy, KServe v2 gRPC and HTTP): one queue per model (the proxy's FlowController), one
wake loop per model (one WakeCaller), one count per model (`paved_gateway_held_requests`).

While the routes table has a model `scaled_to_zero`, its flow-control window is pinned to 0
(`_on_table`), so every request for it waits in that model's queue with the queue's fairness
(priority classes, weighted fair by tenant), bound (`max_queued`, newcomers evicting the
largest share) and refusals (503 + Retry-After); the table that routes its first ready replica
unpins the window and the held requests go in their fair order. A held request's deadline is
`wake_max_wait_s` (or less: the caller's own deadline), not the queue's wait.

Invariants:
- `held(alias)` counts exactly the requests waiting in `wait` for that alias now; each goes up
  once and down once however its wait ends (granted, refused, cancelled, client gone).
- The first request held starts the model's wake loop (WakeCaller), which runs while
  `held(alias)` > 0; several protocols waiting for one model share the loop.
- A cancelled wait (a gRPC client's cancel or deadline, an HTTP client gone) leaves the queue at
  once; a slot granted in that same instant is given back (the flow controller's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from starlette.types import Receive

from paved.gateway.errors import GatewayError
from paved.gateway.flow.flow import FlowController, Priority, QueueRefusedError, Slot

if TYPE_CHECKING:
    from paved.gateway.metrics import GatewayMetrics
    from paved.gateway.routing.router import Router
    from paved.gateway.routing.routes import RoutesTable
    from paved.gateway.routing.wake import WakeCaller

_T = TypeVar("_T")
# A metadata call answered "waking" while a model cold-starts: the client's retry delay.
WAKING_RETRY_AFTER_S = 5


class ClientGone(Exception):
    """The client disconnected while its request waited (answered 499 / cancelled)."""


async def unless_gone(receive: Receive, work: Awaitable[_T], discard: Callable[[_T], object]) -> _T:
    """`work`'s result, unless the HTTP client disconnects first (its body was already read):
    `work` is then cancelled, a result it produced in that same instant goes to `discard`
    (nothing is leaked), and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        gone.cancel()
        raise
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        discard(await task)
    raise ClientGone


def release_slot(got: object) -> None:
    """`unless_gone`'s discard for a queue wait: a slot granted as the client left goes back."""
    if isinstance(got, Slot):
        got.release()


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class HeldRequests:
    """The models at zero and the requests held for them; one per gateway, built by the proxy
    (`OpenAIProxy.held`) and handed to the KServe forwarders."""

    def __init__(
        self,
        router: Router,
        flow: FlowController | None,
        waker: WakeCaller | None,
        metrics: GatewayMetrics,
        wake_max_wait_s: float,
    ):
        self.router = router
        # None (or max_queued 0): nothing is held; a request for a model at zero is answered
        # 503 no_healthy_backend at once (it still wakes the model).
        self.flow = flow
        # The control plane's wake endpoint; None (a routes file): requests are held until
        # their deadline and nothing wakes the model.
        self.waker = waker
        self.metrics = metrics
        self.wake_max_wait_s = wake_max_wait_s
        self._at_zero: set[str] = set()
        self._held: dict[str, int] = {}
        router.add_listener(self._on_table)

    @property
    def enabled(self) -> bool:
        return self.flow is not None and self.flow.enabled

    def at_zero(self, alias: str) -> bool:
        route = self.router.table.models.get(alias)
        return route is not None and route.scaled_to_zero

    def held(self, alias: str) -> int:
        return self._held.get(alias, 0)

    def wake(self, alias: str) -> None:
        """Start `alias`'s wake loop unless it runs (never blocks, never raises)."""
        if self.waker is not None:
            self.waker.wake(alias, lambda: self._held.get(alias, 0) > 0)

    def waking_error(self, alias: str) -> GatewayError:
        """What a call that cannot be held answers for a model at zero (its metadata is known
        only to a replica): 503 + Retry-After, after starting the wake."""
        self.wake(alias)
        return GatewayError(
            503,
            f"the model '{alias}' is scaled to zero and waking; retry after the Retry-After delay",
            code="scaled_to_zero",
            headers={"Retry-After": str(WAKING_RETRY_AFTER_S)},
        )

    def _on_table(self, table: RoutesTable) -> None:
        """Pin the queue window of every model the table has at zero to 0 (its requests wait),
        and unpin the ones that left zero (their held requests go, in fair order)."""
        flow = self.flow
        if flow is None or not flow.enabled:
            return
        at_zero = {alias for alias, route in table.models.items() if route.scaled_to_zero}
        for alias in sorted(at_zero - self._at_zero):
            flow.set_window(alias, 0)
        for alias in sorted(self._at_zero - at_zero):
            flow.set_window(alias, None)
        self._at_zero = at_zero

    async def wait(
        self,
        alias: str,
        waiting: Awaitable[_T],
        wait_s: float,
        guard: Callable[[Awaitable[_T]], Awaitable[_T]] | None = None,
    ) -> _T:
        """Await `waiting` (the queue's acquire, deadline `wait_s` from now) as a request held for
        `alias` at zero: counted while it waits; an expired wait says the model is waking.
        `guard` wraps the wait (e.g. ends it when the client leaves)."""
        self._held[alias] = self._held.get(alias, 0) + 1
        self.metrics.held.labels(alias).inc()
        try:
            return await (guard(waiting) if guard is not None else waiting)
        except QueueRefusedError as e:
            if e.code != "queue_timeout":
                raise
            raise QueueRefusedError(
                f"the model '{alias}' is scaled to zero and no replica of it was ready within "
                f"{wait_s:g} s (it is starting); retry after the Retry-After delay",
                e.code or "queue_timeout",
                int(e.headers.get("Retry-After", "1")),
            ) from None
        finally:
            left = self._held[alias] - 1
            if left:
                self._held[alias] = left
            else:
                del self._held[alias]
            self.metrics.held.labels(alias).dec()

    async def until_woken(
        self,
        alias: str,
        tenant: str,
        priority: Priority,
        *,
        limit_s: float | None = None,
        guard: Callable[[Awaitable[Slot]], Awaitable[Slot]] | None = None,
    ) -> None:
        """Hold one request (a KServe call) for `alias` at zero until its turn comes once the
        model is routed: wakes it, waits in the model's queue (at most `wake_max_wait_s`, or
        `limit_s` when shorter: the client's own deadline), then gives the slot back at once
        (a KServe answer teaches the window nothing; the caller forwards as for any model).
        Raises QueueRefusedError (503 + Retry-After: full, expired, closing), or 504 when the
        caller's own deadline is what ran out; with no queue, returns at once (the pick then
        answers 503)."""
        self.wake(alias)
        flow = self.flow
        if flow is None or not flow.enabled:
            return
        wait_s = self.wake_max_wait_s
        client_bound = limit_s is not None and limit_s < wait_s
        if limit_s is not None:
            wait_s = max(0.0, min(limit_s, wait_s))
        deadline = time.monotonic() + wait_s
        slot = flow.try_acquire(alias, tenant, priority, deadline)
        if slot is None:
            try:
                slot = await self.wait(alias, flow.acquire(alias, tenant, priority, deadline), wait_s, guard)
            except QueueRefusedError as e:
                if client_bound and e.code == "queue_timeout":
                    raise GatewayError(
                        504,
                        f"the call's deadline passed while the model '{alias}' was waking from zero",
                        code="deadline_exceeded",
                    ) from None
                raise
        slot.release()
