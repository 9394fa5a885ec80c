"""Finding a process tree by an environment marker, through /proc (Linux).

Whoever starts processes that may outlive their parent (the control plane's launchers, which
start engines in sessions of their own; `up`'s children) puts `NAME=value` in their
environment, which every descendant inherits; `marked_processes(NAME, value)` then finds every
one of them, whatever its session or parent, so a stop can end them all.

Invariants: the caller itself is never listed; zombies (exited, only a status left) are not;
a process that vanishes or belongs to another user while being read is skipped, never an error.
"""

from __future__ import annotations

import os


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None when the
    process does not exist or is a zombie (it has exited, only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def marked_processes(name: str, value: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment has `name=value`."""
    needle = f"{name}={value}".encode()
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or another user's process
            continue
        if proc_start_time(int(entry)) is not None:
            found[int(entry)] = cmdline
    return found
