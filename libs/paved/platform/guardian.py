"""`up`'s guardian: ends the platform's processes when `up` itself dies without stopping them.

`up` stops everything it started on Ctrl-C, SIGTERM, SIGHUP or a failed start. A SIGKILL (an
OOM kill, `kill -9`, a CI runner timing out) runs none of that, and its children, each in a
session of its own, would run on holding their ports. So `up` starts this process first, in a
session of its own, with a pipe on its stdin whose write end only `up` holds: the kernel closes
it however `up` ends. At EOF the guardian ends every process carrying `PAVED_PLATFORM=<token>`
(SIGTERM, then SIGKILL after `--grace` seconds), as `up`'s own stop would.

Invariants: the guardian never ends itself (paved.procs skips its caller) or anything without
the token; after an orderly stop `up` closes the pipe once nothing is left, and the guardian
exits finding nothing. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence

from paved import procs

MARKER_ENV = "PAVED_PLATFORM"


# SIGKILL passes after the grace: a process may fork between a scan and its kill; each pass
# rescans, so a child forked that late is killed too. Bounded: a marked process that outlives
# this many kills is in uninterruptible sleep, and no signal would help.
_KILL_PASSES = 10


def _marked(token: str) -> set[tuple[int, int | None]]:
    """(pid, start time) of every process carrying the token: a pid reused by a new marked
    process during the grace is a process not yet told to stop."""
    return {(pid, procs.proc_start_time(pid)) for pid in procs.marked_processes(MARKER_ENV, token)}


def sweep(token: str, grace_s: float) -> int:
    """SIGTERM every process carrying the token, one that appears during the grace (a
    supervisor's restart, a child forked while its parent stopped) included, then SIGKILL what
    is left after `grace_s`, rescanning until nothing is; the number of processes found."""
    termed: set[tuple[int, int | None]] = set()
    deadline = time.monotonic() + grace_s
    left = _marked(token)
    while left:
        for pid, _ in left - termed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        termed |= left
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
        left = _marked(token)
    killed: set[tuple[int, int | None]] = set()
    for _ in range(_KILL_PASSES):
        if not left:
            break
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= left
        time.sleep(0.1)
        left = _marked(token)
    return len(termed | killed)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paved-up-guardian", description=__doc__.splitlines()[0])
    p.add_argument("token", help="the PAVED_PLATFORM value of the processes to end")
    p.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv)
    if not args.token or not 0 <= args.grace <= 600:
        p.error("token must be non-empty and --grace in [0, 600]")
    with contextlib.suppress(OSError):
        while os.read(sys.stdin.fileno(), 4096):
            pass
    found = sweep(args.token, args.grace)
    if found:
        with contextlib.suppress(OSError):
            print(f"up's guardian: up ended without stopping its processes; ended {found}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
