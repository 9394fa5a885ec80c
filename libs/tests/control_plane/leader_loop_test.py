"""`lead`: what a control plane does with the leader lock, over a fake lock (no database).

A start that fails is retried, reported and never leaves the lock held with nothing running; a
lost lock stops what runs before `lead` returns; a lock lost while starting gives up."""

from __future__ import annotations

import asyncio

from paved.control_plane.leader import lead


class _Lock:
    def __init__(self, held_checks: int, busy_tries: int = 0):
        self.held_checks = held_checks  # check() answers True this many times, then False
        self.busy_tries = busy_tries
        self.acquired = False

    async def try_acquire(self) -> bool:
        if self.busy_tries:
            self.busy_tries -= 1
            return False
        self.acquired = True
        return True

    async def check(self) -> bool:
        self.held_checks -= 1
        return self.held_checks >= 0


def _run(lock: _Lock, failures: int) -> tuple[list[str], list[str | None]]:
    calls: list[str] = []
    reports: list[str | None] = []

    async def start() -> None:
        calls.append("start")
        if calls.count("start") <= failures:
            raise ConnectionError("the database blipped")

    async def stop() -> None:
        calls.append("stop")

    async def go() -> None:
        await asyncio.wait_for(
            lead(lock, start, stop, reports.append, poll_s=0.001, retry_max_s=0.004),  # type: ignore[arg-type]
            10,
        )

    asyncio.run(go())
    return calls, reports


def test_a_start_that_fails_is_retried_and_reported_until_it_runs():
    calls, reports = _run(_Lock(held_checks=10, busy_tries=3), failures=2)
    assert calls == ["start", "start", "start", "stop"]
    assert [r is None for r in reports] == [False, False, True]
    assert "ConnectionError: the database blipped" in (reports[0] or "")


def test_a_lost_lock_stops_what_runs_before_lead_returns():
    calls, reports = _run(_Lock(held_checks=3), failures=0)
    assert calls == ["start", "stop"] and reports == [None]


def test_a_lock_lost_while_the_start_keeps_failing_gives_up():
    calls, reports = _run(_Lock(held_checks=2), failures=100)
    assert calls == ["start", "start", "start", "stop"]
    assert len(reports) == 3 and all(r is not None for r in reports)
