"""The batch runner: one per gateway replica; any replica runs any batch.

Each tick it (1) commits the answers gathered since the last one (one transaction), (2) renews
the leases of the lines it holds, (3) abandons the lines of batches that were cancelled or ran
past their window, (4) leases more lines while the batch's model has headroom: `concurrency` to
run plus half as many ahead, so that a line that ends starts the next one at once, between
ticks, (5) writes the answers it committed into output chunks in the object store, and (6)
finalizes batches whose lines are all answered (or that were cancelled or expired): the
committed chunks are concatenated into the output and error files, published with the final
status. A batch whose lines ran out is finalized by the tick after this replica's last answer
for it is committed, not at the next once-a-second maintenance round. Every `sweep_s` it also
deletes finished batches older than `retention_s` (see `_sweep`).

Chunks: the output lines this replica committed are kept in memory per batch (at most
4 x `chunk_lines`; past that they wait in their rows for the finalizer) and written as one
chunk every `chunk_lines` lines or `chunk_s` seconds, one chunk write at a time, off the tick.
The finalizer chunks whatever is still in rows (lines of a dead replica, the last few), so the
files are assembled from the object store alone and the database never holds a batch's whole
output; a restart re-does only lines that were never settled (store.py has the invariants).

A line is sent through the gateway's own request path (`OpenAIProxy.forward` with the batch
creator's principal), so the same router, limits, orchestration (templates, exact cache) and
flow queue apply, in the queue's lowest class (`background`): interactive requests queued for
the model always go first. On top of that a line is only leased when the model has headroom:
nobody waits in the model's queue on this replica, the router's fresh engine gauges do not read
every backend full (`Router.saturated`), this replica runs fewer than `concurrency` lines, and
the tenant's batch tokens in the last minute on this replica are under `token_share` of its
tokens/min limit. Those tokens are counted over every replica: each group of answers commits
its tokens with it (`batch_token_use` in the shared state database) and each maintenance round
reads the tenants' sums back, so N replicas together stay under the share (between two reads a
replica adds what it answered itself).

Invariants: a line's outcome is committed only under its current lease (paved.gateway.batches
.store), so a replica killed mid-batch loses nothing (its leases expire after `lease_s` and
another replica re-runs those lines) and no custom_id is answered twice; 429 / 5xx answers are
retried with backoff up to `max_attempts` leases, then kept as the line's (failed) answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge
from starlette.requests import Request

from paved.gateway.access.auth import live_principal
from paved.gateway.batches.objects import ObjectStore
from paved.gateway.batches.store import SETTLED, BatchStore, Chunk, Lease, chunk_prefix, new_id, output_line
from paved.gateway.errors import GatewayError
from paved.gateway.types import Principal

if TYPE_CHECKING:
    from paved.gateway.access.state import GatewayStore
    from paved.gateway.forwarding.proxy import OpenAIProxy

logger = logging.getLogger("paved.gateway.batches")

_RETRYABLE = frozenset((429, 499, 500, 502, 503, 504))
LINE_ERRORS = {
    "cancelled": {
        "code": "batch_cancelled",
        "message": "This request was not executed: the batch was cancelled.",
    },
    "expired": {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    },
}
# metadata["paved_cache"] -> the Cache-Control a batch's lines are sent with (see docs).
CACHE_MODES = {"off": "no-store", "write": None, "refresh": "no-cache"}


@dataclass(frozen=True)
class RunnerConfig:
    poll_s: float = 0.2
    lease_s: float = 30.0
    # Lines this replica runs at once, over every batch.
    concurrency: int = 32
    max_attempts: int = 20
    # Of a tenant's tokens/min limit, what its batches may use (all replicas together).
    token_share: float = 0.5
    stats_every_s: float = 5.0
    # Abandoning lines of cancelled / expired batches and finalizing finished ones: this often.
    maintenance_s: float = 1.0
    # An output chunk is written every `chunk_lines` committed lines or `chunk_s` seconds.
    chunk_lines: int = 1000
    chunk_s: float = 10.0
    # Finished batches (and their output / error files) are deleted this long after finishing,
    # checked every `sweep_s`, at most `sweep_batches` per sweep.
    retention_s: float = 30 * 24 * 3600.0
    sweep_s: float = 60.0
    sweep_batches: int = 20


class BatchMetrics:
    def __init__(self, registry: Any):
        self.lines = Counter(
            "paved_gateway_batch_lines",
            "Batch lines settled by this replica, by tenant, model and outcome (done, failed, retried)",
            ("tenant", "model", "status"),
            registry=registry,
        )
        self.in_flight = Gauge(
            "paved_gateway_batch_in_flight",
            "Batch lines this replica is running",
            ("tenant", "model"),
            registry=registry,
        )
        self.states = Gauge(
            "paved_gateway_batch_line_states",
            "Lines of active batches (all replicas, from the database), by tenant, model and state",
            ("tenant", "model", "state"),
            registry=registry,
        )
        self.queue_age = Gauge(
            "paved_gateway_batch_queue_age_seconds",
            "Age of the oldest line still pending in an active batch, by tenant and model",
            ("tenant", "model"),
            registry=registry,
        )


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        objects: ObjectStore,
        proxy: OpenAIProxy,
        accounts: GatewayStore,
        metrics: BatchMetrics,
        config: RunnerConfig | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.objects = objects
        self.proxy = proxy
        self.accounts = accounts
        self.metrics = metrics
        self.config = config or RunnerConfig()
        self.clock = clock
        self.owner = new_id("runner")
        self._tasks: dict[tuple[str, int], tuple[asyncio.Task[None], str]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._principals: dict[str, tuple[float, Principal | None]] = {}
        # Batch tokens per tenant: last minute over all replicas as last read (`_shared`),
        # answered here since that read (`_local`), answered here and not yet committed.
        self._shared_tokens: dict[str, float] = {}
        self._local_tokens: dict[str, int] = {}
        self._pending_tokens: dict[str, int] = {}
        # Committed output lines not yet in a chunk, per batch: (line_no, state, line); when
        # the first of them came; the chunk being written.
        self._chunk_buf: dict[str, list[tuple[int, str, str]]] = {}
        self._chunk_since: dict[str, float] = {}
        self._chunk_task: asyncio.Task[bool] | None = None
        self._swept = 0.0
        # Lines leased ahead, started the moment a running line ends (see _lease).
        self._ready: deque[tuple[dict[str, Any], Lease]] = deque()
        # Batches whose last lease came back short: finalized as soon as this replica holds
        # none of their lines, not at the next maintenance round.
        self._draining: set[str] = set()
        self._stopping = False
        self._renewed = 0.0
        self._stats_at = 0.0
        self._stats_keys: set[tuple[str, ...]] = set()
        self._maintained = 0.0
        # Answers not yet committed: (lease, state, output line, retry at, tenant, model).
        self._outcomes: list[tuple[Lease, str, str | None, float, str, str]] = []

    async def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._loop())

    def wake(self) -> None:
        """Run the next tick now (a batch was created on this replica)."""
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        for task, _ in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*(t for t, _ in self._tasks.values()), return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._flush()
        if self._chunk_task is not None:
            # Uncommitted, the chunk is ignored: its lines are still in their rows.
            self._chunk_task.cancel()
            await asyncio.gather(self._chunk_task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._release(list(self._ready))

    async def _loop(self) -> None:
        while True:
            # Cleared before the tick: a wake during it (an answer, a batch created) is kept.
            self._wake.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch runner tick failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)
            # Answers arriving together are committed together (their slots were refilled from
            # the lines leased ahead as each ended).
            await asyncio.sleep(0.02)

    async def tick(self) -> None:
        """One round: renew, abandon, lease, finalize (tests drive it directly)."""
        now = self.clock()
        cfg = self.config
        await self._flush()
        held = {k[0] for k in self._tasks} | {lease.batch_id for _, lease in self._ready}
        held |= {o[0].batch_id for o in self._outcomes}
        drained = self._draining - held
        self._draining -= drained
        if now - self._renewed >= cfg.lease_s / 3:
            await self._renew_line_leases(now)
        maintain = now - self._maintained >= cfg.maintenance_s or now < self._maintained
        if maintain:
            self._maintained = now
            await self._abandon(now)
            self._shared_tokens = await self.store.token_use(now)
            self._local_tokens = dict(self._pending_tokens)
        await self._lease(now)
        self._chunk(now)
        if maintain or drained:
            await self._finalize(now)
        if maintain and (now - self._swept >= cfg.sweep_s or now < self._swept):
            self._swept = now
            await self._sweep(now)
        if now - self._stats_at >= cfg.stats_every_s:
            self._stats_at = now
            await self._stats(now)

    # -- leasing and running ---------------------------------------------------------------

    async def _abandon(self, now: float) -> None:
        ids = {b for b, _ in self._tasks} | {lease.batch_id for _, lease in self._ready}
        if not ids:
            return
        states = await self.store.batch_states(ids)
        gone = {b for b in ids if b not in states or states[b][0] != "in_progress" or states[b][1] <= now}
        if not gone:
            return
        for key, (task, _) in list(self._tasks.items()):
            if key[0] in gone:
                task.cancel()
        dropped = [(b, lease) for b, lease in self._ready if lease.batch_id in gone]
        self._ready = deque((b, lease) for b, lease in self._ready if lease.batch_id not in gone)
        await self._release(dropped)

    async def _release(self, leased: list[tuple[dict[str, Any], Lease]]) -> None:
        """Lines leased ahead but not started: back to pending for whoever runs them (their
        lease still counts toward `max_attempts`, as any lease does)."""
        if leased:
            await self.store.settle_many(self.owner, [(lease, "pending", None, 0.0) for _, lease in leased])

    async def _lease(self, now: float) -> None:
        """Lease up to `concurrency` lines to run plus `concurrency // 2` ahead.

        The lines leased ahead are what keeps the runner's slots full: a line that ends starts
        the next one at once (`_done`), with no database round trip and no wait for a tick,
        while the tick refills the reserve in groups (one lease transaction for several lines).
        Lines ahead are leased like running ones (renewed, released on cancel, expiry and
        stop; a crash leaves them to lease expiry), so the reserve is kept small: at a batch's
        end another replica may wait on this one's reserve."""
        cfg = self.config
        ahead = max(1, cfg.concurrency // 2)
        want = cfg.concurrency + ahead - len(self._tasks) - len(self._ready)
        idle = not self._tasks and not self._ready
        if want > 0 and (idle or want >= max(1, ahead // 2)):
            for batch in await self.store.runnable(now):
                if want <= 0:
                    break
                if not self._has_headroom(batch, now):
                    continue
                leases = await self.store.lease(batch["id"], self.owner, want, now, cfg.lease_s)
                if leases and not self._renewed:
                    self._renewed = now
                if len(leases) < want:
                    self._draining.add(batch["id"])
                self._ready.extend((batch, lease) for lease in leases)
                want -= len(leases)
        self._start_ready(now)

    def _start_ready(self, now: float) -> None:
        """Start lines leased ahead while this replica runs fewer than `concurrency` and their
        batch has headroom (in order; a batch without headroom keeps its lines)."""
        if self._stopping or not self._ready or len(self._tasks) >= self.config.concurrency:
            return
        held: set[str] = set()
        kept: deque[tuple[dict[str, Any], Lease]] = deque()
        while self._ready and len(self._tasks) < self.config.concurrency:
            batch, lease = self._ready.popleft()
            if batch["id"] in held or not self._has_headroom(batch, now):
                held.add(batch["id"])
                kept.append((batch, lease))
                continue
            key = (lease.batch_id, lease.line_no)
            task = asyncio.ensure_future(self._run(batch, lease))
            self._tasks[key] = (task, batch["tenant"])
            self.metrics.in_flight.labels(batch["tenant"], batch["model"]).inc()
            task.add_done_callback(functools.partial(self._done, key, batch))
        kept.extend(self._ready)
        self._ready = kept

    def _done(self, key: tuple[str, int], batch: dict[str, Any], _task: object) -> None:
        self._tasks.pop(key, None)
        self.metrics.in_flight.labels(batch["tenant"], batch["model"]).dec()
        self._start_ready(self.clock())
        self._wake.set()

    def _has_headroom(self, batch: dict[str, Any], now: float) -> bool:
        model = batch["model"]
        alias, _ = self.proxy.router.split_model(model)
        flow = self.proxy.flow
        if flow is not None and flow.enabled and flow.depth(alias) > 0:
            return False
        try:
            if self.proxy.router.saturated(model, sticky_key=batch["key_id"]):
                return False
        except GatewayError:
            pass  # an unknown model: its lines fail with the interactive path's 404
        cached = self._principals.get(batch["key_id"])
        principal = cached[1] if cached is not None else None
        tpm = principal.tenant.limits.tokens_per_min if principal is not None else None
        return tpm is None or self.tokens_used(batch["tenant"]) < tpm * self.config.token_share

    def tokens_used(self, tenant: str) -> float:
        """The tenant's batch tokens in the last minute, over every replica: the shared count
        as of the last maintenance round plus what this replica answered since."""
        return self._shared_tokens.get(tenant, 0.0) + self._local_tokens.get(tenant, 0)

    async def _principal(self, key_id: str, now: float) -> Principal | None:
        cached = self._principals.get(key_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = await live_principal(self.accounts, key_id, now)
        self._principals[key_id] = (now + 5.0, principal)
        return principal

    async def _run(self, batch: dict[str, Any], lease: Lease) -> None:
        tenant, model = batch["tenant"], batch["model"]
        try:
            status, request_id, body, retry_after = await self._send(batch, lease)
        except asyncio.CancelledError:
            # Abandoned (cancel, expiry, shutdown): back to pending for whoever finalizes or
            # resumes; shielded so the lease is not left to expire needlessly.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.settle(lease, self.owner, "pending", None))
            raise
        except Exception as e:  # never let one line kill the runner
            logger.exception("batch %s line %d failed in the gateway", lease.batch_id, lease.line_no)
            status, request_id, body, retry_after = 500, "", {"error": {"message": type(e).__name__}}, None
        now = self.clock()
        if status in _RETRYABLE and lease.attempt < self.config.max_attempts:
            backoff = retry_after if retry_after is not None else min(30.0, 0.5 * 2 ** min(lease.attempt, 6))
            self._outcomes.append((lease, "pending", None, now + backoff, tenant, model))
            return
        state = "done" if status == 200 else "failed"
        line = output_line(lease.batch_id, lease.line_no, lease.custom_id, status, request_id, body)
        self._outcomes.append((lease, state, line, 0.0, tenant, model))

    async def _flush(self) -> None:
        """Commit the answers gathered since the last tick, and their tokens, in one
        transaction; the output lines committed go to the batch's next chunk."""
        if not self._outcomes and not self._pending_tokens:
            return
        batch, self._outcomes = self._outcomes, []
        tokens, self._pending_tokens = self._pending_tokens, {}
        now = self.clock()
        try:
            ours = await self.store.settle_many(
                self.owner, [(o[0], o[1], o[2], o[3]) for o in batch], tokens=tokens, now=now
            )
        except BaseException:
            # The database was unreachable: next tick.
            self._outcomes = batch + self._outcomes
            for tenant, n in tokens.items():
                self._pending_tokens[tenant] = self._pending_tokens.get(tenant, 0) + n
            raise
        most = 4 * self.config.chunk_lines
        for (lease, state, line, _, tenant, model), kept in zip(batch, ours, strict=True):
            if not kept:
                continue
            self.metrics.lines.labels(tenant, model, "retried" if state == "pending" else state).inc()
            if state in SETTLED and line is not None:
                buf = self._chunk_buf.setdefault(lease.batch_id, [])
                if len(buf) < most:  # else the finalizer chunks it from its row
                    self._chunk_since.setdefault(lease.batch_id, now)
                    buf.append((lease.line_no, state, line))

    async def _send(self, batch: dict[str, Any], lease: Lease) -> tuple[int, str, Any, float | None]:
        now = self.clock()
        principal = await self._principal(batch["key_id"], now)
        request_id = f"batch_req_{lease.batch_id.removeprefix('batch_')}_{lease.line_no}"
        if principal is None:
            message = "the API key that created this batch was revoked or expired"
            body = {"error": {"message": message, "type": "invalid_request_error", "code": "revoked_api_key"}}
            return 401, request_id, body, None
        headers = [
            (b"content-type", b"application/json"),
            (b"x-paved-priority", b"background"),
            (b"x-request-id", request_id.encode()),
        ]
        meta = batch.get("metadata") or {}
        cache_control = CACHE_MODES.get(str(meta.get("paved_cache", "off")), "no-store")
        if cache_control is not None:
            headers.append((b"cache-control", cache_control.encode()))
        payload = json.dumps(lease.body, ensure_ascii=False, separators=(",", ":")).encode()
        endpoint = batch["endpoint"]
        from paved.gateway.batches.validate import ENDPOINTS

        response = await self.proxy.forward(
            _request(endpoint, headers, payload), ENDPOINTS[endpoint], endpoint, principal=principal
        )
        raw = bytes(getattr(response, "body", b"") or b"")
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = {"error": {"message": "the backend's answer was not JSON"}}
        if response.status_code == 200 and isinstance(answer, dict):
            usage = answer.get("usage")
            used = usage.get("total_tokens") if isinstance(usage, dict) else None
            if isinstance(used, int) and used > 0:
                tenant = batch["tenant"]
                self._pending_tokens[tenant] = self._pending_tokens.get(tenant, 0) + used
                self._local_tokens[tenant] = self._local_tokens.get(tenant, 0) + used
        wait = _retry_after_s(response.headers.get("retry-after"))
        return response.status_code, response.headers.get("x-request-id", request_id), answer, wait

    # -- output chunks ---------------------------------------------------------------------

    def _chunk(self, now: float) -> None:
        """Start writing the next chunk of committed output lines (one write at a time, off
        the tick): a batch with `chunk_lines` of them, or with any waiting `chunk_s`."""
        if self._chunk_task is not None and not self._chunk_task.done():
            return
        cfg = self.config
        for batch_id, buf in self._chunk_buf.items():
            if len(buf) >= cfg.chunk_lines or now - self._chunk_since[batch_id] >= cfg.chunk_s:
                lines, rest = buf[: cfg.chunk_lines], buf[cfg.chunk_lines :]
                if rest:
                    self._chunk_buf[batch_id] = rest
                    self._chunk_since[batch_id] = now
                else:
                    del self._chunk_buf[batch_id]
                    del self._chunk_since[batch_id]
                self._chunk_task = asyncio.ensure_future(self._write_chunk_logged(batch_id, lines))
                return

    async def _write_chunk_logged(self, batch_id: str, lines: list[tuple[int, str, str]]) -> bool:
        try:
            return await self.write_chunk(batch_id, lines)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The lines keep their results in their rows: the finalizer chunks them.
            logger.exception("batch %s: an output chunk could not be written", batch_id)
            return False

    async def write_chunk(self, batch_id: str, lines: list[tuple[int, str, str]]) -> bool:
        """Write these settled lines as one chunk object, then commit it (store.commit_chunk);
        False, and the object deleted, when another runner chunked some of them first."""
        chunk_id = new_id("chunk")
        key = f"{chunk_prefix(batch_id)}chunks/{chunk_id}"
        fd, path = tempfile.mkstemp(prefix="paved-chunk-")

        def write() -> tuple[int, int, int, int]:
            out_lines = out_bytes = err_lines = err_bytes = 0
            with os.fdopen(fd, "wb") as f:
                # Output lines first, then error lines: the chunk splits at `out_bytes`.
                for _, state, line in lines:
                    if state == "done":
                        data = line.encode() + b"\n"
                        f.write(data)
                        out_lines, out_bytes = out_lines + 1, out_bytes + len(data)
                for _, state, line in lines:
                    if state != "done":
                        data = line.encode() + b"\n"
                        f.write(data)
                        err_lines, err_bytes = err_lines + 1, err_bytes + len(data)
            return out_lines, out_bytes, err_lines, err_bytes

        try:
            counts = await asyncio.to_thread(write)
            await self.objects.put_file(key, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        chunk = Chunk(chunk_id, key, *counts)
        if await self.store.commit_chunk(batch_id, chunk, [n for n, _, _ in lines], self.clock()):
            return True
        with contextlib.suppress(Exception):
            await self.objects.delete(key)
        return False

    async def _chunk_rest(self, batch_id: str) -> None:
        """Chunk every settled line of the batch still holding its output in its row."""
        self._chunk_buf.pop(batch_id, None)  # they are in the rows too: read from there
        self._chunk_since.pop(batch_id, None)
        lost = 0
        while rows := await self.store.unchunked(batch_id, self.config.chunk_lines):
            if not await self.write_chunk(batch_id, rows):
                # Another runner chunked some of these lines meanwhile: read again.
                lost += 1
                if lost > 10:
                    raise RuntimeError(f"batch {batch_id}: lost 10 chunk races in a row")

    # -- finalization ----------------------------------------------------------------------

    async def _finalize(self, now: float) -> None:
        for ready in await self.store.to_finalize(now):
            batch_id = ready["id"]
            final = await self.store.begin_finalize(
                batch_id, self.owner, now, self.config.lease_s * 4, LINE_ERRORS
            )
            if final is None:
                continue
            batch = await self.store.get_batch(None, batch_id)
            # Assembling a large batch's files can outlast the finalize lease (and it holds up
            # this tick, which renews the lines' leases): kept alive meanwhile, so another
            # replica does not take the batch over and start the same files again, over and
            # over for a batch whose assembly always takes longer than the lease.
            writing = asyncio.ensure_future(self._write_files(batch, final))
            keeper = asyncio.ensure_future(self._keep_leases_while_finalizing(batch_id))
            try:
                await asyncio.wait((writing, keeper), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writing, keeper):
                    task.cancel()
                await asyncio.gather(writing, keeper, return_exceptions=True)
            if writing.cancelled():  # the keeper ended first: the lease is gone (or unreachable)
                error = keeper.exception() if not keeper.cancelled() else None
                logger.warning("batch %s: finalization stopped: %s", batch_id, error or "cancelled")
            elif (failure := writing.exception()) is not None:
                raise failure

    async def _keep_leases_while_finalizing(self, batch_id: str) -> None:
        """Renews the finalize lease (and this replica's line leases, as the tick would) every
        `lease_s / 3`; raises once the finalize lease is no longer ours (the assembly stops:
        its files are published only under the lease, store.finish)."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.lease_s / 3)
            now = self.clock()
            if not await self.store.renew_finalize(batch_id, self.owner, now + cfg.lease_s * 4):
                raise RuntimeError(f"the finalize lease of batch {batch_id} was lost")
            await self._renew_line_leases(now)

    async def _renew_line_leases(self, now: float) -> None:
        """Extend the leases of the lines this replica runs or holds ready, if any."""
        if self._tasks or self._ready:
            await self.store.renew(self.owner, now + self.config.lease_s)
            self._renewed = now

    async def _write_files(self, batch: dict[str, Any], final: str) -> None:
        """Concatenate the batch's committed chunks into its output and error files (one chunk
        streamed at a time: memory stays bounded whatever the batch's size) and publish them."""
        batch_id, tenant = batch["id"], batch["tenant"]
        await self._chunk_rest(batch_id)
        chunks = await self.store.chunks(batch_id)
        counts = {
            "output": (sum(c.out_lines for c in chunks), sum(c.out_bytes for c in chunks)),
            "error": (sum(c.err_lines for c in chunks), sum(c.err_bytes for c in chunks)),
        }
        tmpdir = tempfile.mkdtemp(prefix="paved-batch-")
        try:
            paths = {kind: os.path.join(tmpdir, kind) for kind in ("output", "error")}
            await asyncio.to_thread(_concatenate, self.objects, chunks, paths["output"], paths["error"])
            now = self.clock()
            files = []
            ids: dict[str, str | None] = {"output": None, "error": None}
            for kind in ("output", "error"):
                lines, size = counts[kind]
                if not lines:
                    continue
                file_id = "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
                key = f"files/{tenant}/{file_id}"
                await self.objects.put_file(key, paths[kind])
                ids[kind] = file_id
                files.append(
                    {
                        "id": file_id,
                        "tenant": tenant,
                        "purpose": "batch_output",
                        "filename": f"{batch_id}_{kind}.jsonl",
                        "bytes": size,
                        "created_at": now,
                        "object_key": key,
                        "lines": lines,
                        "url": None,
                        "model": None,
                    }
                )
            done = counts["output"][0]
            failed = counts["error"][0]
            if await self.store.finish(
                batch_id,
                self.owner,
                final,
                now,
                files,
                ids["output"],
                ids["error"],
                done,
                failed,
                files_expire_at=now + self.config.retention_s,
            ):
                logger.info("batch %s %s: %d done, %d failed", batch_id, final, done, failed)
                # Published: the chunks are read no more (any a crash leaves here go with the
                # batch at retention).
                with contextlib.suppress(Exception):
                    await self.objects.delete_prefix(chunk_prefix(batch_id))
        finally:
            # ignore_errors: an assembly cancelled mid-copy may still have its thread writing.
            shutil.rmtree(tmpdir, ignore_errors=True)

    # -- retention -------------------------------------------------------------------------

    async def _sweep(self, now: float) -> None:
        """Delete up to `sweep_batches` batches finished more than `retention_s` ago and as many
        files past their `expires_at`: their objects first (idempotent), then their rows, so a
        crash in between orphans nothing; any replica may sweep at the same time
        (store.delete_batch, store.delete_expired_file). Old token counts too."""
        for batch in await self.store.retired(now - self.config.retention_s, self.config.sweep_batches):
            for key in batch["keys"]:
                await self.objects.delete(key)
            await self.objects.delete_prefix(chunk_prefix(batch["id"]))
            if await self.store.delete_batch(batch["id"], batch["file_ids"]):
                logger.info("batch %s deleted: past its retention", batch["id"])
        for file_id, key in await self.store.expired_files(now, self.config.sweep_batches):
            await self.objects.delete(key)
            if await self.store.delete_expired_file(file_id, now):
                logger.info("file %s deleted: expired", file_id)
        await self.store.prune_token_use(now)

    async def _stats(self, now: float) -> None:
        seen: set[tuple[str, ...]] = set()
        ages: dict[tuple[str, str], float] = {}
        for tenant, model, state, n, oldest in await self.store.line_stats():
            self.metrics.states.labels(tenant, model, state).set(n)
            seen.add((tenant, model, state))
            if state == "pending" and oldest is not None:
                ages[(tenant, model)] = max(0.0, now - oldest)
        for key in self._stats_keys - seen:
            self.metrics.states.labels(*key).set(0)
        for tenant, model, _ in self._stats_keys | seen:
            self.metrics.queue_age.labels(tenant, model).set(ages.get((tenant, model), 0.0))
        self._stats_keys = seen


def _concatenate(objects: ObjectStore, chunks: list[Chunk], output: str, error: str) -> None:
    """Each chunk's first `out_bytes` bytes to `output`, the rest to `error` (blocking)."""
    with open(output, "wb") as out, open(error, "wb") as err:
        for chunk in chunks:
            left = chunk.out_bytes
            for data in objects.open_read(chunk.object_key):
                if left > 0:
                    head = data[:left]
                    out.write(head)
                    left -= len(head)
                    data = data[len(head) :]
                if data:
                    err.write(data)


def _request(path: str, headers: list[tuple[bytes, bytes]], payload: bytes) -> Request:
    """An ASGI request the proxy reads like a client's: the body once, then a receive that
    never reports a disconnect (the runner cancels the task to abandon a line)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        # A future of its own per call: the proxy cancels each disconnect watcher once its step
        # is done, and cancelling a task cancels the future it awaits. A shared future was
        # cancelled by the first watcher (headers received), so the next one (body read) saw a
        # "disconnect" at once and the line was answered 499 whenever that read took a loop
        # turn: ~6 % of lines under load, each retried after a backoff.
        await asyncio.get_running_loop().create_future()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": [*headers, (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "http_version": "1.1",
    }
    return Request(scope, receive)


# The longest wait a backend's Retry-After may put on a line: it is the upstream's word, and
# a line must not be parked past its batch's window on it.
_MAX_RETRY_AFTER_S = 300.0


def _retry_after_s(value: str | None) -> float | None:
    """Seconds a Retry-After (delay-seconds) asks for, clamped to [0, _MAX_RETRY_AFTER_S];
    None when absent or not a finite number (NaN would fail the lease's NOT NULL write, inf
    would park the line until its batch expired): the runner's own backoff then applies."""
    try:
        wait = float(value) if value is not None else None
    except ValueError:
        return None
    if wait is None or not math.isfinite(wait):
        return None
    return min(max(wait, 0.0), _MAX_RETRY_AFTER_S)
