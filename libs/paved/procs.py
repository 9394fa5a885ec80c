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
import time

# A kernel thread (field 9 of /proc/<pid>/stat): it has no environment, ever.
_PF_KTHREAD = 0x00200000
# How long a process whose environment reads empty is read again: one caught inside execve,
# after the point its parent's Popen returns and before the kernel has laid out the new image's
# environment, reads empty for a moment (seen under load right after a spawn).
_EXEC_RETRIES = (0.002, 0.005, 0.01, 0.02, 0.05)


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None when the
    process does not exist or is a zombie (it has exited, only its exit status is left)."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def _environ(pid: int) -> bytes:
    """/proc/<pid>/environ, read again for a moment while it is empty for a process that may be
    inside execve (see _EXEC_RETRIES). OSError when it cannot be read."""
    data = _read_environ(pid)
    for pause in _EXEC_RETRIES:
        if data or not _may_be_in_exec(pid):
            break
        time.sleep(pause)
        data = _read_environ(pid)
    return data


def _read_environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def _may_be_in_exec(pid: int) -> bool:
    """False for what never has an environment again: a kernel thread, an exited process."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 7 or fields[0] in (b"Z", b"X"):
        return False
    try:
        return not int(fields[6]) & _PF_KTHREAD
    except ValueError:
        return False


def marked_processes(name: str, value: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment has `name=value`."""
    needle = f"{name}={value}".encode()
    found = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if needle not in _environ(int(entry)).split(b"\0"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or another user's process
            continue
        if proc_start_time(int(entry)) is not None:
            found[int(entry)] = cmdline
    return found
