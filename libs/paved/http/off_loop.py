"""Decoding a large request body off the event loop.

Decoding is O(body): a 30 MB body of token ids or tensor elements takes seconds of parsing and
validation, and on the event loop every other request (health probes included) would wait for
it. Bodies up to OFF_LOOP_BYTES are decoded inline (well under a millisecond each, cheaper than
a thread hop); larger ones on a small pool of their own, shared by every server of the process.
JSON parsing is C code that holds the GIL, so the pool bounds how much of it competes with the
loop at once rather than hiding it entirely.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

OFF_LOOP_BYTES = 1024 * 1024
DECODE_THREADS = 2
# Normal priority (unlike the frontend's admission pool): a decode holds the GIL, and a thread
# descheduled while holding it would stall the loop instead of sparing it.
_pool = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="paved-body")
T = TypeVar("T")


async def off_loop_if_large(size: int, decode: Callable[..., T], *args: Any) -> T:
    """`decode(*args)`, on the decode pool when the body it decodes (`size` bytes) is over
    OFF_LOOP_BYTES."""
    if size <= OFF_LOOP_BYTES:
        return decode(*args)
    return await asyncio.get_running_loop().run_in_executor(_pool, decode, *args)
