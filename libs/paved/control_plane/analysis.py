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
saved by retrying is still failing). A backend's push-back (`paved_gateway_pushback_total`: 503s
with error code `overloaded`, a full engine queue, which the gateway's flow control holds and
retries) is neither an error nor a request: a saturated version is not rolled back for being
busy (all push-back and nothing else is a window with no requests: inconclusive), while one
answering plain 503s (an engine down, the simulated engine's `fail_after`) still is. 4xx and
499 (client went away) are the caller's, and so are the gateway's own refusals (queue full,
wait expired, every try refused), which carry no backend.

Where the counters come from is a `paved.control_plane.metrics_source.MetricsSource`: the
gateways' /metrics scraped here (the default) or the same series read from a Prometheus
(`--metrics-source prometheus=URL`). Both hand over cumulative counters per backend, so the
windows and the decisions below are the same code for both.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import Any

from paved.control_plane.metrics_source import (
    GatewayCounters,
    MetricsSource,
    MetricsSourceError,
    ScrapeSource,
    parse_gateway_metrics,
)
from paved.control_plane.rollout import Analysis

__all__ = ["GatewayAnalyzer", "parse_gateway_metrics"]

logger = logging.getLogger(__name__)

_Sample = GatewayCounters  # the name the window code below has always used


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
    """Samples the gateways' counters every `interval_s` from a MetricsSource (by default the
    gateways' /metrics at `metrics_urls`, scraped; `source=PrometheusSource(...)` reads them
    with PromQL) and keeps `history_s` of samples. The window arithmetic below is the same
    whatever the source."""

    def __init__(
        self,
        metrics_urls: Iterable[str] = (),
        *,
        source: MetricsSource | None = None,
        interval_s: float = 1.0,
        history_s: float = 3600.0,
    ):
        self.source: MetricsSource = (
            source if source is not None else ScrapeSource(metrics_urls, timeout_s=interval_s)
        )
        self.interval_s = interval_s
        self._samples: deque[_Sample] = deque(maxlen=max(16, int(history_s / interval_s)))
        self._task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    @property
    def urls(self) -> list[str]:
        """The scraped gateways' URLs ([] with another source)."""
        return self.source.urls if isinstance(self.source, ScrapeSource) else []

    @urls.setter
    def urls(self, value: Iterable[str]) -> None:
        if not isinstance(self.source, ScrapeSource):
            raise TypeError(f"a {self.source.name} source has no gateway URLs")
        self.source.urls = list(value)

    @property
    def configured(self) -> bool:
        """Whether there is any traffic to read (no gateway to scrape: analysis sees none)."""
        return self.source.configured

    async def start(self) -> None:
        if self.configured and self._task is None:
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
        """Appends one sample of every gateway's counters; False when the source did not answer."""
        if not self.configured:
            return False
        try:
            sample = await self.source.gateway_counters()
        except MetricsSourceError as e:
            # A missed sample only widens the next window; analysis with no samples is
            # inconclusive, never a pass.
            self.last_error = str(e)
            logger.warning("gateway metrics (%s) read failed: %s", self.source.name, self.last_error)
            return False
        self.last_error = None
        self._samples.append(sample)
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
        # Counters read a moment apart (a push-back counted before its retry) must not make
        # the window's errors negative or more than its requests.
        requests = max(requests, 0.0)
        errors = min(max(errors, 0.0), requests)
        return Analysis(round(requests), round(errors), _p99(first, last, backends))
