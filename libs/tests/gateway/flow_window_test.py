"""The flow controller's learned window counts whole requests: after a push-back closes it to
N, a fraction of growth per answer must not let an N+1th request go at once (that one is
pushed back again, a wasted round trip per answer at saturation). Driven step by step on one
event loop, no timers: every outcome is decided by the order of events alone."""

from __future__ import annotations

import asyncio
import math

from paved.gateway.flow.flow import FlowConfig, FlowController, Priority, Slot

M = "tiny"
FG = Priority.INTERACTIVE


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_one_answer_after_a_push_back_does_not_reopen_the_window_past_what_the_backends_held():
    # No probe can fire during the test: only ending requests make room.
    flow = FlowController(FlowConfig(retry_interval_s=3600))

    async def run() -> None:
        slots = [await flow.acquire(M, "t", FG, math.inf) for _ in range(3)]
        pushed = asyncio.create_task(slots[2].requeue())
        await _settle()
        assert flow.window(M) == 2 and flow.in_flight(M) == 2
        waiters = [asyncio.create_task(flow.acquire(M, "t", FG, math.inf)) for _ in range(4)]
        await _settle()
        assert flow.depth(M) == 5

        # One answer (not a push-back) while the window was full: it widens by 1/2, to 2.5.
        slots[0].release(completed=True)
        await _settle()
        assert pushed.done() and slots[2].granted
        window = flow.window(M)
        assert window is not None and 2 < window < 3
        # The backends held 2: 2 go, not 3 (the old code let a third go at once).
        assert flow.in_flight(M) == 2, flow.snapshot()
        assert flow.depth(M) == 4

        # A window's worth of answers (2 more) while full: the window reaches 3, and 3 go.
        slots[1].release(completed=True)
        await _settle()
        assert flow.in_flight(M) == 2
        granted = [w.result() for w in waiters if w.done()]
        assert len(granted) == 1
        granted[0].release(completed=True)
        await _settle()
        window = flow.window(M)
        assert window is not None and window >= 3
        assert flow.in_flight(M) == 3

        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for w in waiters:
            if not w.cancelled() and w.exception() is None:
                w.result().release()
        slots[2].release()
        assert flow.in_flight(M) == 0 and flow.depth(M) == 0

    asyncio.run(run())


def test_a_saturated_backend_sees_about_one_push_back_per_window_of_answers():
    """A backend that holds CAP requests and pushes back the rest, with a steady backlog: each
    completion ends the oldest request in flight. The window should settle at CAP with one try
    past it per window's worth of answers (about ANSWERS / CAP push-backs); the old code sent
    one past it after every answer."""
    cap, answers, clients = 4, 200, 12
    flow = FlowController(FlowConfig(retry_interval_s=3600))

    async def run() -> tuple[int, int]:
        in_backend: list[Slot] = []
        pushbacks = 0
        done = 0

        async def client() -> None:
            nonlocal pushbacks
            slot = await flow.acquire(M, "t", FG, math.inf)
            while True:
                if len(in_backend) < cap:
                    in_backend.append(slot)
                    return
                pushbacks += 1
                await slot.requeue()

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await _settle()
        while done < answers:
            oldest = in_backend.pop(0)
            oldest.release(completed=True)
            done += 1
            tasks = [t for t in tasks if not t.done()]
            tasks.append(asyncio.create_task(client()))
            await _settle()
            assert len(in_backend) <= cap
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in in_backend:
            slot.release(completed=True)
        assert flow.in_flight(M) == 0 and flow.depth(M) == 0
        return pushbacks, done

    pushbacks, done = asyncio.run(run())
    # One per window of answers is done / cap = 50 (41 seen); the old code: 201, one per answer.
    assert pushbacks <= done / cap * 1.5, pushbacks
