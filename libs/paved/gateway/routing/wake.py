"""Waking a model scaled to zero: the gateway's demand signal to the control plane, a call to
its `POST /v1/models/{model}/wake` (the same control plane, and the same bearer token, as the
routes feed the gateway follows).

Invariants:
- At most one wake loop per model: the first request held for a model at zero starts it, later
  ones find it running. It calls at once, then every `every_s` while `wanted()` (requests are
  still held for the model and it is still at zero), so the control plane keeps seeing the
  demand and a wake lost to a control-plane restart is repeated; it ends once `wanted()` is
  false.
- Every call has a deadline (`timeout_s`) and its outcome is counted
  (`paved_gateway_wake_calls_total{model, outcome}`); a failure is logged once per outage and
  retried at the next period, never raised to a request (the held request's own deadline
  bounds its wait).
- The wake endpoint is idempotent, so several gateway replicas (or one replica's repeated
  calls) waking one model make one scale-up.
- `close` cancels every loop and closes the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

import aiohttp

if TYPE_CHECKING:
    from paved.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)


def wake_url(routes_url: str, model: str) -> str:
    """The wake endpoint of the control plane whose routes feed is `routes_url` (its
    `.../v1/routes`, as `watch_source.routes_url` spells it)."""
    parts = urlsplit(routes_url)
    prefix = parts.path[: -len("/routes")] if parts.path.endswith("/v1/routes") else "/v1"
    return urlunsplit((parts.scheme, parts.netloc, f"{prefix}/models/{quote(model, safe='')}/wake", "", ""))


class WakeCaller:
    def __init__(
        self,
        routes_url: str,
        *,
        token: str | None,
        metrics: GatewayMetrics | None = None,
        timeout_s: float = 5.0,
        every_s: float = 1.0,
    ):
        if not 0 < timeout_s <= 60:
            raise ValueError("timeout_s must be in (0, 60]")
        if not 0 < every_s <= 60:
            raise ValueError("every_s must be in (0, 60]")
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise ValueError("token must be a non-empty single line")
        self._routes_url = routes_url
        self._token = token
        self._metrics = metrics
        self._timeout = timeout_s
        self._every = every_s
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[str] = set()
        self._closed = False

    def wake(self, model: str, wanted: Callable[[], bool]) -> None:
        """Start `model`'s wake loop unless it runs (never blocks, never raises)."""
        running = self._loops.get(model)
        if self._closed or (running is not None and not running.done()):
            return
        self._loops[model] = asyncio.get_running_loop().create_task(
            self._loop(model, wanted), name=f"paved-gateway-wake-{model}"
        )

    def waking(self, model: str) -> bool:
        loop = self._loops.get(model)
        return loop is not None and not loop.done()

    async def close(self) -> None:
        self._closed = True
        loops, self._loops = list(self._loops.values()), {}
        for task in loops:
            task.cancel()
        for task in loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self, model: str, wanted: Callable[[], bool]) -> None:
        while True:
            await self.call(model)
            await asyncio.sleep(self._every)
            if not wanted():
                return

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._session = aiohttp.ClientSession(headers=headers, trust_env=False)
        return self._session

    async def call(self, model: str) -> bool:
        """One wake call; True when the control plane accepted it."""
        url = wake_url(self._routes_url, model)
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        error: str | None = None
        try:
            async with self._client().post(url, timeout=timeout, allow_redirects=False) as resp:
                await resp.content.read(64 * 1024)
                if resp.status != 200:
                    error = f"HTTP {resp.status}"
        except TimeoutError:
            error = f"no answer within {self._timeout:g} s"
        except (aiohttp.ClientError, OSError) as e:
            error = f"{type(e).__name__}: {e}"
        if self._metrics is not None:
            self._metrics.wake_calls.labels(model, "ok" if error is None else "error").inc()
        if error is None:
            if model in self._failing:
                self._failing.discard(model)
                logger.info("wake of %s: the control plane answers again", model)
            return True
        if model not in self._failing:
            self._failing.add(model)
            logger.warning(
                "wake of %s at %s failed (%s); retrying while requests are held", model, url, error
            )
        return False
