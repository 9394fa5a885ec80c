"""paved.procs against real processes: a marked process is found whatever its session,
zombies never are, and a process whose
environment reads empty for a moment (caught inside execve, right after its parent's Popen
returned) is read again rather than missed."""

from __future__ import annotations

import builtins
import os
import secrets
import subprocess
import sys
import time

from paved import procs


def _sleeper(**env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, **env},
        start_new_session=True,
    )


def test_a_marked_process_is_found_and_a_zombie_is_not() -> None:
    token = secrets.token_hex(8)
    child = _sleeper(PAVED_TEST_PROCS=token)
    try:
        found = procs.marked_processes("PAVED_TEST_PROCS", token)
        assert list(found) == [child.pid] and "time.sleep(60)" in found[child.pid]
        assert procs.proc_start_time(child.pid) is not None
        child.kill()
        deadline = time.monotonic() + 10
        while procs.proc_start_time(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        # Exited, not yet reaped: a zombie, neither listed nor given a start time.
        assert procs.proc_start_time(child.pid) is None
        assert procs.marked_processes("PAVED_TEST_PROCS", token) == {}
    finally:
        child.kill()
        child.wait()


def test_an_environment_caught_empty_inside_exec_is_read_again(monkeypatch) -> None:
    token = secrets.token_hex(8)
    child = _sleeper(PAVED_TEST_PROCS=token)
    empty_reads = [2]
    real_open = builtins.open

    class _Empty:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self) -> bytes:
            return b""

    def opening(path, *args, **kwargs):
        if path == f"/proc/{child.pid}/environ" and empty_reads[0] > 0:
            empty_reads[0] -= 1
            return _Empty()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", opening)
    try:
        assert list(procs.marked_processes("PAVED_TEST_PROCS", token)) == [child.pid]
        assert empty_reads == [0]
    finally:
        monkeypatch.undo()
        child.kill()
        child.wait()
