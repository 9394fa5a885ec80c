"""Flow control: a bounded per-model queue in front of dispatch that holds requests while the
model's backends have no room, and hands the room out fairly.

    slot = await flow.acquire(model, tenant, Priority.INTERACTIVE, deadline)
    ...                                # forward; on "no backend had room": await slot.requeue()
    slot.release(completed=True)       # when the answer (or stream) has ended

or `async with flow.slot(model, tenant, priority, deadline) as slot:` for a caller whose work
ends inside the block.

How room is known (per model, per gateway replica): a concurrency window. Until a backend first
pushes back the window is open and a request goes straight through (no await, no queue). When a
dispatched request finds every backend full (the caller says so with `requeue`), the window
closes to the number of this replica's requests still in flight there, and the request goes
back to the head of its tenant's line. A request waiting is dispatched when an in-flight one
ends, or, when nothing ends for `retry_interval_s`, one waiter goes as a probe (so a window that
is too small, or load from other replicas, never wedges the queue). A request held before it
was sent (the backends' gauges read full: `requeue(hold=True)`) waits for one of those two.
Each answer that was not a push-back widens the window: by one per answer while no push-back
was seen for `forget_after_s`, by one per window's worth of answers otherwise; an idle model
forgets its window. Each replica learns its own window; the limits (requests, tokens,
concurrency per key and tenant) are reserved before a request queues, as without the queue, so
several replicas together never admit beyond them.

Order of dispatch: strict priority between classes (interactive before background); inside a
class, weighted fair queuing by tenant (stride scheduling: each tenant has a pass value, the
backlogged tenant with the lowest pass goes next and its pass grows by 1 / weight; a tenant that
becomes backlogged starts at the class's current virtual time, so idle time banks no credit).
Two backlogged tenants with weights a and b are served a : b, within one request at any point.
A tenant's own requests keep their arrival order.

What is shared is time in a slot, not a count of dispatches: a request is charged one unit at
dispatch and, when it ends, one more per further `charge_unit_s` it held its slot (its whole
stream), so at equal weights a tenant of 30 s streams gets a fifth of the turns of a tenant of
6 s ones and the two hold the slots equally. A request that ends within `charge_unit_s` costs
one unit whatever its length (short requests are scheduled by count, as above). A tenant's debt
is capped at _MAX_DEBT units of its own weight beyond its class's virtual time: a burst of hour-long
streams delays its next turn by at most _MAX_DEBT * (the others' weights / its weight) of their
turns (64 for two tenants of equal weight). Only a contended slot is charged (another tenant of
the class waited when it was granted or when it ended), and debts are forgotten once the class
has had nobody waiting for `forget_after_s`.

Refusal (503 with Retry-After and an OpenAI error body, `QueueRefusedError`): when the model's
queue holds `max_queued` requests, a newcomer takes the place of the newest waiter of the tenant
holding the largest weighted share of the queue (or of a less important class), else it is
refused; a waiter whose deadline passes leaves with a refusal. A waiter whose task is cancelled
(its client left) is removed at once, and a slot granted to it in the same instant is given back.

Concurrency: one FlowController serves one event loop; everything but the waits is synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paved.gateway.errors import GatewayError

if TYPE_CHECKING:
    from paved.gateway.metrics import GatewayMetrics

__all__ = ["FlowConfig", "FlowController", "Priority", "QueueRefusedError", "Slot"]

PRIORITY_HEADER = "x-paved-priority"
# Smoothing of the recent wait (the Retry-After of a refusal).
_WAIT_EWMA = 0.2
# The most units a tenant's pass may run ahead of its class's virtual time (module docstring).
_MAX_DEBT = 64.0
_MAX_RETRY_AFTER_S = 60


class Priority(enum.IntEnum):
    """Lower values are dispatched first."""

    INTERACTIVE = 0
    BACKGROUND = 1

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        """The class a request names in `x-paved-priority` (absent: interactive); 400 otherwise."""
        if value is None:
            return cls.INTERACTIVE
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise GatewayError(
                400, f"{PRIORITY_HEADER} must be one of: {names}", code="invalid_priority"
            ) from None


@dataclass(frozen=True)
class FlowConfig:
    # Requests held per model (all tenants and classes together); 0 turns holding off.
    max_queued: int = 1024
    # The longest a request may wait for room, in total over its tries.
    max_wait_s: float = 30.0
    # With requests waiting and nothing ending, one is sent this often as a probe.
    retry_interval_s: float = 0.25
    # How long after the last push-back the window is treated as a guess that may grow fast.
    forget_after_s: float = 10.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    # A request is charged a unit per this many seconds it holds its slot (at least one).
    charge_unit_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 0:
            raise ValueError("max_queued must be an integer >= 0")
        for name in ("max_wait_s", "retry_interval_s", "forget_after_s", "default_weight", "charge_unit_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number")
        for tenant, weight in self.tenant_weights.items():
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"the weight of tenant {tenant!r} must be a positive number")

    def weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, self.default_weight))


class QueueRefusedError(GatewayError):
    """503 + Retry-After: the model's queue is full (`queue_full`) or the request waited past
    its deadline (`queue_timeout`)."""

    def __init__(self, message: str, code: str, retry_after_s: int):
        super().__init__(503, message, code=code, headers={"Retry-After": str(retry_after_s)})


def _closed_error() -> QueueRefusedError:
    return QueueRefusedError("the gateway is shutting down", "queue_closed", 1)


class _State(enum.Enum):
    QUEUED = 1
    GRANTED = 2
    DONE = 3  # released, refused or cancelled


class Slot:
    """One request's place: queued, then granted (counted in flight), then done."""

    def __init__(
        self, flow: FlowController, q: _ModelQueue, tenant: str, priority: Priority, deadline: float
    ):
        self._flow = flow
        self._q = q
        self.model = q.model
        self.tenant = tenant
        self.priority = priority
        self.deadline = deadline
        self._state = _State.DONE
        self._future: asyncio.Future[None] | None = None
        self._queued_at = 0.0
        self._granted_at = 0.0
        # Another tenant of its class was waiting when it was granted (see _charge_hold).
        self._contended = False
        # Seconds spent waiting in the queue, over every try.
        self.waited_s = 0.0

    @property
    def granted(self) -> bool:
        return self._state is _State.GRANTED

    async def requeue(self, *, hold: bool = False) -> None:
        """The dispatched request found no backend with room: give the room back, close the
        window to what is still in flight, and wait for another turn (ahead of the tenant's
        later requests, the same deadline). Raises QueueRefusedError as `acquire` does.

        `hold`: the backends were not asked (their gauges say they are full), so nothing that
        could make room has happened: the turn comes with a request ending or the next probe,
        never at once (the window's room would hand it straight back, a loop without a wait).
        The same holds for a push-back with nothing else of ours in flight."""
        if self._state is not _State.GRANTED:
            raise RuntimeError("requeue of a slot that is not granted")
        self._flow._pushed_back(self)
        # With nothing else of ours in flight no ending request will make room, and the window
        # (never below one) would hand the turn straight back: a lone request against backends
        # that keep pushing back would retry in a tight loop. It waits for the next probe.
        alone = self._q.active == 0
        await self._flow._join(self, front=True, pump=not hold and not alone)

    def release(self, *, completed: bool = False) -> None:
        """Leave the model's in-flight count (idempotent). `completed`: a backend answered (not
        a push-back), which may widen the window."""
        if self._state is _State.GRANTED:
            self._state = _State.DONE
            self._flow._released(self, completed)


@dataclass
class _Class:
    """One priority class of one model: a FIFO per tenant, scheduled by stride."""

    lines: dict[str, deque[Slot]] = field(default_factory=dict)
    passes: dict[str, float] = field(default_factory=dict)
    # Tie-break among equal passes: the order tenants became backlogged.
    joined: dict[str, int] = field(default_factory=dict)
    virtual: float = 0.0
    # When the class last had nobody waiting (or was charged while so): passes older than
    # forget_after_s are dropped when it next queues, debts with them.
    quiet_since: float = -math.inf

    def others_wait(self, tenant: str) -> bool:
        return any(t != tenant for t in self.lines)


class _ModelQueue:
    def __init__(self, model: str):
        self.model = model
        self.classes = [_Class() for _ in Priority]
        self.waiting = 0
        self.per_tenant: dict[str, int] = {}
        self.active = 0
        # None: no push-back seen (or forgotten): not limited.
        self.window: float | None = None
        self.pinned: int | None = None
        self.last_pushback = -math.inf
        self.last_progress = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.wait_ewma = 0.0

    def limit(self) -> float:
        if self.pinned is not None:
            return self.pinned
        return math.inf if self.window is None else self.window

    def has_room(self) -> bool:
        # Whole requests only: a window of 8.3 (growing a fraction per answer) holds 8. With
        # `active < 8.3` the first answer after a push-back already let a 9th go, which the
        # backends pushed back again: most answers at saturation cost one wasted round trip.
        return self.active + 1 <= self.limit()


class FlowController:
    """The queues of every model this gateway replica serves."""

    def __init__(
        self,
        config: FlowConfig | None = None,
        *,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config or FlowConfig()
        self._metrics = metrics
        self._clock = clock
        self._queues: dict[str, _ModelQueue] = {}
        self._seq = 0
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.config.max_queued > 0

    # ---- the API -------------------------------------------------------------------------

    async def acquire(self, model: str, tenant: str, priority: Priority, deadline: float) -> Slot:
        """A granted slot for one request to `model` (an alias): at once while the model has
        room and nobody waits, else after waiting its turn until `deadline` (this controller's
        clock, time.monotonic by default). Raises QueueRefusedError when the queue is full or
        the deadline passes; cancellation while waiting leaves no trace."""
        slot = self.try_acquire(model, tenant, priority, deadline)
        if slot is None:
            slot = Slot(self, self._queue(model), tenant, priority, deadline)
            await self._join(slot, front=False)
        return slot

    def try_acquire(self, model: str, tenant: str, priority: Priority, deadline: float) -> Slot | None:
        """`acquire`'s path without waiting: a granted slot, or None when the request would
        have to queue."""
        q = self._queue(model)
        now = self._clock()
        idle = q.waiting == 0 and q.active == 0
        if idle and q.window is not None and now - q.last_pushback > self.config.forget_after_s:
            q.window = None
            self._window_metric(q)
        if q.waiting or not q.has_room() or self._closed:
            return None
        slot = Slot(self, q, tenant, priority, deadline)
        self._grant(q, slot, now)
        if self._metrics is not None:
            self._metrics.queue_wait.labels(q.model, tenant).observe(0.0)
        return slot

    @contextlib.asynccontextmanager
    async def slot(self, model: str, tenant: str, priority: Priority, deadline: float) -> AsyncIterator[Slot]:
        """`acquire`, released when the block ends (as a completed answer unless it raised)."""
        s = await self.acquire(model, tenant, priority, deadline)
        try:
            yield s
        except BaseException:
            s.release()
            raise
        s.release(completed=True)

    def set_window(self, model: str, limit: int | None) -> None:
        """Pin the model's window to `limit` requests in flight (0 holds every request, e.g. while
        a model scales from zero), or unpin it (None: learned from push-backs again)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError("limit must be an integer >= 0 or None")
        q = self._queue(model)
        q.pinned = limit
        self._window_metric(q)
        self._pump(q)

    def depth(self, model: str | None = None) -> int:
        """Requests waiting (for one model, or for all)."""
        if model is not None:
            q = self._queues.get(model)
            return q.waiting if q is not None else 0
        return sum(q.waiting for q in self._queues.values())

    def in_flight(self, model: str) -> int:
        q = self._queues.get(model)
        return q.active if q is not None else 0

    def window(self, model: str) -> float | None:
        """The window in force (None: not limited)."""
        q = self._queues.get(model)
        if q is None:
            return None
        limit = q.limit()
        return None if limit == math.inf else limit

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {
            model: {
                "waiting": q.waiting,
                "in_flight": q.active,
                "window": self.window(model),
                "pinned": q.pinned is not None,
                "per_tenant": dict(q.per_tenant),
            }
            for model, q in self._queues.items()
        }

    def close(self) -> None:
        """Refuse every waiter (the gateway is stopping) and stop the probe timers."""
        self._closed = True
        for q in self._queues.values():
            if q.timer is not None:
                q.timer.cancel()
                q.timer = None
            for cls in q.classes:
                for line in list(cls.lines.values()):
                    for slot in list(line):
                        self._refuse(slot, _closed_error())

    # ---- internals -----------------------------------------------------------------------

    def _queue(self, model: str) -> _ModelQueue:
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = _ModelQueue(model)
        return q

    def _retry_after(self, q: _ModelQueue, *, at_least_s: float = 0.0) -> int:
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(max(q.wait_ewma, at_least_s))))

    async def _join(self, slot: Slot, *, front: bool, pump: bool = True) -> None:
        q = slot._q
        now = self._clock()
        if self._closed:
            raise _closed_error()
        if now >= slot.deadline:
            self._count_refusal(slot, "deadline")
            raise self._timeout_error(slot)
        if q.waiting >= self.config.max_queued and not self._make_room(q, slot):
            self._count_refusal(slot, "full")
            raise QueueRefusedError(
                f"the model '{q.model}' is at capacity and its queue is full "
                f"({q.waiting} requests waiting); retry after the Retry-After delay",
                "queue_full",
                self._retry_after(q),
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slot._future = future
        self._enqueue(q, slot, now, front=front)
        if pump:
            self._pump(q)
        elif q.pinned is not None:
            # A pinned window has no probes; one later turn, within the pinned room.
            asyncio.get_running_loop().call_later(self.config.retry_interval_s, self._pump, q)
        else:
            self._arm(q)
        try:
            async with asyncio.timeout(max(0.0, slot.deadline - self._clock())):
                await future
        except TimeoutError:
            if slot._state is _State.GRANTED:
                return  # granted in the same instant the deadline passed: go
            if slot._state is _State.QUEUED:
                self._remove(slot)
                self._count_refusal(slot, "deadline")
                raise self._timeout_error(slot) from None
            # Refused (evicted, closed) in the same instant: that refusal is the answer.
            error = future.exception() if future.done() and not future.cancelled() else None
            if error is not None:
                raise error from None
            # Unlinked by another waiter's pump after this one's own timeout had cancelled its
            # future (several deadlines in one turn): the deadline is still the answer (a bare
            # TimeoutError here was a 500).
            self._count_refusal(slot, "deadline")
            raise self._timeout_error(slot) from None
        except asyncio.CancelledError:
            if slot._state is _State.QUEUED:
                self._remove(slot)
            elif slot._state is _State.GRANTED:
                # Granted, but the task was cancelled before it ran: give the room back.
                slot.release()
            raise

    def _timeout_error(self, slot: Slot) -> QueueRefusedError:
        return QueueRefusedError(
            f"the model '{slot.model}' had no capacity for this request within its queue's wait "
            f"limit ({slot.waited_s:.1f} s waited); retry after the Retry-After delay",
            "queue_timeout",
            # The recent wait of those let through, but no less than half this request's own
            # wait for nothing: with none let through (a model that does not wake, say) the
            # average is 0, and Retry-After 1 asked clients to come straight back.
            self._retry_after(slot._q, at_least_s=slot.waited_s / 2),
        )

    def _enqueue(self, q: _ModelQueue, slot: Slot, now: float, *, front: bool) -> None:
        cls = q.classes[slot.priority]
        line = cls.lines.get(slot.tenant)
        if line is None:
            if not cls.lines and now - cls.quiet_since > self.config.forget_after_s:
                cls.passes.clear()  # quiet for a while: old debts go (and so do gone tenants)
            line = cls.lines[slot.tenant] = deque()
            # Backlogged from now: start at the class's virtual time (no banked credit).
            cls.passes[slot.tenant] = max(cls.passes.get(slot.tenant, 0.0), cls.virtual)
            self._seq += 1
            cls.joined[slot.tenant] = self._seq
        if front:
            line.appendleft(slot)
        else:
            line.append(slot)
        slot._state = _State.QUEUED
        slot._queued_at = now
        q.waiting += 1
        q.per_tenant[slot.tenant] = q.per_tenant.get(slot.tenant, 0) + 1
        if self._metrics is not None:
            self._metrics.queue_depth.labels(q.model, slot.tenant).inc()

    def _unlink(self, slot: Slot) -> float:
        """Take a queued slot out of its line and the counts (not its future); returns how long
        it waited this time."""
        q = slot._q
        cls = q.classes[slot.priority]
        line = cls.lines[slot.tenant]
        line.remove(slot)
        if not line:
            del cls.lines[slot.tenant]
            del cls.joined[slot.tenant]
            if not cls.lines:
                cls.quiet_since = self._clock()
            if cls.passes[slot.tenant] <= cls.virtual:
                del cls.passes[slot.tenant]  # max(pass, virtual) would give virtual anyway
        q.waiting -= 1
        left = q.per_tenant[slot.tenant] - 1
        if left:
            q.per_tenant[slot.tenant] = left
        else:
            del q.per_tenant[slot.tenant]
        stint = self._clock() - slot._queued_at
        slot.waited_s += stint
        slot._state = _State.DONE
        if self._metrics is not None:
            self._metrics.queue_depth.labels(q.model, slot.tenant).dec()
        return stint

    def _remove(self, slot: Slot) -> None:
        self._unlink(slot)
        self._pump(slot._q)

    def _refuse(self, slot: Slot, error: QueueRefusedError) -> None:
        self._unlink(slot)
        if slot._future is not None and not slot._future.done():
            slot._future.set_exception(error)

    def _make_room(self, q: _ModelQueue, newcomer: Slot) -> bool:
        """Evict one waiter for `newcomer` if it deserves the place more: the newest waiter of
        the least important class below the newcomer's, else of the tenant with the largest
        weighted share when that share exceeds the newcomer's tenant's after joining."""
        victim: Slot | None = None
        for priority in reversed(Priority):
            if priority < newcomer.priority:
                break
            cls = q.classes[priority]
            if not cls.lines:
                continue
            tenant = max(cls.lines, key=lambda t: (self._share(q, t), cls.joined[t]))
            if priority > newcomer.priority:
                victim = cls.lines[tenant][-1]
                break
            mine = (q.per_tenant.get(newcomer.tenant, 0) + 1) / self.config.weight(newcomer.tenant)
            if tenant != newcomer.tenant and self._share(q, tenant) > mine:
                victim = cls.lines[tenant][-1]
        if victim is None:
            return False
        self._count_refusal(victim, "full")
        self._refuse(
            victim,
            QueueRefusedError(
                f"the model '{q.model}' is at capacity and its queue is full; this request gave "
                "its place to another tenant's (each tenant gets its share of the queue)",
                "queue_full",
                self._retry_after(q),
            ),
        )
        return True

    def _share(self, q: _ModelQueue, tenant: str) -> float:
        return q.per_tenant.get(tenant, 0) / self.config.weight(tenant)

    def _next(self, q: _ModelQueue) -> tuple[Slot, asyncio.Future[None]] | None:
        """The next waiter to dispatch, charged to its tenant, out of the queue."""
        for cls in q.classes:
            while cls.lines:
                tenant = min(cls.lines, key=lambda t: (cls.passes[t], cls.joined[t]))
                slot = cls.lines[tenant][0]
                future = slot._future
                if future is None or future.done():
                    # Its task was cancelled (the client left) and has not run yet to leave.
                    self._unlink(slot)
                    continue
                cls.virtual = cls.passes[tenant]
                cls.passes[tenant] += 1.0 / self.config.weight(tenant)
                return slot, future
        return None

    def _pump(self, q: _ModelQueue, *, probe: bool = False) -> None:
        """Grant waiters while the window has room (one beyond it for a probe)."""
        while q.waiting and (q.has_room() or probe) and not self._closed:
            picked = self._next(q)
            if picked is None:
                break
            slot, future = picked
            self._observe_wait(q, slot, self._unlink(slot))
            self._grant(q, slot, self._clock())
            future.set_result(None)
            probe = False
        self._arm(q)

    def _arm(self, q: _ModelQueue) -> None:
        """With waiters held by a learned window, make sure a probe timer is pending."""
        if not q.waiting or q.pinned is not None or self._closed:
            if q.timer is not None:
                q.timer.cancel()
                q.timer = None
            return
        if q.timer is None:
            loop = asyncio.get_running_loop()
            q.timer = loop.call_later(self.config.retry_interval_s, self._probe, q)

    def _probe(self, q: _ModelQueue) -> None:
        q.timer = None
        idle = self._clock() - q.last_progress
        if idle >= self.config.retry_interval_s * 0.999:
            self._pump(q, probe=True)
            return
        q.timer = asyncio.get_running_loop().call_later(self.config.retry_interval_s - idle, self._probe, q)

    def _grant(self, q: _ModelQueue, slot: Slot, now: float) -> None:
        slot._state = _State.GRANTED
        slot._granted_at = now
        slot._contended = q.classes[slot.priority].others_wait(slot.tenant)
        q.active += 1
        q.last_progress = now

    def _observe_wait(self, q: _ModelQueue, slot: Slot, stint: float) -> None:
        q.wait_ewma += _WAIT_EWMA * (stint - q.wait_ewma)
        if self._metrics is not None:
            self._metrics.queue_wait.labels(q.model, slot.tenant).observe(stint)

    def _pushed_back(self, slot: Slot) -> None:
        q = slot._q
        # The backends hold what else is in flight from here and no more (never below one: with
        # nothing in flight from here, the load is someone else's and probes find the room).
        if q.pinned is None:
            q.window = float(max(1, min(q.window or math.inf, q.active - 1)))
            self._window_metric(q)
        q.last_pushback = self._clock()
        slot._state = _State.DONE
        q.active -= 1
        # Undo the dispatch's charge: the tenant did not get the request served.
        cls = q.classes[slot.priority]
        if slot.tenant in cls.passes:
            cls.passes[slot.tenant] -= 1.0 / self.config.weight(slot.tenant)

    def _released(self, slot: Slot, completed: bool) -> None:
        q = slot._q
        q.active -= 1
        now = self._clock()
        q.last_progress = now
        self._charge_hold(q, slot, now)
        # It was full when no further whole request fitted beside the `active + 1` in flight.
        if completed and q.window is not None and q.active + 2 > q.window:
            # The window was full and a backend still answered: it may hold more.
            if now - q.last_pushback > self.config.forget_after_s:
                q.window += 1.0
            else:
                q.window += 1.0 / q.window
            self._window_metric(q)
        self._pump(q)

    def _charge_hold(self, q: _ModelQueue, slot: Slot, now: float) -> None:
        """Charge the tenant the units its request held the slot beyond the one its dispatch
        paid, when the slot was contended: another tenant of its class waited when it was
        granted or waits now. Time taken while nobody else wanted it costs nothing."""
        extra = (now - slot._granted_at) / self.config.charge_unit_s - 1.0
        if not extra > 0:
            return
        cls = q.classes[slot.priority]
        if not (slot._contended or cls.others_wait(slot.tenant)):
            return
        if not cls.lines:
            cls.quiet_since = now  # the debt is recent: kept for forget_after_s
        weight = self.config.weight(slot.tenant)
        start = max(cls.passes.get(slot.tenant, cls.virtual), cls.virtual)
        capped = min(start + extra / weight, cls.virtual + _MAX_DEBT / weight)
        cls.passes[slot.tenant] = max(start, capped)

    def _window_metric(self, q: _ModelQueue) -> None:
        if self._metrics is not None:
            limit = q.limit()
            self._metrics.queue_window.labels(q.model).set(0 if limit == math.inf else limit)

    def _count_refusal(self, slot: Slot, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.queue_refused.labels(slot.model, slot.tenant, reason).inc()
