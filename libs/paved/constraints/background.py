"""Threads for constraint work that must never slow the decode loop down.

Checking and compiling a heavy spec is CPU work of tens to hundreds of milliseconds. On a small
machine the engine's step loop, its worker and the API's event loop already want every core,
so admission threads run at a lower scheduling priority (nice +10 per thread): the kernel runs
them when a core would otherwise idle, and a heavy spec waits for CPU instead of the running
requests. A request that waits too long for its compile gets the compile-time budget's 400.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

NICENESS = 10


def _lower_priority() -> None:
    try:
        # Linux applies nice per thread (a TID is a PRIO_PROCESS target); raising it needs no
        # privilege.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError) as e:  # not Linux, or a sandbox that forbids it
        logger.debug("could not lower the priority of %s: %s", threading.current_thread().name, e)


def background_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run below the decode loop's priority."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=_lower_priority)
