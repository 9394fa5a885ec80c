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


def sweep(token: str, grace_s: float) -> int:
    """SIGTERM every process carrying the token, SIGKILL what is left after `grace_s`; the
    number of processes found."""
    found = procs.marked_processes(MARKER_ENV, token)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    left = found
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = procs.marked_processes(MARKER_ENV, token)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(found)


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
