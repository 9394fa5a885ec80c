"""The routes table from the control plane: a long poll of its `GET /v1/routes?after=N`.

The control plane answers at once when its latest revision is newer than N, else holds the
request until one is published or `timeout_s` passes (204). The gateway never depends on the
control plane to keep serving: an error, a timeout or an invalid table keeps the table in force
(reported in `last_error`, retried with capped exponential backoff), and with `cache_file` the
last table received survives a gateway restart while the control plane is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from paved.bodies import read_at_most
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import MAX_FILE_BYTES, RoutesError, RoutesSource, RoutesTable, parse_routes

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
# Slack on top of the server-side wait before the client gives up on an answer.
_DEADLINE_SLACK_S = 10.0
# How long stop() waits for a cache write under way.
_SAVE_WAIT_S = 10.0


class _InvalidTable(RoutesError):
    def __init__(self, revision: int, message: str):
        super().__init__(message)
        self.revision = revision


def routes_url(url: str) -> str:
    """The feed endpoint for `--routes URL`: a bare base (http://host:port) gets /v1/routes."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise RoutesError(f"{url!r} is not a valid URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RoutesError(f"routes URL must be http(s)://host[:port][/path], got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise RoutesError("routes URL must not carry credentials (use --routes-token)")
    if parts.query or parts.fragment:
        raise RoutesError(f"routes URL must have no query or fragment, got {url!r}")
    if parts.path in ("", "/"):
        return url.rstrip("/") + "/v1/routes"
    return url


class HttpRoutesSource(RoutesSource):
    """Follows the control plane's routes feed at `url` (see `routes_url`), installing each new
    table into `router`.

    Invariants: the router always holds the last valid table received (or loaded from the
    cache at start); `last_error` is None exactly when the last exchange with the control plane
    succeeded; `feed_revision` is the control plane's revision of the table in force."""

    def __init__(
        self,
        url: str,
        router: Router,
        *,
        token: str | None = None,
        timeout_s: float = 25.0,
        retry_s: float = 1.0,
        cache_file: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 10.0,
    ):
        if not 0 < timeout_s <= 55:
            raise ValueError("timeout_s must be in (0, 55]")
        if not 0 < retry_s <= MAX_BACKOFF_S:
            raise ValueError(f"retry_s must be in (0, {MAX_BACKOFF_S:g}]")
        if not start_timeout_s > 0:
            raise ValueError("start_timeout_s must be > 0")
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise ValueError("token must be a non-empty single line")
        self._url = routes_url(url)
        self._router = router
        self._token = token
        self._timeout = timeout_s
        self._retry = retry_s
        self._cache = Path(cache_file) if cache_file is not None else None
        self._start_timeout = start_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._revision: str | None = None
        self._feed_revision: int | None = None
        self._last_error: str | None = None
        self._logged_error: str | None = None
        self._failures = 0
        self._resync = False
        self._bad: int | None = None  # revision of the latest table, when it was invalid
        self._from_cache = False  # the table in force came from cache_file, not the feed
        self._saved: tuple[int, str] | None = None  # what the cache file holds
        self._saving: asyncio.Future[None] | None = None  # the cache write under way
        self.loaded_at: float | None = None  # time.time() of the last applied table

    @property
    def url(self) -> str:
        return self._url

    @property
    def revision(self) -> str | None:
        return self._revision

    @property
    def feed_revision(self) -> int | None:
        return self._feed_revision

    @property
    def last_error(self) -> str | None:
        return self._last_error

    async def start(self) -> None:
        """Get the first table: from the control plane within start_timeout_s, else from the
        cache file, else RoutesError (a gateway with no routes must not start)."""
        deadline = time.monotonic() + self._start_timeout
        while True:
            wait_s = max(0.0, min(deadline - time.monotonic(), self._timeout))
            try:
                # The client deadline is tight too: a black-holed control plane must not hold
                # the gateway's start much past start_timeout_s.
                if await self._poll_once(after=0, wait_s=wait_s, slack_s=2.0):
                    break
                self._error("the control plane has published no routes table yet")
            except RoutesError as e:
                self._error(str(e))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self._start_from_cache()
                break
            await asyncio.sleep(min(self._retry, remaining))
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="paved-gateway-routes-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        saving, self._saving = self._saving, None
        if saving is not None:
            # A cache write cut off by stop() would leave the file one table behind the one in
            # force: the next start offline would serve the older table. Bounded: a hung disk
            # must not hold the gateway's shutdown.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(saving), _SAVE_WAIT_S)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _start_from_cache(self) -> None:
        reason = self._last_error or "no answer"
        if self._cache is None:
            raise RoutesError(f"{self._url}: no routes table within {self._start_timeout:g} s ({reason})")
        try:
            data = await asyncio.to_thread(_read_bounded, self._cache)
        except FileNotFoundError:
            raise RoutesError(
                f"{self._url}: no routes table within {self._start_timeout:g} s ({reason}) "
                f"and no cache at {self._cache}"
            ) from None
        except OSError as e:
            raise RoutesError(f"{self._cache}: cannot read the routes cache ({e.strerror or e})") from None
        revision, table = await asyncio.to_thread(self._decode, data, source=f"routes cache {self._cache}")
        await self._install(revision, table, save=False)
        self._resync = True
        self._from_cache = True
        logger.warning(
            "routes: control plane %s unreachable (%s); serving cached revision %s from %s",
            self._url,
            reason,
            revision,
            self._cache,
        )
        self._error(reason)

    async def _loop(self) -> None:
        while True:
            # After a transport error, ask for the latest whatever its revision: a control
            # plane whose database was rebuilt restarts its revisions below ours. After an
            # invalid table, wait for the next revision (that one will not become valid).
            if self._bad is not None:
                after = self._bad
            elif self._resync or self._feed_revision is None:
                after = 0
            else:
                after = self._feed_revision
            began = time.monotonic()
            try:
                got = await self._poll_once(after=after, wait_s=self._timeout)
            except _InvalidTable as e:
                self._bad = e.revision
                self._error(str(e))
                got = True
            except RoutesError as e:
                self._error(str(e))
                self._failures += 1
                self._resync = True
                self._bad = None
                await asyncio.sleep(min(MAX_BACKOFF_S, self._retry * 2 ** min(self._failures - 1, 10)))
                continue
            except Exception as e:  # a bug must not end the watch; the table in force stays
                logger.exception("routes watch of %s failed", self._url)
                self._error(f"internal error: {type(e).__name__}")
                self._failures += 1
                await asyncio.sleep(MAX_BACKOFF_S)
                continue
            # A server that answers a long poll at once with nothing new (204, or the
            # revision we asked to pass) would make this a busy loop: pace it.
            stale = got and after != 0 and (self._bad or self._feed_revision or 0) <= after
            quick = time.monotonic() - began < min(1.0, self._timeout / 2)
            if (not got or stale) and quick:
                await asyncio.sleep(self._retry)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._session = aiohttp.ClientSession(headers=headers, trust_env=False)
        return self._session

    async def _poll_once(self, *, after: int, wait_s: float, slack_s: float = _DEADLINE_SLACK_S) -> bool:
        """One request; True if a table came (applied or equal to the one in force), False on
        204. RoutesError on any failure (transport, status, body, invalid table)."""
        params = {"after": str(after), "timeout_s": f"{wait_s:.3f}"}
        timeout = aiohttp.ClientTimeout(total=wait_s + slack_s, connect=min(5.0, wait_s + slack_s))
        try:
            async with self._client().get(
                self._url, params=params, timeout=timeout, allow_redirects=False
            ) as resp:
                status = resp.status
                data = await read_at_most(resp.content, MAX_FILE_BYTES + 1)
        except TimeoutError:
            raise RoutesError(f"{self._url}: no answer within {wait_s + slack_s:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise RoutesError(f"{self._url}: {type(e).__name__}: {e}") from None
        if status == 204:
            if self._from_cache:
                self._error("the control plane has published no routes table yet")
            elif self._bad is None:  # else the latest table is still the invalid one
                self._ok()
            return False
        if status != 200:
            raise RoutesError(f"{self._url}: HTTP {status}: {_error_message(data)}")
        # A table of thousands of backends takes a few hundred ms to validate: not on the loop.
        revision, table = await asyncio.to_thread(self._decode, data, source=self._url)
        self._ok()
        self._resync = False
        self._bad = None
        self._from_cache = False
        await self._install(revision, table, save=True)
        return True

    def _decode(self, data: bytes, *, source: str) -> tuple[int, RoutesTable]:
        if len(data) > MAX_FILE_BYTES:
            raise RoutesError(f"{source}: larger than {MAX_FILE_BYTES} bytes")
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise RoutesError(f"{source}: invalid JSON ({e})") from None
        if not isinstance(obj, dict) or set(obj) != {"revision", "table"}:
            raise RoutesError(f'{source}: expected {{"revision": N, "table": {{...}}}}')
        revision = obj["revision"]
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise RoutesError(f"{source}: revision must be a positive integer")
        try:
            table = parse_routes(obj["table"])
        except RoutesError as e:
            raise _InvalidTable(revision, f"{source}: revision {revision}: {e}") from None
        return revision, table

    async def _install(self, feed_revision: int, table: RoutesTable, *, save: bool) -> None:
        previous = self._revision
        self._feed_revision = feed_revision
        if table.revision != previous:
            self._router.set_table(table)
            self._revision = table.revision
            self.loaded_at = time.time()
            logger.info(
                "routes %s: revision %s -> %s (control plane %d, %d models)",
                self._url,
                previous,
                table.revision,
                feed_revision,
                len(table.models),
            )
        if save and self._cache is not None and (feed_revision, table.revision) != self._saved:
            self._saving = asyncio.ensure_future(asyncio.to_thread(_save, self._cache, feed_revision, table))
            try:
                await asyncio.shield(self._saving)  # stop() waits for it; its cancel does not cut it
                self._saved = (feed_revision, table.revision)
            except OSError as e:  # the cache is a convenience; serving goes on without it
                logger.warning("routes cache %s not written: %s", self._cache, e.strerror or e)

    def _ok(self) -> None:
        if self._last_error is not None:
            logger.info("routes %s: reachable again (revision %s in force)", self._url, self._revision)
        self._last_error = None
        self._logged_error = None
        self._failures = 0

    def _error(self, message: str) -> None:
        if self._from_cache:
            message += f"; serving the cached table (control-plane revision {self._feed_revision})"
        self._last_error = message
        if message != self._logged_error:
            logger.warning("%s; keeping routes revision %s", message, self._revision)
            self._logged_error = message


def _save(path: Path, feed_revision: int, table: RoutesTable) -> None:
    # Atomic: a gateway starting from the cache never reads half a file.
    data = json.dumps({"revision": feed_revision, "table": table.to_obj()}).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read_bounded(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(MAX_FILE_BYTES + 1)


def _error_message(data: bytes) -> str:
    """The control plane's error message (its OpenAI-style body), bounded for logs."""
    try:
        obj: Any = json.loads(data)
        message = obj["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data[:200].decode(errors="replace")
    return str(message)[:300]
