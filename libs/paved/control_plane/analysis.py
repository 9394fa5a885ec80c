"""Rollout analysis from the gateway's own metrics: error rate and latency per backend.

The gateway counts every answer by backend and status (`paved_gateway_requests_total`),
every attempt it moved elsewhere before the first byte (`paved_gateway_retries_total`, by the
failed backend) and the upstream's time to response headers (`paved_gateway_upstream_first_
byte_seconds`, a histogram by backend). A version's backends are its replicas' URLs (the routes
the control plane publishes use the URL as the backend id), so a version's window is the sum
over its backends of the counter deltas between the sample taken at the window's start and
the latest one.

The window's start must survive a control-plane restart (the samples live in memory, and a
restarted control plane would otherwise count only the requests since it started): the rollout
persists `counters(...)`, the cumulative counters of the version's backends at the phase's start,
and `analyze` subtracts them from the latest sample. A backend missing from those counters is
counted from zero (it had no answers yet); one whose counters went down was reset by a gateway
restart, and is counted from zero too (Prometheus' `increase` does the same).

Errors are 5xx answers plus retried attempts (a failing backend whose requests the gateway
saved by retrying is still failing); 4xx and 499 (client went away) are the caller's.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from paved.control_plane.rollout import Analysis

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    at: float
    requests: dict[str, float] = field(default_factory=dict)  # backend -> answered
    errors: dict[str, float] = field(default_factory=dict)  # backend -> 5xx + retried
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # backend -> le -> count

    def only(self, backends: set[str]) -> dict[str, Any]:
        """These backends' counters as JSON (the histogram bounds as strings: JSON keys)."""
        return {
            "at": self.at,
            "requests": {b: v for b, v in self.requests.items() if b in backends},
            "errors": {b: v for b, v in self.errors.items() if b in backends},
            "buckets": {
                b: {repr(le): v for le, v in bs.items()} for b, bs in self.buckets.items() if b in backends
            },
        }

    @classmethod
    def parse(cls, data: Any) -> _Sample | None:
        """The inverse of `only`; None for anything else (a baseline from an older version)."""
        try:
            return cls(
                float(data["at"]),
                {str(b): float(v) for b, v in data["requests"].items()},
                {str(b): float(v) for b, v in data["errors"].items()},
                {str(b): {float(le): float(v) for le, v in bs.items()} for b, bs in data["buckets"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def parse_gateway_metrics(text: str, at: float) -> _Sample:
    sample = _Sample(at)
    for family in text_string_to_metric_families(text):
        if family.name == "paved_gateway_requests":
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                backend = s.labels.get("backend", "")
                if not backend:
                    continue
                status = s.labels.get("status", "")
                sample.requests[backend] = sample.requests.get(backend, 0.0) + s.value
                if status.startswith("5"):
                    sample.errors[backend] = sample.errors.get(backend, 0.0) + s.value
        elif family.name == "paved_gateway_retries":
            for s in family.samples:
                if s.name.endswith("_total"):
                    backend = s.labels.get("backend", "")
                    sample.errors[backend] = sample.errors.get(backend, 0.0) + s.value
                    sample.requests[backend] = sample.requests.get(backend, 0.0) + s.value
        elif family.name == "paved_gateway_upstream_first_byte_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    backend = s.labels.get("backend", "")
                    le = float(s.labels["le"])
                    sample.buckets.setdefault(backend, {})[le] = s.value
    return sample


def _since_reset(first: _Sample, last: _Sample, backends: set[str]) -> _Sample:
    """`first` without the backends whose counters went down since (a gateway restarted)."""
    reset = {b for b in backends if last.requests.get(b, 0.0) < first.requests.get(b, 0.0)}
    if not reset:
        return first
    return _Sample(
        first.at,
        {b: v for b, v in first.requests.items() if b not in reset},
        {b: v for b, v in first.errors.items() if b not in reset},
        {b: v for b, v in first.buckets.items() if b not in reset},
    )


def _p99(first: _Sample, last: _Sample, backends: set[str]) -> float | None:
    counts: dict[float, float] = {}
    for b in backends:
        for le, value in last.buckets.get(b, {}).items():
            counts[le] = counts.get(le, 0.0) + value - first.buckets.get(b, {}).get(le, 0.0)
    if not counts:
        return None
    bounds = sorted(counts)
    total = counts[bounds[-1]]
    if total <= 0:
        return None
    rank = 0.99 * total
    for le in bounds:
        if counts[le] >= rank:
            return le if not math.isinf(le) else bounds[-2] if len(bounds) > 1 else None
    return None


class GatewayAnalyzer:
    """Scrapes the gateways' /metrics every `interval_s` and keeps `history_s` of samples."""

    def __init__(self, metrics_urls: Iterable[str], *, interval_s: float = 1.0, history_s: float = 3600.0):
        self.urls = list(metrics_urls)
        self.interval_s = interval_s
        self._samples: deque[_Sample] = deque(maxlen=max(16, int(history_s / interval_s)))
        self._task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    async def start(self) -> None:
        if self.urls and self._task is None:
            await self.scrape_once()
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape_once()

    async def scrape_once(self) -> bool:
        """Appends one sample of every gateway's counters; False when a gateway did not answer."""
        merged = _Sample(time.time())
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s))
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for url in self.urls:
                    async with session.get(url) as r:
                        text = await r.text()
                    part = parse_gateway_metrics(text, merged.at)
                    for name in ("requests", "errors"):
                        mine, theirs = getattr(merged, name), getattr(part, name)
                        for k, v in theirs.items():
                            mine[k] = mine.get(k, 0.0) + v
                    for b, buckets in part.buckets.items():
                        into = merged.buckets.setdefault(b, {})
                        for le, v in buckets.items():
                            into[le] = into.get(le, 0.0) + v
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            # A missed sample only widens the next window; analysis with no samples is
            # inconclusive, never a pass.
            self.last_error = f"{type(e).__name__}: {e}"
            logger.warning("gateway metrics scrape failed: %s", self.last_error)
            return False
        self.last_error = None
        self._samples.append(merged)
        return True

    def counters(self, backends: set[str]) -> dict[str, Any] | None:
        """The latest sample's cumulative counters of `backends` (JSON, for `analyze`'s
        `baseline`), or None without a sample."""
        return self._samples[-1].only(backends) if self._samples else None

    def analyze(self, backends: set[str], since: float, baseline: Any = None) -> Analysis:
        """The window from `baseline` (counters persisted at its start) to the latest sample;
        without a usable one, from the last sample at or before `since`."""
        samples = list(self._samples)
        first = _Sample.parse(baseline) if baseline is not None else None
        if first is None:
            if len(samples) < 2:
                return Analysis(0, 0, None)
            times = [s.at for s in samples]
            first = samples[max(0, bisect.bisect_right(times, since) - 1)]
        if not samples or first is samples[-1] or samples[-1].at <= first.at:
            return Analysis(0, 0, None)
        last = samples[-1]
        first = _since_reset(first, last, backends)
        requests = sum(last.requests.get(b, 0.0) - first.requests.get(b, 0.0) for b in backends)
        errors = sum(last.errors.get(b, 0.0) - first.errors.get(b, 0.0) for b in backends)
        return Analysis(round(requests), round(errors), _p99(first, last, backends))
