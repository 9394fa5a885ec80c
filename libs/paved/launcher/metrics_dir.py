"""PROMETHEUS_MULTIPROC_DIR hygiene: wipe stale files of a previous run, and nothing else.

vLLM (and any prometheus_client process in multiprocess mode) leaves `<type>_<pid>.db` files
that a new run would add to its own counters, so the directory must be emptied before the
engine starts. The launcher deletes only files it owns: regular files named like
prometheus_client's (`counter_12.db`, `gauge_livesum_12.db`, `histogram_12.db`, ...) that belong
to its own uid, plus its own marker and lock. It refuses, without deleting anything, if the
directory holds anything else (a mistyped path such as $HOME or /tmp), is a filesystem root or
the home directory, or is locked by another running launcher (the lock is held for the
launcher's lifetime).
"""

from __future__ import annotations

import fcntl
import os
import re

MARKER = ".paved-metrics-dir"
LOCK = ".paved-metrics-dir.lock"
_DB = re.compile(r"^(counter|histogram|summary|gauge_(live)?(all|min|max|sum|mostrecent))_\d+\.db$")


class MetricsDirError(RuntimeError):
    pass


def is_metrics_file(name: str) -> bool:
    return bool(_DB.match(name))


def prepare(path: str) -> int:
    """Create or clean the directory; returns the fd of the lock held for this process's life."""
    path = os.path.abspath(path)
    if path in ("/", os.path.expanduser("~")) or os.path.ismount(path):
        raise MetricsDirError(
            f"refusing to use {path} as PROMETHEUS_MULTIPROC_DIR (a root or home directory)"
        )
    os.makedirs(path, exist_ok=True)
    if os.path.islink(path):
        raise MetricsDirError(f"refusing to clean {path}: it is a symlink")
    stale, foreign = [], []
    uid = os.getuid()
    for entry in os.scandir(path):
        if entry.name in (MARKER, LOCK):
            continue
        if is_metrics_file(entry.name) and entry.is_file(follow_symlinks=False):
            if entry.stat(follow_symlinks=False).st_uid == uid:
                stale.append(entry.path)
            else:
                foreign.append(f"{entry.name} (owned by uid {entry.stat(follow_symlinks=False).st_uid})")
        else:
            foreign.append(entry.name)
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise MetricsDirError(
            f"refusing to clean PROMETHEUS_MULTIPROC_DIR={path}: it does not look like a metrics "
            f"directory ({len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} not written by "
            f"prometheus_client under this uid: {shown}). Point it at a dedicated directory."
        )
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MetricsDirError(
            f"PROMETHEUS_MULTIPROC_DIR={path} is in use by another running launcher; give each its own"
        ) from None
    for p in stale:
        os.unlink(p)
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("Written by the paved launcher: *.db files here are wiped at each start.\n")
    return fd
