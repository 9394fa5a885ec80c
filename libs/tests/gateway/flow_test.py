"""The gateway's flow control (paved.gateway.flow.flow): fair order across tenants (hypothesis),
priority, the bound and the deadline as 503 + Retry-After, cancellation leaving no waiter and no
slot behind, and the window learned from the backends' push-back."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paved.gateway.errors import GatewayError
from paved.gateway.flow.flow import FlowConfig, FlowController, Priority, QueueRefusedError, Slot
from paved.gateway.metrics import GatewayMetrics

M = "tiny"
FG, BG = Priority.INTERACTIVE, Priority.BACKGROUND


def _far() -> float:
    return time.monotonic() + 300


async def _served_in_order(flow: FlowController, arrivals: list[tuple[str, Priority]]) -> list[str]:
    """Queue `arrivals` in order behind a closed window, then open it to one request at a time;
    the tenants in the order they were dispatched."""
    order: list[str] = []

    async def one(tenant: str, priority: Priority) -> None:
        slot = await flow.acquire(M, tenant, priority, _far())
        order.append(tenant)
        slot.release(completed=True)

    flow.set_window(M, 0)
    tasks = []
    for tenant, priority in arrivals:
        tasks.append(asyncio.create_task(one(tenant, priority)))
        await asyncio.sleep(0)
    assert flow.depth(M) == len(arrivals)
    flow.set_window(M, 1)
    await asyncio.gather(*tasks)
    return order


@settings(max_examples=60, deadline=None)
@given(
    wa=st.integers(1, 4),
    wb=st.integers(1, 4),
    arrivals=st.lists(st.sampled_from("ab"), min_size=2, max_size=60).filter(
        lambda xs: "a" in xs and "b" in xs
    ),
)
def test_two_backlogged_tenants_are_served_in_proportion_to_their_weights(wa, wb, arrivals):
    flow = FlowController(FlowConfig(tenant_weights={"a": wa, "b": wb}))
    order = asyncio.run(_served_in_order(flow, [(t, FG) for t in arrivals]))
    assert sorted(order) == sorted(arrivals)
    left = {"a": arrivals.count("a"), "b": arrivals.count("b")}
    served = {"a": 0, "b": 0}
    for k, tenant in enumerate(order, start=1):
        if left["a"] == 0 or left["b"] == 0:
            break  # one tenant is no longer backlogged
        served[tenant] += 1
        left[tenant] -= 1
        # Within one request of the weighted share at every point, whatever the arrival order.
        assert abs(served["a"] - k * wa / (wa + wb)) <= 1, (order, k)


def test_equal_weights_alternate_strictly():
    flow = FlowController()
    order = asyncio.run(_served_in_order(flow, [("flood", FG)] * 10 + [("trickle", FG)] * 3))
    assert order[:6] == ["flood", "trickle"] * 3
    assert order[6:] == ["flood"] * 7


@settings(max_examples=60, deadline=None)
@given(
    weight=st.integers(1, 8),
    backlog=st.integers(2, 40),
    when=st.integers(0, 40),
    burst=st.integers(1, 6),
)
def test_a_late_tenant_gets_its_share_at_once_and_no_more(weight, backlog, when, burst):
    """A light tenant's `burst` arriving while a heavy one (weight `weight`) has a backlog is
    served from the next dispatch on in proportion to the weights: it is not starved behind the
    backlog, and its time idle banked no credit to starve the heavy one with."""
    when = min(when, backlog - 1)
    flow = FlowController(FlowConfig(tenant_weights={"flood": weight}))
    order: list[str] = []

    async def run() -> None:
        light: list[asyncio.Task[None]] = []

        async def one(tenant: str) -> None:
            slot = await flow.acquire(M, tenant, FG, _far())
            order.append(tenant)
            if tenant == "flood" and order.count("flood") == when + 1:
                light.extend(asyncio.create_task(one("light")) for _ in range(burst))
                await asyncio.sleep(0)  # they queue while this one is in flight
                order.append("|")
            slot.release(completed=True)

        flow.set_window(M, 0)
        floods = [asyncio.create_task(one("flood")) for _ in range(backlog)]
        await asyncio.sleep(0)
        flow.set_window(M, 1)
        await asyncio.gather(*floods)
        await asyncio.gather(*light)

    asyncio.run(run())
    after = order[order.index("|") + 1 :]
    assert after.index("light") <= 1, order
    left = {"flood": after.count("flood"), "light": burst}
    served = 0
    for k, tenant in enumerate(after, start=1):
        if not left["flood"] or not left["light"]:
            break
        left[tenant] -= 1
        served += tenant == "light"
        assert abs(served - k / (weight + 1)) <= 1, order


async def _held(flow: FlowController, holds: dict[str, float], backlog: int, now: list[float]) -> list[str]:
    """Each tenant queues `backlog` requests behind a closed window; one at a time, each holds
    its slot `holds[tenant]` seconds of the controller's clock. The dispatch order."""
    order: list[str] = []

    async def one(tenant: str) -> None:
        slot = await flow.acquire(M, tenant, FG, _far())
        order.append(tenant)
        now[0] += holds[tenant]
        slot.release(completed=True)

    flow.set_window(M, 0)
    tasks = [asyncio.create_task(one(t)) for _ in range(backlog) for t in holds]
    await asyncio.sleep(0)
    flow.set_window(M, 1)
    await asyncio.gather(*tasks)
    return order


@settings(max_examples=40, deadline=None)
@given(long_s=st.integers(2, 30), weight=st.integers(1, 3))
def test_tenants_share_time_in_the_slots_not_a_count_of_dispatches(long_s, weight):
    """A tenant of long requests (`long_s` seconds each) against one of 1 s requests: each gets
    the slot for time in proportion to its weight (dispatches alone gave the long one `long_s`
    times its share of the time)."""
    now = [0.0]
    flow = FlowController(FlowConfig(tenant_weights={"long": weight}), clock=lambda: now[0])
    holds = {"long": float(long_s), "short": 1.0}
    order = asyncio.run(_held(flow, holds, 40, now))
    held = {"long": 0.0, "short": 0.0}
    left = {"long": 40, "short": 40}
    for tenant in order:
        if not left["long"] or not left["short"]:
            break  # one is no longer backlogged
        held[tenant] += holds[tenant]
        left[tenant] -= 1
        # Within one long request of the weighted share of the time at every point.
        total = held["long"] + held["short"]
        assert abs(held["long"] - total * weight / (weight + 1)) <= long_s + 1, order


def test_requests_within_the_charge_unit_are_scheduled_by_count():
    now = [0.0]
    flow = FlowController(FlowConfig(charge_unit_s=10.0), clock=lambda: now[0])
    order = asyncio.run(_held(flow, {"a": 9.0, "b": 0.1}, 4, now))
    assert order == ["a", "b"] * 4  # both under 10 s: one unit each


def test_a_long_stream_delays_its_tenants_next_turn_by_a_bounded_debt():
    """A request that held its slot an hour costs its tenant at most _MAX_DEBT (64) others'
    turns, not 3600."""
    now = [0.0]
    flow = FlowController(clock=lambda: now[0])

    async def run() -> list[str]:
        stream = await flow.acquire(M, "a", FG, _far())
        order: list[str] = []

        async def one(tenant: str) -> None:
            slot = await flow.acquire(M, tenant, FG, _far())
            order.append(tenant)
            slot.release(completed=True)

        flow.set_window(M, 1)  # the stream holds the only slot; the rest queue behind it
        tasks = [asyncio.create_task(one("b")) for _ in range(100)]
        tasks.append(asyncio.create_task(one("a")))
        await asyncio.sleep(0)
        now[0] += 3600.0
        stream.release(completed=True)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(run())
    assert 60 <= order.index("a") <= 66, order


def test_time_held_while_nobody_else_waited_costs_nothing():
    """A tenant's long requests while it had the model to itself leave no debt: when another
    tenant shows up later, the two alternate as if the first had just arrived."""
    now = [0.0]
    flow = FlowController(clock=lambda: now[0])

    async def run() -> list[str]:
        for _ in range(10):  # alone: 100 s each, nobody waiting
            slot = await flow.acquire(M, "a", FG, _far())
            now[0] += 100.0
            slot.release(completed=True)
        return await _held(flow, {"a": 1.0, "b": 1.0}, 4, now)

    order = asyncio.run(run())
    assert order[:4] in (["a", "b"] * 2, ["b", "a"] * 2), order


def test_a_debt_is_forgotten_once_the_queue_was_quiet_for_forget_after():
    now = [0.0]
    flow = FlowController(FlowConfig(forget_after_s=10.0), clock=lambda: now[0])

    async def run() -> list[str]:
        # a's 30 s request holds the only slot while b waits: a contended slot, charged.
        flow.set_window(M, 1)
        stream = await flow.acquire(M, "a", FG, _far())
        waiter = asyncio.create_task(flow.acquire(M, "b", FG, _far()))
        await asyncio.sleep(0)
        now[0] += 30.0
        stream.release(completed=True)
        (await waiter).release(completed=True)
        now[0] += 11.0  # quiet past forget_after_s
        return await _held(flow, {"a": 1.0, "b": 1.0}, 4, now)

    order = asyncio.run(run())
    assert order[:4] == ["a", "b"] * 2, order  # without forgetting: b, b, ... first


def test_interactive_goes_before_background():
    flow = FlowController()
    arrivals = [("batch", BG)] * 4 + [("app", FG), ("batch", BG), ("app", FG)]
    order = asyncio.run(_served_in_order(flow, arrivals))
    assert order == ["app", "app"] + ["batch"] * 5


def test_a_tenants_requests_keep_their_arrival_order():
    flow = FlowController()

    async def run() -> list[int]:
        order: list[int] = []

        async def one(i: int) -> None:
            slot = await flow.acquire(M, "t", FG, _far())
            order.append(i)
            slot.release(completed=True)

        flow.set_window(M, 0)
        tasks = [asyncio.create_task(one(i)) for i in range(20)]
        await asyncio.sleep(0)
        flow.set_window(M, 1)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == list(range(20))


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_full_queue_refuses_with_503_and_retry_after_and_gives_each_tenant_its_share():
    metrics = GatewayMetrics()
    flow = FlowController(FlowConfig(max_queued=2), metrics=metrics)

    async def run() -> None:
        flow.set_window(M, 0)
        floods = [asyncio.create_task(flow.acquire(M, "flood", FG, _far())) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueRefusedError) as refused:
            await flow.acquire(M, "flood", FG, _far())
        e = refused.value
        assert isinstance(e, GatewayError) and e.status == 503 and e.code == "queue_full"
        assert int(e.headers["Retry-After"]) >= 1
        assert "queue is full" in e.message
        # Another tenant's request takes the place of the flood's newest one.
        light = asyncio.create_task(flow.acquire(M, "light", FG, _far()))
        await asyncio.sleep(0)
        assert flow.depth(M) == 2
        with pytest.raises(QueueRefusedError):
            await floods[1]
        assert not floods[0].done()
        # ...but not when it would hold more than its share: the newcomer is refused.
        with pytest.raises(QueueRefusedError):
            await flow.acquire(M, "light", FG, _far())
        flow.set_window(M, 2)
        (await floods[0]).release()
        (await light).release()

    asyncio.run(run())
    assert flow.depth(M) == 0 and flow.in_flight(M) == 0
    assert _sample(metrics, "paved_gateway_queue_refused_total", model=M, tenant="flood", reason="full") == 2
    assert _sample(metrics, "paved_gateway_queue_refused_total", model=M, tenant="light", reason="full") == 1
    assert _sample(metrics, "paved_gateway_queue_depth", model=M, tenant="flood") == 0


def test_interactive_evicts_background_from_a_full_queue():
    flow = FlowController(FlowConfig(max_queued=1))

    async def run() -> None:
        flow.set_window(M, 0)
        batch = asyncio.create_task(flow.acquire(M, "t", BG, _far()))
        await asyncio.sleep(0)
        app = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        await asyncio.sleep(0)
        with pytest.raises(QueueRefusedError):
            await batch
        with pytest.raises(QueueRefusedError):  # background never evicts interactive
            await flow.acquire(M, "u", BG, _far())
        flow.set_window(M, 1)
        (await app).release()

    asyncio.run(run())


def test_a_wait_past_its_deadline_is_refused_and_leaves_the_queue():
    metrics = GatewayMetrics()
    flow = FlowController(metrics=metrics)

    async def run() -> None:
        flow.set_window(M, 0)
        with pytest.raises(QueueRefusedError) as refused:
            await flow.acquire(M, "t", FG, time.monotonic() + 0.02)
        assert refused.value.code == "queue_timeout" and refused.value.status == 503
        assert int(refused.value.headers["Retry-After"]) >= 1
        with pytest.raises(QueueRefusedError):  # already past: refused without queueing
            await flow.acquire(M, "t", FG, time.monotonic() - 1)

    asyncio.run(run())
    assert flow.depth(M) == 0
    assert _sample(metrics, "paved_gateway_queue_refused_total", model=M, tenant="t", reason="deadline") == 2
    assert _sample(metrics, "paved_gateway_queue_depth", model=M, tenant="t") == 0


def test_a_timeout_after_a_long_wait_with_nobody_let_through_asks_for_more_than_a_second():
    """Nobody let through, so no recent wait to go by: the Retry-After of a request that
    waited 30 s for nothing is half that, not the 1 s that sent clients straight back."""
    now = [1000.0]
    flow = FlowController(clock=lambda: now[0])

    async def run() -> None:
        flow.set_window(M, 0)
        # Its deadline passes 50 ms from now (the loop's timer); the clock says 30 s went by.
        waiter = asyncio.create_task(flow.acquire(M, "t", FG, now[0] + 0.05))
        await asyncio.sleep(0)
        now[0] += 30
        try:
            await asyncio.wait_for(waiter, 60)
        except QueueRefusedError as refused:
            assert refused.code == "queue_timeout"
            assert int(refused.headers["Retry-After"]) >= 15
            return
        raise AssertionError("the request was let through")

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_no_waiter_and_no_slot():
    metrics = GatewayMetrics()
    flow = FlowController(metrics=metrics)

    async def run() -> None:
        flow.set_window(M, 0)
        waiting = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        await asyncio.sleep(0)
        assert flow.depth(M) == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert flow.depth(M) == 0
        assert _sample(metrics, "paved_gateway_queue_depth", model=M, tenant="t") == 0
        # Granted and cancelled in the same instant (before the task resumed): the slot is
        # given back, not leaked.
        raced = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        await asyncio.sleep(0)
        flow.set_window(M, 1)
        assert flow.in_flight(M) == 1
        raced.cancel()
        with pytest.raises(asyncio.CancelledError):
            await raced
        assert flow.in_flight(M) == 0
        # Cancelled (its future too) but not yet run when a slot frees: skipped, the next waiter
        # is granted, and the cancelled one leaves without a slot.
        gone = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        stays = asyncio.create_task(flow.acquire(M, "u", FG, _far()))
        flow.set_window(M, 0)
        await asyncio.sleep(0)
        assert flow.depth(M) == 2
        gone.cancel()
        flow.set_window(M, 1)
        with pytest.raises(asyncio.CancelledError):
            await gone
        (await asyncio.wait_for(stays, 5)).release()
        assert flow.in_flight(M) == 0 and flow.depth(M) == 0
        # The window of one is free for the next request.
        (await asyncio.wait_for(flow.acquire(M, "t", FG, _far()), 5)).release()

    asyncio.run(run())


def test_a_push_back_closes_the_window_and_an_ending_request_reopens_it():
    flow = FlowController()

    async def run() -> None:
        slots = [await flow.acquire(M, "t", FG, _far()) for _ in range(3)]
        assert flow.window(M) is None and flow.in_flight(M) == 3
        again = asyncio.create_task(slots[2].requeue())
        await asyncio.sleep(0)
        # The backends held the two others: two in flight at most, the third waits.
        assert flow.window(M) == 2 and flow.depth(M) == 1 and not again.done()
        later = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        await asyncio.sleep(0)
        assert flow.depth(M) == 2
        slots[0].release()  # (a completed answer would also widen the window a little)
        await asyncio.wait_for(again, 5)
        assert slots[2].granted and not later.done()  # the requeued one is ahead of later ones
        slots[1].release(completed=True)
        (await asyncio.wait_for(later, 5)).release(completed=True)
        slots[2].release(completed=True)
        window = flow.window(M)
        assert flow.in_flight(M) == 0 and window is not None and window >= 2

    asyncio.run(run())


def test_a_probe_goes_when_nothing_ends():
    flow = FlowController(FlowConfig(retry_interval_s=0.01))

    async def run() -> None:
        stuck = await flow.acquire(M, "t", FG, _far())
        bounced = await flow.acquire(M, "t", FG, _far())
        probe = asyncio.create_task(bounced.requeue())
        await asyncio.sleep(0)
        assert flow.window(M) == 1 and flow.depth(M) == 1
        # Nothing in flight ends: the retry interval sends the waiter anyway.
        await asyncio.wait_for(probe, 5)
        assert bounced.granted and flow.in_flight(M) == 2
        stuck.release()
        bounced.release()

    asyncio.run(run())


def test_a_held_request_waits_for_an_ending_request_or_a_probe_never_its_own_room():
    # A request held because the backends' gauges read full did not ask them, and a lone request
    # pushed back has nothing of ours in flight whose end would make room: the window (never
    # below one) has room for either at once, and taking that room would loop without a wait
    # (~20,000 tries in 30 s against a backend that keeps pushing back). Each goes when a request
    # of ours ends, or with the next probe.
    async def run() -> None:
        plain = FlowController(FlowConfig(retry_interval_s=3600))
        bounced = await plain.acquire(M, "t", FG, _far())
        again = asyncio.create_task(bounced.requeue())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not again.done() and plain.depth(M) == 1 and plain.in_flight(M) == 0
        again.cancel()
        with pytest.raises(asyncio.CancelledError):
            await again
        assert plain.depth(M) == 0

        probing = FlowController(FlowConfig(retry_interval_s=0.05))
        bounced = await probing.acquire(M, "t", FG, _far())
        await asyncio.wait_for(bounced.requeue(), 5)  # the probe sends it again
        assert bounced.granted
        bounced.release()

        pinned = FlowController(FlowConfig(retry_interval_s=0.05))
        pinned.set_window(M, 1)  # no probes on a pinned window: one later turn within it
        bounced = await pinned.acquire(M, "t", FG, _far())
        await asyncio.wait_for(bounced.requeue(), 5)
        assert bounced.granted and pinned.in_flight(M) == 1
        bounced.release()

        flow = FlowController(FlowConfig(retry_interval_s=3600))
        alone = await flow.acquire(M, "t", FG, _far())
        held = asyncio.create_task(alone.requeue(hold=True))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not held.done() and flow.depth(M) == 1 and flow.in_flight(M) == 0
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        assert flow.depth(M) == 0 and flow.in_flight(M) == 0

        flow = FlowController(FlowConfig(retry_interval_s=3600))  # a window not closed yet
        busy = await flow.acquire(M, "t", FG, _far())
        second = await flow.acquire(M, "t", FG, _far())
        held = asyncio.create_task(second.requeue(hold=True))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not held.done() and flow.depth(M) == 1
        busy.release(completed=True)  # one of ours ends: the held one goes
        await asyncio.wait_for(held, 5)
        assert second.granted and flow.depth(M) == 0
        second.release(completed=True)

    asyncio.run(run())
    probed = FlowController(FlowConfig(retry_interval_s=0.01))

    async def probe() -> None:
        alone = await probed.acquire(M, "t", FG, _far())
        await asyncio.wait_for(alone.requeue(hold=True), 5)  # the probe sends it
        assert alone.granted and probed.depth(M) == 0
        alone.release()

    asyncio.run(probe())


def test_a_requeue_past_the_deadline_is_refused():
    flow = FlowController()

    async def run() -> None:
        slot = await flow.acquire(M, "t", FG, time.monotonic() - 1)
        with pytest.raises(QueueRefusedError) as refused:
            await slot.requeue()
        assert refused.value.code == "queue_timeout"
        assert flow.in_flight(M) == 0 and flow.depth(M) == 0

    asyncio.run(run())


def test_an_idle_model_forgets_its_window():
    now = [0.0]
    flow = FlowController(FlowConfig(forget_after_s=10), clock=lambda: now[0])

    async def run() -> None:
        a = await flow.acquire(M, "t", FG, math.inf)
        b = await flow.acquire(M, "t", FG, math.inf)
        task = asyncio.create_task(b.requeue())
        await asyncio.sleep(0)
        a.release(completed=True)
        await task
        b.release(completed=True)
        assert flow.window(M) is not None
        now[0] = 11.0
        slots = [await flow.acquire(M, "t", FG, math.inf) for _ in range(5)]  # no wait
        assert flow.window(M) is None
        for s in slots:
            s.release()

    asyncio.run(run())


def test_the_context_manager_releases():
    flow = FlowController()

    async def run() -> None:
        async with flow.slot(M, "t", FG, _far()) as slot:
            assert isinstance(slot, Slot) and flow.in_flight(M) == 1
        assert flow.in_flight(M) == 0
        with pytest.raises(RuntimeError):
            async with flow.slot(M, "t", FG, _far()):
                raise RuntimeError("boom")
        assert flow.in_flight(M) == 0

    asyncio.run(run())


def test_close_refuses_every_waiter():
    flow = FlowController()

    async def run() -> None:
        flow.set_window(M, 0)
        waiting = asyncio.create_task(flow.acquire(M, "t", FG, _far()))
        await asyncio.sleep(0)
        flow.close()
        with pytest.raises(QueueRefusedError):
            await waiting
        with pytest.raises(QueueRefusedError):
            await flow.acquire(M, "t", FG, _far())

    asyncio.run(run())


def test_priority_header_values():
    assert Priority.parse(None) is FG
    assert Priority.parse("background") is BG and Priority.parse(" Interactive ") is FG
    with pytest.raises(GatewayError) as e:
        Priority.parse("urgent")
    assert e.value.status == 400 and "interactive" in e.value.message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queued": -1},
        {"max_queued": True},
        {"max_wait_s": 0},
        {"retry_interval_s": math.nan},
        {"tenant_weights": {"t": 0}},
        {"default_weight": -1},
    ],
)
def test_config_is_validated(kwargs):
    with pytest.raises(ValueError):
        FlowConfig(**kwargs)


def test_waiters_reaching_their_deadline_in_one_turn_are_each_refused_queue_timeout():
    """Several deadlines in one loop turn while the window shows room (the dispatched request
    pushed back and requeued, nothing in flight, no probe before the deadline): the first
    waiter's removal pumps the queue, which unlinks the others, whose futures their own
    timeouts had cancelled. Each must still get queue_timeout: they raised a bare TimeoutError
    (a 500 at the gateway)."""

    async def outcome(coro) -> str:
        try:
            await coro
            return "granted"
        except QueueRefusedError as e:
            return e.code
        except BaseException as e:  # noqa: BLE001 - what the gateway would answer 500
            return type(e).__name__

    async def main() -> list[str]:
        flow = FlowController(FlowConfig(retry_interval_s=60))  # no probe before the deadline
        deadline = time.monotonic() + 0.5
        first = await flow.acquire("m", "a", Priority.INTERACTIVE, deadline)

        async def pushed_back_twice() -> None:
            await first.requeue()
            await first.requeue()

        pushed = asyncio.ensure_future(outcome(pushed_back_twice()))
        await asyncio.sleep(0)
        waiters = [
            asyncio.ensure_future(outcome(flow.acquire("m", t, Priority.INTERACTIVE, deadline)))
            for t in ("b", "c", "d")
        ]
        return await asyncio.gather(pushed, *waiters)

    assert asyncio.run(main()) == ["queue_timeout"] * 4
