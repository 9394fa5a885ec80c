"""Async response streams that always clean up, shared by engines and transports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Closing:
    """An async iterator whose `aclose` always runs its cleanups, even if it was never iterated.

    (An async generator that never started skips its `finally` on `aclose`; a response
    stream abandoned before its first item must still abort the engine request.)
    """

    def __init__(self, iterator: AsyncIterator, *cleanups: Callable[[], Any] | None):
        self._iterator = iterator
        self._cleanups = [c for c in cleanups if c is not None]

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        cleanups, self._cleanups = self._cleanups, []
        try:
            # Another task is inside the generator (a sibling's failure ended the gather that
            # was reading it): closing it now would raise "already running". The cleanups
            # abort the request, which ends that task's read and then the generator itself.
            if not getattr(self._iterator, "ag_running", False):
                await aclose(self._iterator)
        finally:
            for cleanup in cleanups:
                try:
                    result = cleanup()
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:
                    logger.exception("cleaning up a finished request failed")


async def aclose(iterator: Any) -> None:
    """Close an async iterator if it can be closed (engines abort requests on close)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def gather_or_cancel(*awaitables: Awaitable[T]) -> list[T]:
    """asyncio.gather, except that the first failure cancels the others (and waits for them)
    before it is raised: a request's sibling prompts or inputs must not keep generating, or
    hold their engine streams, for an answer that has already failed."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
