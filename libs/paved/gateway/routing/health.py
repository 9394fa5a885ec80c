"""Keeping the router's view of the world current: active readiness checks of every backend,
its engine's load gauges, and the routes table source backed by a file (hot-reloaded).

Readiness starts unknown and unknown is served as ready: a fresh gateway (or a backend just
added by a table swap) takes traffic at once, and passive ejection in the router catches a dead
backend before the first check round does. A failed check (non-2xx, connect error, timeout)
removes the backend from routing until a check passes again.

Load: each round also reads every backend's gauges from its `metrics_endpoint` (the `vllm:`
queue and KV gauges, the frontend's admission count and bound; paved.metrics.gauges) and hands
them to `Router.observe_load`. A scrape that fails changes nothing: readiness is decided by the
readiness check alone, and the last gauges go stale in the router (which then ignores them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path

import aiohttp

from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import (
    MAX_FILE_BYTES,
    RoutesError,
    RoutesSource,
    RoutesTable,
    parse_routes_bytes,
    routes_format,
)
from paved.metrics.gauges import ReplicaMetrics, ScrapeError, scrape

logger = logging.getLogger(__name__)

# At most this many checks in flight at once, so a 10k-backend table neither opens 10k sockets
# nor floods the loop; a round then takes ceil(n / 64) * timeout_s at worst.
MAX_CONCURRENT_CHECKS = 64
# A frontend's /metrics is tens of KiB (vLLM's histograms for each model); a bound keeps a
# misbehaving endpoint from filling the gateway's memory, 64 scrapes at a time.
MAX_SCRAPE_BYTES = 2 << 20


class HealthChecker:
    """GETs `url + path` of every backend in the router's table each `interval_s` (rounds do not
    overlap). A 2xx answer is ready; any other answer or a refused connection is not ready at
    once (the backend said so, e.g. while draining, or is gone). A probe that times out only
    counts: `timeouts_to_fail` in a row mark it not ready, so one slow answer from a busy
    backend never takes the only backend of a model out of the routes.

    With `scrape_metrics`, the same round (same concurrency bound, same timeout) reads each
    backend's gauges and passes them to `router.observe_load`; `gauges` holds each backend's
    last reading or the error of its last failed scrape."""

    def __init__(
        self,
        router: Router,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        path: str = "/health/ready",
        timeouts_to_fail: int = 3,
        scrape_metrics: bool = True,
        max_metrics_bytes: int = MAX_SCRAPE_BYTES,
    ):
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError("interval_s and timeout_s must be > 0")
        if timeouts_to_fail < 1:
            raise ValueError("timeouts_to_fail must be >= 1")
        self._timeouts_to_fail = timeouts_to_fail
        self._timeouts: dict[str, int] = {}
        if not path.startswith("/"):
            raise ValueError("path must start with '/'")
        self._router = router
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._path = path
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._last: dict[str, bool] = {}
        self._scrape = bool(scrape_metrics)
        self._timeout_s = float(timeout_s)
        if type(max_metrics_bytes) is not int or max_metrics_bytes < 1:  # bool is not a size
            raise ValueError("max_metrics_bytes must be an integer >= 1")
        self._max_bytes = max_metrics_bytes
        self.gauges: dict[str, ReplicaMetrics | str] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # A check and a scrape per backend in flight.
                connector=aiohttp.TCPConnector(limit=2 * MAX_CONCURRENT_CHECKS),
                trust_env=False,  # health checks go straight to the backend, never via a proxy
            )
        return self._session

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="paved-gateway-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_now()
            except Exception:  # a bug in one round must not end health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(self._interval)

    async def check_now(self) -> dict[str, bool]:
        """One round over the current table; returns id -> ready as applied."""
        targets: dict[str, str] = {}
        endpoints: dict[str, str] = {}
        served: dict[str, set[str]] = {}
        for route in self._router.table.models.values():
            for b in route.backends:
                targets[b.id] = b.url
                endpoints[b.id] = b.metrics_endpoint
                served.setdefault(b.id, set()).add(b.upstream_model)
        session = self._client()
        gate = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)

        async def one(backend_id: str) -> tuple[bool | None, ReplicaMetrics | str | None]:
            async with gate:
                if not self._scrape:
                    return await self._probe(session, targets[backend_id]), None
                # A frontend serving several models of the table is read over all of them.
                models = served[backend_id]
                model_id = next(iter(models)) if len(models) == 1 else None
                return await asyncio.gather(
                    self._probe(session, targets[backend_id]),
                    self._read_gauges(session, endpoints[backend_id], model_id),
                )

        ids = list(targets)
        rounds = await asyncio.gather(*(one(i) for i in ids))
        probed = [verdict for verdict, _ in rounds]
        self._timeouts = {k: v for k, v in self._timeouts.items() if k in targets}
        results = []
        for backend_id, verdict in zip(ids, probed, strict=True):
            if verdict is None:  # timed out: not ready only after several in a row
                misses = self._timeouts.get(backend_id, 0) + 1
                self._timeouts[backend_id] = misses
                verdict = misses < self._timeouts_to_fail and self._last.get(backend_id, True)
            else:
                self._timeouts.pop(backend_id, None)
            results.append(verdict)
        # The table may have been swapped while checking: apply only verdicts about the same
        # server (same id, same url).
        current = {b.id: b.url for r in self._router.table.models.values() for b in r.backends}
        current_endpoints = {
            b.id: b.metrics_endpoint for r in self._router.table.models.values() for b in r.backends
        }
        if self._scrape:
            self._apply_gauges(ids, [read for _, read in rounds], endpoints, current_endpoints)
        applied: dict[str, bool] = {}
        for backend_id, ready in zip(ids, results, strict=True):
            if current.get(backend_id) != targets[backend_id]:
                continue
            self._router.set_ready(backend_id, ready)
            applied[backend_id] = ready
            if self._last.get(backend_id, True) != ready:
                log = logger.info if ready else logger.warning
                log(
                    "backend %s (%s) is %s",
                    backend_id,
                    targets[backend_id],
                    "ready" if ready else "NOT ready",
                )
        self._last = {k: v for k, v in applied.items()}
        return applied

    def _apply_gauges(
        self,
        ids: list[str],
        reads: list[ReplicaMetrics | str | None],
        endpoints: dict[str, str],
        current: dict[str, str],
    ) -> None:
        gauges: dict[str, ReplicaMetrics | str] = {}
        for backend_id, read in zip(ids, reads, strict=True):
            if read is None or current.get(backend_id) != endpoints[backend_id]:
                continue
            before = self.gauges.get(backend_id)
            gauges[backend_id] = read
            if isinstance(read, str):
                if not isinstance(before, str):
                    logger.warning("backend %s: load gauges unreadable (%s)", backend_id, read)
                continue
            if isinstance(before, str):
                logger.info("backend %s: load gauges readable again", backend_id)
            self._router.observe_load(
                backend_id,
                waiting=read.waiting,
                kv_usage=read.kv_usage,
                queued=read.queued,
                max_queued=read.max_queued,
            )
        self.gauges = gauges

    async def _read_gauges(
        self, session: aiohttp.ClientSession, url: str, model_id: str | None
    ) -> ReplicaMetrics | str:
        """The backend's gauges, or why they could not be read."""
        try:
            return await scrape(
                url, model_id=model_id, timeout_s=self._timeout_s, max_bytes=self._max_bytes, session=session
            )
        except (ScrapeError, ValueError, OSError) as e:
            return str(e)[:300]

    async def _probe(self, session: aiohttp.ClientSession, url: str) -> bool | None:
        """True ready, False not ready, None timed out (inconclusive)."""
        try:
            async with session.get(url + self._path, timeout=self._timeout, allow_redirects=False) as resp:
                return 200 <= resp.status < 300
        except TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False


class FileRoutesSource(RoutesSource):
    """The routes table from a .json/.toml file, reloaded when it changes (polled every
    `poll_s`: a stat each poll, a read when mtime or size moved). A file that fails to parse or
    disappears keeps the last good table in force; the error is in `last_error` and logged
    once per distinct message."""

    def __init__(self, path: str | os.PathLike[str], router: Router, *, poll_s: float = 1.0):
        if not poll_s > 0:
            raise ValueError("poll_s must be > 0")
        self._path = Path(path)
        self._format = routes_format(self._path)
        self._router = router
        self._poll = poll_s
        self._task: asyncio.Task[None] | None = None
        # (mtime_ns, size) at the last read attempt; None after a failed read.
        self._seen: tuple[int, int] | None = None
        self._digest: str | None = None
        self._revision: str | None = None
        self._last_error: str | None = None
        self._logged_error: str | None = None
        self.loaded_at: float | None = None  # time.time() of the last applied table

    @property
    def revision(self) -> str | None:
        return self._revision

    @property
    def last_error(self) -> str | None:
        return self._last_error

    async def start(self) -> None:
        """Load the file once (RoutesError if it is missing or invalid: the gateway must not
        start without routes), then watch it."""
        stat, data = await asyncio.to_thread(self._read)
        table = await asyncio.to_thread(parse_routes_bytes, data, self._format, source=str(self._path))
        self._apply(stat, data, table)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="paved-gateway-routes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def reload_now(self) -> bool:
        """Read and apply the file now whatever its stat says; True if the table changed."""
        return await self._check(force=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll)
            try:
                await self._check(force=False)
            except Exception:  # keep watching; the table in force stays
                logger.exception("routes reload of %s failed", self._path)

    def _read(self) -> tuple[tuple[int, int], bytes]:
        try:
            with open(self._path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > MAX_FILE_BYTES:
                    raise RoutesError(f"{self._path}: larger than {MAX_FILE_BYTES} bytes")
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            raise RoutesError(f"{self._path}: routes file not found") from None
        except OSError as e:
            raise RoutesError(f"{self._path}: cannot read ({e.strerror or e})") from None
        return (st.st_mtime_ns, st.st_size), data

    def _stat_now(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    async def _check(self, *, force: bool) -> bool:
        # Unchanged since the last attempt (good or bad, or still missing): nothing to do.
        if not force and await asyncio.to_thread(self._stat_now) == self._seen:
            return False
        try:
            stat, data = await asyncio.to_thread(self._read)
        except RoutesError as e:
            self._seen = None
            self._error(str(e))
            return False
        self._seen = stat
        if hashlib.sha256(data).hexdigest() == self._digest:
            self._recovered()
            return False
        try:
            table = await asyncio.to_thread(parse_routes_bytes, data, self._format, source=str(self._path))
        except RoutesError as e:
            self._error(str(e))
            return False
        return self._apply(stat, data, table)

    def _apply(self, stat: tuple[int, int], data: bytes, table: RoutesTable) -> bool:
        self._seen = stat
        self._digest = hashlib.sha256(data).hexdigest()
        self._recovered()
        if table.revision == self._revision:
            return False
        previous = self._revision
        self._router.set_table(table)
        self._revision = table.revision
        self.loaded_at = time.time()
        logger.info(
            "routes %s: revision %s -> %s (%d models)",
            self._path,
            previous,
            table.revision,
            len(table.models),
        )
        return True

    def _recovered(self) -> None:
        if self._last_error is not None:
            logger.info("routes %s: readable again (revision %s in force)", self._path, self._revision)
        self._last_error = None
        self._logged_error = None

    def _error(self, message: str) -> None:
        self._last_error = message
        if message != self._logged_error:
            logger.warning("%s; keeping routes revision %s", message, self._revision)
            self._logged_error = message
