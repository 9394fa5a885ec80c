"""Transfer progress: a redrawn bar on a TTY, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("paved.launcher")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """Thread-safe byte counter. `add` may be negative (a retried part gives its bytes back)."""

    def __init__(
        self,
        total: int,
        label: str = "download",
        stream: TextIO | None = None,
        tty: bool | None = None,
        log_every_s: float = 5.0,
    ):
        self.total = max(total, 0)
        self.label = label
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self._log_every_s = log_every_s
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_log = self._start
        self._closed = False

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self._tty:
                if now - self._last_draw >= 0.1:
                    self._last_draw = now
                    self._draw(now)
            elif now - self._last_log >= self._log_every_s:
                self._last_log = now
                log.info("%s: %s", self.label, self._summary(now))

    def _summary(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = f"{eta:.0f}s" if eta != float("inf") else "?"
        return (
            f"{pct:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)} "
            f"{human_bytes(rate)}/s eta {eta_s}"
        )

    def _draw(self, now: float) -> None:
        width = 30
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        self._stream.write(f"\r{self.label} [{bar}] {self._summary(now)}\x1b[K")
        self._stream.flush()

    def close(self) -> float:
        """Final line; returns the elapsed seconds."""
        with self._lock:
            if self._closed:
                return time.monotonic() - self._start
            self._closed = True
            now = time.monotonic()
            if self._tty:
                self._draw(now)
                self._stream.write("\n")
                self._stream.flush()
            else:
                log.info("%s: done, %s", self.label, self._summary(now))
            return now - self._start
