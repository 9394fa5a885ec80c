"""Loopback port ranges that concurrent test processes do not share.

Bazel runs tests in parallel on one network namespace. A range a test names by hand collides
with another test's when both start replicas at once, and a free-looking port is no guarantee:
a launcher binds its public ports only once its engine is ready, so two control planes probing
the same range both see it free and one replica dies on bind. So ranges are claimed: each
unit of `UNIT` ports is owned by whoever holds an abstract Unix socket named after it. The
kernel keeps such names per network namespace, exactly as it keeps TCP ports, and frees them
when the holder exits, SIGKILLed or not, so a crashed test never leaks a claim.

Units lie in `SPAN`, below the kernel's ephemeral ports (32768 up, where `port 0` binds land),
so nothing else the tests start takes them.
"""

from __future__ import annotations

import math
import socket
import threading

from paved.net import port_free

__all__ = ["SPAN", "UNIT", "port_block"]

UNIT = 100
SPAN = (20000, 32700)  # [lo, hi): whole units only

# Held until this process exits: a test's replicas may outlive the fixture that made them
# (they are reaped at teardown), and a process claims a handful of units at most.
_held: list[socket.socket] = []
_lock = threading.Lock()


def _claim(unit: int) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0paved-test-ports-{unit}")
    except OSError:
        s.close()
        return None
    return s


def port_block(n: int = UNIT) -> tuple[int, int]:
    """(lo, hi), `n` consecutive loopback ports no other test process holds a claim on and
    nothing had bound when claimed; the claim lasts until this process exits."""
    if not 1 <= n <= SPAN[1] - SPAN[0]:
        raise ValueError(f"n must be 1..{SPAN[1] - SPAN[0]}, got {n}")
    units = math.ceil(n / UNIT)
    first, last = SPAN[0] // UNIT, SPAN[1] // UNIT - units
    with _lock:
        for start in range(first, last + 1):
            got = []
            for unit in range(start, start + units):
                s = _claim(unit)
                if s is None:
                    break
                got.append(s)
            lo = start * UNIT
            if len(got) == units and all(port_free(p) for p in range(lo, lo + n)):
                _held.extend(got)
                return lo, lo + n - 1
            for s in got:
                s.close()
    raise RuntimeError(f"no {n} unclaimed free loopback ports in {SPAN[0]}-{SPAN[1] - 1}")
