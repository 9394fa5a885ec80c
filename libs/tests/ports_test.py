"""paved.testing.ports: concurrent test processes get disjoint port ranges, and a claim dies
with its holder."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from paved.testing import ports
from paved.testing.ports import SPAN, UNIT, port_block

# A holder in another process: claims a block, prints it, then waits to be killed.
HOLDER = """
import json, sys, time
from paved.testing.ports import port_block
print(json.dumps(port_block(int(sys.argv[1]))), flush=True)
time.sleep(600)
"""


def _holder(n: int) -> tuple[subprocess.Popen[str], tuple[int, int]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(n)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lo, hi = json.loads(proc.stdout.readline())
    return proc, (lo, hi)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def test_blocks_are_disjoint_across_processes_and_freed_by_sigkill() -> None:
    other, theirs = _holder(150)  # two units
    try:
        assert theirs[1] - theirs[0] + 1 == 150 and SPAN[0] <= theirs[0] and theirs[1] < SPAN[1]
        mine = [port_block(150), port_block(UNIT), port_block(1)]
        for i, block in enumerate(mine):
            assert not _overlap(block, theirs), (block, theirs)
            assert not any(_overlap(block, b) for b in mine[i + 1 :]), mine
        # Its units are refused to anyone while it lives ...
        units = range(theirs[0] // UNIT, theirs[1] // UNIT + 1)
        assert all(ports._claim(u) is None for u in units)
        # ... and free once it is SIGKILLed, though no teardown ran (claimed here at once: a
        # concurrent test process would have to search in this very moment to take them).
        other.send_signal(signal.SIGKILL)
        other.wait(10)
        reclaimed = [ports._claim(u) for u in units]
        assert all(s is not None for s in reclaimed), reclaimed
        for s in reclaimed:
            s.close()
    finally:
        other.kill()
        other.wait(10)


def test_a_bound_port_is_never_handed_out() -> None:
    # Something (not a claim) has bound a port of the unit that would be handed out next.
    lo, _ = port_block(1)
    taken = lo + UNIT + 5
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        block = port_block(UNIT)
    assert not block[0] <= taken <= block[1], (block, taken)


@pytest.mark.parametrize("n", [0, -1, SPAN[1] - SPAN[0] + 1])
def test_sizes_outside_the_span_are_refused(n: int) -> None:
    with pytest.raises(ValueError, match="n must be"):
        port_block(n)
