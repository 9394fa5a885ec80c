"""The controller: converges what runs to what the store says should run, and steers the
gateway's routes. It is the `Fleet` the rollout state machine drives.

One reconcile pass (every `interval_s`, on the leader only):
1. Replicas: per active deployment and region, create replicas up to the desired count, drain
   the surplus (starting or unhealthy ones first, then the newest). A replica leaves the routes
   (state `draining`, routes published) before its process is told to stop. Live replicas of
   a deleted deployment are drained the same way (the API refuses to delete one that still has
   replicas, so these are only the leftovers of a race or of GC).
2. Health: `starting` replicas become `ready` when the readiness probe passes (launcher ready,
   KServe ready where served, a structured smoke generation), `failed` when their process dies
   or the health timeout passes. `ready` replicas are probed for liveness; `live_failures`
   failures in a row mark one `unhealthy` (out of the routes first), and it is replaced.
   Starts that keep failing (before ready, or refused by the driver) back off per deployment
   and region: again at once, then after 5 s, 10 s, ... at most 5 min; a ready replica clears
   it. Stopped and failed replicas are forgotten `replica_retention_s` after they ended.
3. Routes: ready replicas of active deployments, weighted per version as the rollouts say;
   published only when the table changed.
4. Rollouts: every running rollout whose wake time has come is advanced one step.
5. Autoscaling: deployments with a policy and no running rollout get a decision per interval.
   A deployment that scales to zero (`scale_to_zero_after_s`, min_replicas 0) goes to 0 after
   that long without demand; `wake` (a gateway holding a request for it) brings it back to
   max(1, min_replicas) at once. Its alias stays in the routes while at zero, with no backends
   and `scaled_to_zero` (and `waking` once a wake asked for replicas), so gateways hold its
   requests instead of answering 404. Driver-independent: only desired counts move.

Desired counts are per (deployment, region) and persisted (`store.set_desired`), so a restarted
control plane converges to the same fleet; replicas it finds recorded are adopted through the
driver (same pid and start time) or written off and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from paved.control_plane import rollout as rollout_mod
from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.autoscaler import Autoscaler, IdleClock, wants_scale_to_zero
from paved.control_plane.driver import Driver, ReplicaRequest
from paved.control_plane.errors import ControlError, NotFound
from paved.control_plane.probes import probe_live, probe_ready
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.control_plane.types import Deployment, Replica
from paved.metrics.gauges import ReplicaMetrics

logger = logging.getLogger("paved.control_plane")

_LIVE = ("starting", "ready", "unhealthy")
_ADDRESSES = ("url", "admin_url", "kserve_grpc", "kserve_http", "metrics_url", "driver_ref")


# The first wait after a failed reconcile pass (doubled per failure in a row, up to the
# pass interval).
FAILED_PASS_BACKOFF_S = 0.1
# Characters of a driver's exit reason in a replica's reason, and of the whole reason (a probe's
# text and the exit reason) in the replica's record and its audit event, which the store bounds
# at MAX_MESSAGE_LEN together with the event's own words.
WHY_CHARS = 1000
REASON_CHARS = 2500
# A deployment whose replicas keep failing to start (in one region) is started again at once
# after its first failure, then after 5 s, 10 s, ... at most 5 min (Kubernetes' CrashLoopBackOff).
BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0


def _one_line(text: str, limit: int) -> str:
    """`text` as one printable line of at most `limit` characters (an ellipsis marks a cut): a
    launcher's, an engine's or a replica's words, which may hold newlines and NULs."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 2]).split())
    return f"{text[: limit - 1]}…" if len(text) > limit else text


class Controller:
    def __init__(
        self,
        store: ControlStore,
        drivers: dict[str, Driver],
        feed: RoutesFeed,
        analyzer: GatewayAnalyzer,
        *,
        interval_s: float = 1.0,
        health_timeout_s: float = 900.0,
        live_failures: int = 3,
        smoke: bool = True,
        drain_delay_s: float = 2.0,
        replica_retention_s: float = 7 * 24 * 3600.0,
    ):
        self.store = store
        self.drivers = drivers
        self.feed = feed
        self.analyzer = analyzer
        self.interval_s = interval_s
        self.health_timeout_s = health_timeout_s
        self.live_failures = live_failures
        self.smoke = smoke
        # Gateways learn of a routes change by watching the feed, a moment after it is
        # published; a replica told to stop before then can still be picked, and a request sent
        # to it as it closes its connections fails. Kubernetes' preStop sleep, by another name.
        self.drain_delay_s = drain_delay_s
        # (model_id, region) -> version -> weight, set by rollouts; absent: every active
        # deployment of the model weighs 1.
        self._weights: dict[tuple[str, str], dict[str, float]] = {}
        self._live_misses: dict[str, int] = {}
        self._started_at: dict[str, float] = {}
        self._pass = 0  # reconcile passes begun: a pass counts one failure per backoff key
        # (deployment id, region) -> (starts failed in a row, monotonic time of the next try,
        # the pass that counted the last one):
        # a replica that keeps failing before it is ready is started again after a doubling
        # delay (CrashLoopBackOff), not once a pass; its first ready replica clears it.
        self._backoff: dict[tuple[str, str], tuple[int, float, int]] = {}
        # Stopped and failed replicas are forgotten this long after they ended (0: never).
        self.replica_retention_s = replica_retention_s
        self._pruned_at = -math.inf
        self._draining: dict[str, asyncio.Task[None]] = {}
        self._retired: set[str] = set()  # deleted deployments the drivers were told about
        self._wake: dict[str, float] = {}
        self._traffic_checked = 0.0
        # One per (deployment, region): each region is sized for its own load.
        self._scalers: dict[tuple[str, str], Autoscaler] = {}
        # Deployment id -> its idle clock (wall time), while awake with a scale-to-zero policy.
        self._idle: dict[str, IdleClock] = {}
        # Wakes from several gateways at once decide one after the other: one scale-up, one
        # audit event.
        self._wake_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self.last_error: str | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        weights = await self.store.get_kv("weights")
        if isinstance(weights, dict):
            for key, value in weights.items():
                model, _, region = key.partition("|")
                self._weights[(model, region)] = {str(k): float(v) for k, v in value.items()}
        await self._adopt()
        self._task = asyncio.ensure_future(self._loop())

    @property
    def running(self) -> bool:
        """Its reconcile loop runs (this control plane leads, and started)."""
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._draining.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 60)

    async def drain_all(self, timeout_s: float = 60.0) -> None:
        """Drain every replica this control plane runs (shutdown with --stop-replicas-on-exit)."""
        live = [r for r in await self.store.list_replicas() if r.state in (*_LIVE, "draining")]
        for r in live:
            if r.state != "draining":
                await self.store.update_replica(r.id, state="draining")
        await self.publish_routes()

        async def one(r: Replica) -> None:
            driver = self.drivers.get(r.region)
            if driver is not None:
                with contextlib.suppress(Exception):
                    await driver.drain(r, timeout_s)
            await self.store.update_replica(r.id, state="stopped")

        await asyncio.gather(*(one(r) for r in live))

    def poke(self) -> None:
        """Run a pass now (an API call changed what should run)."""
        self._wakeup.set()

    async def _loop(self) -> None:
        failures = 0
        while True:
            try:
                await self.reconcile()
                self.last_error = None
                failures = 0
            except Exception as e:  # one bad pass must not stop the controller
                self.last_error = f"{type(e).__name__}: {e}"
                logger.exception("reconcile pass failed")
                failures += 1
            # Sleep to the next pass, or sooner when a rollout's next step is due.
            due = min(self._wake.values(), default=math.inf) - time.time()
            wait = max(0.0, min(self.interval_s, due))
            if failures:
                # A pass that fails with a step already due would run again at once, over and
                # over, and the loop would starve the API on the same event loop (a stored
                # value the driver refuses did). Back off, doubling up to the pass interval.
                backoff = FAILED_PASS_BACKOFF_S * 2 ** min(failures - 1, 16)
                wait = max(wait, min(self.interval_s, backoff))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait)
            self._wakeup.clear()

    async def _adopt(self) -> None:
        for region, driver in self.drivers.items():
            records = [
                r for r in await self.store.list_replicas(region=region) if r.state in (*_LIVE, "draining")
            ]
            adopted, gone = await driver.adopt(records)
            for r in adopted:
                self._started_at.setdefault(r.id, time.monotonic())
                if r.state == "draining":
                    self._drain(r)
            for r in gone:
                await self.store.update_replica(
                    r.id, state="failed", reason="gone after a control-plane restart"
                )
                model, version, of = await self._about(r)
                await self.store.audit(
                    "replica.gone",
                    f"replica {r.id}{of} was not running after a control-plane restart; it will be replaced",
                    model_id=model,
                    version=version,
                    data={"replica": r.id},
                )
            # One event per deployment, so each carries its model (`paved audit --model` shows it).
            by_deployment: dict[str, list[Replica]] = {}
            for r in adopted:
                by_deployment.setdefault(r.deployment_id, []).append(r)
            for mine in by_deployment.values():
                model, version, of = await self._about(mine[0])
                await self.store.audit(
                    "replica.adopted",
                    f"adopted {len(mine)} running replica(s){of} in region {region}",
                    model_id=model,
                    version=version,
                    data={"replicas": [r.id for r in mine]},
                )

    async def _about(self, r: Replica) -> tuple[str | None, str | None, str]:
        """(model, version, " of model@version") of replica `r`'s deployment, deleted or not:
        what an event about `r` carries, so that a model's audit lists its replicas' events."""
        d = await self.store.get_deployment_by_id(r.deployment_id)
        if d is None:
            return None, None, ""
        return d.spec.model_id, d.spec.version, f" of {d.spec.model_id}@{d.spec.version}"

    # ---- one pass ---------------------------------------------------------------------------
    async def reconcile(self) -> None:
        self._pass += 1
        deployments = [d for d in await self.store.list_deployments() if d.state != "deleted"]
        by_id = {d.id: d for d in deployments}
        replicas = await self.store.list_replicas()
        await self._health(replicas, by_id)
        replicas = await self.store.list_replicas()
        await self._converge(deployments, replicas)
        await self._orphans(by_id, replicas)
        await self._retire_deleted(replicas)
        await self.publish_routes()
        await self._rollouts()
        await self._autoscale(deployments)
        await self._traffic(deployments)
        await self._prune()

    async def _health(self, replicas: list[Replica], by_id: dict[str, Deployment]) -> None:
        now = time.monotonic()
        checks = []
        for r in replicas:
            d = by_id.get(r.deployment_id)
            driver = self.drivers.get(r.region)
            if d is None or driver is None or r.state not in _LIVE:
                continue
            checks.append(self._check(r, d, driver, now))
        if checks:
            await asyncio.gather(*checks)

    async def _check(self, r: Replica, d: Deployment, driver: Driver, now: float) -> None:
        started = self._started_at.setdefault(r.id, now)
        if r.state == "starting":
            if not await driver.alive(r):
                await self._fail(r, "its process exited before it was ready" + await self._why(r, driver))
                return
            r = await self._locate(r, driver)
            if not r.admin_url:  # not placed yet (a pod without an IP): nothing to probe
                if now - started > self.health_timeout_s:
                    why = await self._why(r, driver)
                    await self._fail(r, f"not placed after {self.health_timeout_s:.0f} s{why}")
                return
            kind = d.fingerprint.get("kind", "generate") if d.fingerprint else "generate"
            ok, reason = await probe_ready(r, model_id=d.spec.model_id, kind=kind, smoke=self.smoke)
            if ok:
                await self.store.update_replica(r.id, state="ready", reason=None)
                self._backoff.pop((r.deployment_id, r.region), None)
                await self.store.audit(
                    "replica.ready",
                    f"replica {r.id} of {d.spec.model_id}@{d.spec.version} passed its health gate",
                    model_id=d.spec.model_id,
                    version=d.spec.version,
                    data={"replica": r.id, "url": r.url},
                )
                # A rollout waiting on this replica moves now, not at its next poll.
                for rollout_id, wake in self._wake.items():
                    if math.isfinite(wake):
                        self._wake[rollout_id] = 0.0
                self._wakeup.set()
            elif now - started > self.health_timeout_s:
                why = await self._why(r, driver)
                await self._fail(r, f"not ready after {self.health_timeout_s:.0f} s: {reason}{why}")
            return
        ok, reason = await probe_live(r, driver)
        if ok:
            self._live_misses.pop(r.id, None)
            if r.state == "unhealthy":
                ok, reason = await probe_ready(r, model_id=d.spec.model_id, smoke=False)
                if ok:
                    await self.store.update_replica(r.id, state="ready", reason=None)
            return
        misses = self._live_misses.get(r.id, 0) + 1
        self._live_misses[r.id] = misses
        if misses < self.live_failures and await driver.alive(r):
            return
        reason = _one_line(reason + await self._why(r, driver), REASON_CHARS)
        # Out of the routes before anything else happens to it.
        await self.store.update_replica(r.id, state="unhealthy", reason=reason)
        await self.publish_routes()
        await self.store.audit(
            "replica.replaced",
            f"replica {r.id} of {d.spec.model_id}@{d.spec.version} failed liveness ({reason}); replacing it",
            model_id=d.spec.model_id,
            version=d.spec.version,
            data={"replica": r.id, "reason": reason},
        )
        await self._retire(r)

    async def _locate(self, r: Replica, driver: Driver) -> Replica:
        """Store the addresses the driver has learned for `r` since it was created."""
        located = await driver.locate(r)
        changed = {f: getattr(located, f) for f in _ADDRESSES if getattr(located, f) != getattr(r, f)}
        if not changed:
            return r
        return await self.store.update_replica(r.id, **changed)

    @staticmethod
    async def _why(r: Replica, driver: Driver) -> str:
        """ ": <why the replica stopped>" when its driver can tell, else ""; a driver that fails
        to say does not keep the failure from being recorded."""
        try:
            why = await driver.exit_reason(r)
        except Exception as e:  # noqa: BLE001 - only the explanation is lost
            logger.warning("replica %s: asking its driver why it stopped failed: %s", r.id, e)
            return ""
        why = _one_line(why or "", WHY_CHARS)
        return f": {why}" if why else ""

    async def _fail(self, r: Replica, reason: str) -> None:
        reason = _one_line(reason, REASON_CHARS)
        await self.store.update_replica(r.id, state="failed", reason=reason)
        self._forget(r.id)
        model, version, of = await self._about(r)
        await self.store.audit(
            "replica.failed",
            f"replica {r.id}{of} failed: {reason}{self._back_off(r.deployment_id, r.region)}",
            model_id=model,
            version=version,
            data={"replica": r.id},
        )
        driver = self.drivers.get(r.region)
        if driver is not None:
            with contextlib.suppress(Exception):
                await driver.delete(r)

    def _forget(self, replica_id: str) -> None:
        self._started_at.pop(replica_id, None)
        self._live_misses.pop(replica_id, None)

    def _back_off(self, deployment_id: str, region: str) -> str:
        """Count a failed start of the deployment in the region (once per pass: ten replicas
        failing together are one failed try); what the audit adds."""
        failures, until, counted = self._backoff.get((deployment_id, region), (0, 0.0, -1))
        if counted != self._pass:
            failures += 1
            delay = 0.0 if failures == 1 else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** min(failures - 2, 16))
            until = time.monotonic() + delay
            self._backoff[(deployment_id, region)] = (failures, until, self._pass)
        wait = max(0.0, until - time.monotonic())
        return f" ({failures} failed starts in a row; the next in {wait:.0f} s)" if wait else ""

    def _backing_off(self, deployment_id: str, region: str) -> bool:
        entry = self._backoff.get((deployment_id, region))
        return entry is not None and time.monotonic() < entry[1]

    async def _prune(self) -> None:
        """Forget replicas that ended more than `replica_retention_s` ago, at most every 10 min."""
        if self.replica_retention_s <= 0 or time.monotonic() - self._pruned_at < 600:
            return
        self._pruned_at = time.monotonic()
        gone = await self.store.prune_replicas(
            datetime.now(UTC) - timedelta(seconds=self.replica_retention_s)
        )
        if gone:
            logger.info("forgot %d replicas that ended over %.0f s ago", gone, self.replica_retention_s)

    async def _retire(self, r: Replica) -> None:
        driver = self.drivers.get(r.region)
        await self.store.update_replica(r.id, state="stopped", reason="replaced")
        self._forget(r.id)
        if driver is not None:
            with contextlib.suppress(Exception):
                await driver.delete(r)

    async def _converge(self, deployments: list[Deployment], replicas: list[Replica]) -> None:
        ids = {d.id for d in deployments}
        for key in [k for k in self._backoff if k[0] not in ids]:
            del self._backoff[key]  # deleted meanwhile
        unavailable: set[str] = set()  # regions whose driver was unavailable in this pass
        for d in deployments:
            desired_by_region = await self.store.get_desired(d.id)
            for region in d.spec.regions:
                if region not in self.drivers:
                    continue
                desired = effective_desired(d, desired_by_region, region)
                mine = [
                    r for r in replicas if r.deployment_id == d.id and r.region == region and r.state in _LIVE
                ]
                if len(mine) < desired:
                    if region in unavailable or self._backing_off(d.id, region):
                        continue
                    for _ in range(desired - len(mine)):
                        started = await self._create(d, region)
                        if started == "unavailable":
                            # The driver itself (an unreachable cluster) ends every start in the
                            # region for this pass: each would cost its timeout.
                            unavailable.add(region)
                        if started != "started":
                            break
                elif len(mine) > desired:
                    order = {"starting": 0, "unhealthy": 0, "ready": 1}
                    victims = sorted(mine, key=lambda r: (order[r.state], -self._started_at.get(r.id, 0.0)))
                    for r in victims[: len(mine) - desired]:
                        await self._start_draining(
                            r,
                            f"draining replica {r.id} of {d.spec.model_id}@{d.spec.version} in {region} "
                            f"(desired {desired}, had {len(mine)})",
                            model_id=d.spec.model_id,
                            version=d.spec.version,
                            data={"replica": r.id, "desired": desired},
                        )

    async def _orphans(self, by_id: dict[str, Deployment], replicas: list[Replica]) -> None:
        """Drain live replicas of deleted deployments. _converge sees only the deployments that
        exist, so without this a replica whose deployment was deleted (by a delete racing a
        scale-up, or GC) would keep its process running and never be health-checked again."""
        for r in replicas:
            if r.deployment_id in by_id or r.state not in _LIVE:
                continue
            model, version, of = await self._about(r)
            await self._start_draining(
                r,
                f"draining replica {r.id}{of}: its deployment {r.deployment_id} was deleted",
                model_id=model,
                version=version,
                data={"replica": r.id, "deployment": r.deployment_id},
            )

    async def _retire_deleted(self, replicas: list[Replica]) -> None:
        """Tell the drivers once about each deleted deployment none of whose replicas runs, so
        a cluster driver removes its objects (a failure is retried at the next pass)."""
        running = {r.deployment_id for r in replicas if r.state in (*_LIVE, "draining")}
        for d in await self.store.list_deployments(include_deleted=True):
            if d.state != "deleted" or d.id in self._retired or d.id in running:
                continue
            try:
                for region in d.spec.regions:
                    driver = self.drivers.get(region)
                    if driver is not None:
                        await driver.retire(d.id)
            except ControlError as e:
                logger.warning("could not retire deployment %s: %s", d.id, e.message)
                continue
            self._retired.add(d.id)

    async def _start_draining(self, r: Replica, message: str, **audit: Any) -> None:
        """Mark `r` draining (out of the routes), audit why, and drain it in the background."""
        await self.store.update_replica(r.id, state="draining")
        await self.store.audit("scale", message, **audit)
        self._drain(r)

    async def replicas_of(self, d: Deployment) -> tuple[dict[str, int], list[Replica]]:
        """What `d` still holds: its desired count per region (as _converge reads it) and its
        replicas in a live state. A deployment may be deleted only when both are empty."""
        desired_by_region = await self.store.get_desired(d.id)
        desired = {region: effective_desired(d, desired_by_region, region) for region in d.spec.regions}
        live = [r for r in await self.store.list_replicas(deployment_id=d.id) if r.state in _LIVE]
        return desired, live

    async def _create(self, d: Deployment, region: str) -> Literal["started", "failed", "unavailable"]:
        driver = self.drivers[region]
        replica_id = "rep_" + uuid.uuid4().hex[:12]
        request = ReplicaRequest(
            replica_id=replica_id,
            deployment_id=d.id,
            model_id=d.spec.model_id,
            version=d.spec.version,
            package_uri=d.spec.package_uri,
            region=region,
            engine=d.spec.engine,
            kserve=bool(d.fingerprint.get("kserve")) if d.fingerprint else False,
            kind=(d.fingerprint or {}).get("kind", "generate"),
            gpus=int(((d.fingerprint or {}).get("resources") or {}).get("gpus", 0)),
            placement=d.spec.placement,
        )
        try:
            replica = await driver.create(request)
        except (ControlError, OSError, ValueError) as e:
            # A start that failed (the driver's refusal; no process could be forked or executed;
            # an argument the OS refuses) is this deployment's failure: the pass goes on for
            # the others, and the next one tries again.
            if isinstance(e, ControlError):
                reason = e.message
            else:
                logger.warning("could not start a replica of %s@%s in %s", d.spec.model_id, d.spec.version,
                               region, exc_info=True)  # fmt: skip
                reason = f"{type(e).__name__}: {e}"
            await self.store.audit(
                "replica.failed",
                f"could not start a replica of {d.spec.model_id}@{d.spec.version} in {region}: {reason}"
                + self._back_off(d.id, region),
                model_id=d.spec.model_id,
                version=d.spec.version,
            )
            return "unavailable" if isinstance(e, ControlError) and e.status == 503 else "failed"
        try:
            await self.store.add_replica(replica)
        except BaseException:
            # Unrecorded, nothing would ever stop it (adoption reads the records), and the next
            # pass would start another: the process goes now.
            with contextlib.suppress(Exception):
                await asyncio.shield(driver.delete(replica))
            raise
        self._started_at[replica.id] = time.monotonic()
        await self.store.audit(
            "scale",
            f"started replica {replica.id} of {d.spec.model_id}@{d.spec.version} in {region}",
            model_id=d.spec.model_id,
            version=d.spec.version,
            data={"replica": replica.id, "url": replica.url},
        )
        return "started"

    def _drain(self, r: Replica) -> None:
        if r.id in self._draining:
            return

        async def drain() -> None:
            # The routes without it are published before the process is told to stop.
            await self.publish_routes()
            await asyncio.sleep(self.drain_delay_s)
            driver = self.drivers.get(r.region)
            try:
                if driver is not None:
                    await driver.drain(r)
            finally:
                await self.store.update_replica(r.id, state="stopped")
                self._draining.pop(r.id, None)
                self._forget(r.id)

        self._draining[r.id] = asyncio.ensure_future(drain())

    # ---- routes -----------------------------------------------------------------------------
    async def routes_table(self) -> dict[str, Any]:
        # Inactive deployments are listed too: a rollout's new version serves with the weight
        # the rollout gives it before it becomes the active one.
        deployments = [d for d in await self.store.list_deployments() if d.state != "deleted"]
        replicas = [r for r in await self.store.list_replicas() if r.state == "ready"]
        models: dict[str, dict[str, Any]] = {}
        for d in deployments:
            kind = (d.fingerprint or {}).get("kind", "generate")
            route = models.setdefault(
                d.spec.model_id,
                {"alias": d.spec.model_id, "kind": kind, "strategy": "least_outstanding", "backends": []},
            )
            if d.spec.strategy == "versioned" and d.current:
                route["current"] = d.spec.version
            for r in replicas:
                if r.deployment_id != d.id:
                    continue
                weights = self._weights.get((d.spec.model_id, r.region))
                if d.spec.strategy == "versioned":
                    # Side by side: every version serves its pins; `current` takes the alias.
                    weight = 1.0
                elif weights is None or d.spec.version not in weights:
                    weight = 1.0 if d.state == "active" else 0.0
                else:
                    weight = float(weights[d.spec.version])
                backend: dict[str, Any] = {
                    "id": r.url,
                    "url": r.url,
                    "version": d.spec.version,
                    "weight": weight,
                    "region": r.region,
                }
                if r.kserve_grpc:
                    backend["kserve_grpc"] = r.kserve_grpc
                if r.kserve_http:
                    backend["kserve_http"] = r.kserve_http
                if r.metrics_url:
                    # The launcher's metrics proxy: the gateways read the engine's load there
                    # (it answers through a start or a drain, unlike the frontend's port).
                    backend["metrics_url"] = r.metrics_url
                route["backends"].append(backend)
        # Models that scale to zero keep their alias while they have no replica: marked, so a
        # gateway holds their requests and wakes them (`waking`: replicas were asked for).
        wakeable: dict[str, bool] = {}
        # The versions a wake brings up (its active deployments that sleep at zero): pins to
        # them are held at zero like the bare alias, any other version stays unknown (404).
        sleeping: dict[str, list[str]] = {}
        for d in deployments:
            if d.state == "active" and wants_scale_to_zero(d.spec.autoscale, d.spec.min_replicas):
                desired = await self.store.get_desired(d.id)
                asked = any(effective_desired(d, desired, region) for region in d.spec.regions)
                wakeable[d.spec.model_id] = wakeable.get(d.spec.model_id, False) or asked
                sleeping.setdefault(d.spec.model_id, []).append(d.spec.version)
        # While a rollout splits a model's traffic between versions the split must be the
        # traffic share: least-outstanding would send nothing to a light version while the
        # heavy one is idle (it scores outstanding/weight), hiding it from the analysis.
        for m in models.values():
            shared = {b["version"] for b in m["backends"] if b["weight"] > 0}
            if len(shared) > 1 and "current" not in m:
                m["strategy"] = "weighted"
        # Route options (cache, template, ...) are one alias-wide policy: the current version's
        # for a versioned model, else the active deployment's (during a red-black rollout the
        # old version's until the new one is activated), else the newest deployment's.
        for model_id, m in models.items():
            mine = [d for d in deployments if d.spec.model_id == model_id]
            chosen = [d for d in mine if d.current] or [d for d in mine if d.state == "active"] or mine
            options = max(chosen, key=lambda d: d.created_at).spec.route if chosen else {}
            m.update({k: v for k, v in options.items() if k not in m})
        for model_id, waking in wakeable.items():
            m = models[model_id]
            if not m["backends"]:
                m["scaled_to_zero"] = True
                if waking:
                    m["waking"] = True
                m["versions"] = sorted(set(sleeping[model_id]))
        # The other models of a kserve package that is a Triton model repository: each routed
        # under its own name to the replicas of the package versions that hold it, with the
        # package's route (strategy, weights, options, scale-to-zero marks), as Triton serves a
        # repository's models side by side. The gateway's KServe forwarders look routes up by
        # model name, so without these only model_id would be reachable through it.
        for name, owner in repository_models(deployments).items():
            holding = {
                d.spec.version for d in deployments if d.spec.model_id == owner and name in _models_of(d)
            }
            route = {
                **models[owner],
                "alias": name,
                "backends": [dict(b) for b in models[owner]["backends"] if b["version"] in holding],
            }
            if "versions" in route:
                route["versions"] = [v for v in route["versions"] if v in holding]
                if not route["versions"]:
                    continue
            models[name] = route
        # Any other model whose every replica is gone keeps an entry only if it has backends
        # (the gateway answers an unknown model 404, and a routed one without health 503).
        table = {"models": [m for m in models.values() if m["backends"] or m.get("scaled_to_zero")]}
        for m in table["models"]:
            if "current" in m and m["current"] not in {b["version"] for b in m["backends"]}:
                del m["current"]
        return table

    async def publish_routes(self) -> int:
        return await self.feed.publish(await self.routes_table())

    # ---- Fleet (driven by paved.control_plane.rollout) -----------------------------------------
    async def scale(self, deployment_id: str, region: str, replicas: int) -> None:
        if replicas < 0:
            raise ControlError(400, "replicas must be >= 0")
        await self.store.set_desired(deployment_id, region, replicas)
        self._wakeup.set()

    async def counts(self, deployment_id: str, region: str) -> tuple[int, int]:
        ready = failed = 0
        for r in await self.store.list_replicas(deployment_id=deployment_id, region=region):
            if r.state == "ready":
                ready += 1
            elif r.state == "failed":
                failed += 1
        return ready, failed

    async def set_weights(self, model_id: str, region: str, weights: dict[str, float]) -> None:
        self._weights[(model_id, region)] = dict(weights)
        await self.store.set_kv("weights", {f"{m}|{r}": w for (m, r), w in self._weights.items()})
        await self.publish_routes()

    async def _backends(self, model_id: str, version: str, region: str) -> set[str] | None:
        deployment = await self.store.get_deployment(model_id, version)
        if deployment is None:
            return None
        return {r.url for r in await self.store.list_replicas(deployment_id=deployment.id, region=region)}

    async def counters(self, model_id: str, version: str, region: str) -> dict[str, Any] | None:
        backends = await self._backends(model_id, version, region)
        # Read now, not at the last periodic scrape; a gateway that did not answer gives no
        # baseline (the analysis then falls back to this process's samples).
        if backends is None or not self.analyzer.configured or not await self.analyzer.scrape_once():
            return None
        return self.analyzer.counters(backends)

    async def analyze(
        self, model_id: str, version: str, region: str, since: float, baseline: dict[str, Any] | None
    ) -> Any:
        backends = await self._backends(model_id, version, region)
        if backends is None:
            return rollout_mod.Analysis(0, 0, None)
        # The window ends now, not at the last periodic scrape.
        await self.analyzer.scrape_once()
        return self.analyzer.analyze(backends, since, baseline)

    async def deactivate(self, deployment_id: str) -> None:
        await self.store.update_deployment(deployment_id, state="inactive")
        for region in self.drivers:
            await self.store.set_desired(deployment_id, region, 0)
        self._wakeup.set()

    async def activate(self, deployment_id: str) -> None:
        await self.store.update_deployment(deployment_id, state="active")
        self._wakeup.set()

    async def _traffic(self, deployments: list[Deployment], every_s: float = 5.0) -> None:
        """Record when each deployment last had traffic (GC's `since last traffic` retention),
        from the gateways' per-backend counters."""
        now = time.time()
        if now - self._traffic_checked < every_s or not self.analyzer.configured:
            return
        since, self._traffic_checked = self._traffic_checked or now - every_s, now
        replicas = await self.store.list_replicas()
        for d in deployments:
            urls = {r.url for r in replicas if r.deployment_id == d.id}
            if urls and self.analyzer.analyze(urls, since).requests > 0:
                try:
                    await self.store.update_deployment(d.id, last_traffic_at=datetime.now(UTC))
                except ControlError as e:  # (deleted meanwhile): the others' traffic still counts
                    logger.warning("could not record traffic of %s: %s", d.id, e.message)

    # ---- rollouts and autoscaling -----------------------------------------------------------
    async def _rollouts(self) -> None:
        now = time.time()
        running = await self.store.list_rollouts(status="running")
        # Forget rollouts that ended elsewhere (another leader, an abort): a stale wake time in
        # the past would make the loop spin.
        for stale in set(self._wake) - {r.id for r in running}:
            del self._wake[stale]
        for record in running:
            if self._wake.get(record.id, 0.0) > now:
                continue
            try:
                record, wake = await rollout_mod.advance(record, self, self.store, now)
            except ControlError as e:
                if e.status == 409:
                    continue  # another control plane moved it first
                raise
            if math.isfinite(wake):
                self._wake[record.id] = wake
            else:
                self._wake.pop(record.id, None)  # finished
            if record.status == "succeeded":
                await self._promoted(record)

    async def _promoted(self, record: Any) -> None:
        target = await self.store.get_deployment(record.model_id, record.to_version)
        if target is None or target.state == "active":
            return
        await self.activate(target.id)
        if target.spec.strategy == "versioned":
            current = [d for d in await self.store.list_deployments(model_id=record.model_id) if d.current]
            if not current or record.params.get("promote"):
                await self.store.set_current(record.model_id, record.to_version)
        await self.publish_routes()

    async def _autoscale(self, deployments: list[Deployment]) -> None:
        busy = {r.model_id for r in await self.store.list_rollouts(status="running")}
        now = time.time()
        for gone in set(self._idle) - {d.id for d in deployments if d.state == "active"}:
            del self._idle[gone]
        for d in deployments:
            policy = d.spec.autoscale
            if not policy.enabled or d.state != "active" or d.spec.model_id in busy:
                continue
            desired = await self.store.get_desired(d.id)
            if not any(effective_desired(d, desired, region) for region in d.spec.regions):
                # At zero (asleep, or scaled there by the API): no replica to read, and demand
                # wakes it (`wake`), not the KPA.
                self._forget_scalers(d.id)
                self._idle.pop(d.id, None)
                continue
            replicas = await self.store.list_replicas(deployment_id=d.id)
            # Per region: (the gauges read, how many ready replicas there were to read). The
            # analyzer's source: the replicas scraped here, or their series in Prometheus.
            readings: dict[str, tuple[list[ReplicaMetrics], int]] = {}
            for region in d.spec.regions:
                ready = [r for r in replicas if r.region == region and r.state == "ready" and r.metrics_url]
                samples = await self.analyzer.source.replica_gauges(ready, d.spec.model_id) if ready else []
                readings[region] = (samples, len(ready))
            # Replicas that could not be read are not idle ones: a metrics outage read as zero
            # load scaled busy deployments down, and to zero.
            unread = any(n and not samples for samples, n in readings.values())
            if wants_scale_to_zero(policy, d.spec.min_replicas):
                clock = self._idle.get(d.id)
                if clock is None:
                    clock = self._idle[d.id] = IdleClock(now)
                # Demand: a request in flight at a replica now, or one the gateways answered or
                # held (a wake) since; `_traffic` and `wake` keep last_traffic_at.
                if unread or any(
                    s.running + s.waiting > 0 for samples, _ in readings.values() for s in samples
                ):
                    clock.demand(now)
                # A replica still starting (a wake's, under a slow cold start) has had no chance
                # to serve what woke it: the idle time counts from when it is up.
                if any(r.state == "starting" for r in replicas):
                    clock.demand(now)
                if d.last_traffic_at is not None:
                    clock.demand(d.last_traffic_at.timestamp())
                if clock.due(policy, d.spec.min_replicas, now):
                    await self._scale_to_zero(d, desired, clock.idle_for(now))
                    continue
            # Zero is the idle clock's decision alone: the KPA never goes below one replica.
            floor = max(1, d.spec.min_replicas)
            for region in d.spec.regions:
                current = desired.get(region, d.spec.replicas)
                if current == 0:
                    continue  # a region scaled to 0 by the API stays there
                samples, n_read = readings[region]
                if n_read and not samples:
                    continue  # no reading at all: held, as Knative holds without metrics
                scaler = self._scalers.get((d.id, region))
                if scaler is None:
                    scaler = self._scalers[(d.id, region)] = Autoscaler(policy)
                scaler.observe(samples, of=n_read)
                live = [r for r in replicas if r.region == region and r.state in _LIVE]
                n_ready = sum(1 for r in live if r.state == "ready")
                decision = scaler.decide(
                    current_target=current,
                    ready=n_ready,
                    min_replicas=floor,
                    max_replicas=d.spec.max_replicas,
                    step_in_flight=n_ready != current,
                )
                if decision.target != current:
                    await self.store.set_desired(d.id, region, decision.target)
                    await self.store.audit(
                        "autoscale",
                        f"{d.spec.model_id}@{d.spec.version} in {region}: {current} -> {decision.target} "
                        f"replicas ({decision.mode}: {decision.reason})",
                        model_id=d.spec.model_id,
                        version=d.spec.version,
                        data={
                            "from": current,
                            "to": decision.target,
                            "mode": decision.mode,
                            "reason": decision.reason,
                        },
                    )

    def _forget_scalers(self, deployment_id: str) -> None:
        for key in [k for k in self._scalers if k[0] == deployment_id]:
            del self._scalers[key]

    async def _scale_to_zero(self, d: Deployment, desired: dict[str, int], idle_s: float) -> None:
        before = {region: effective_desired(d, desired, region) for region in d.spec.regions}
        for region, n in before.items():
            if n:
                await self.store.set_desired(d.id, region, 0)
        self._forget_scalers(d.id)
        self._idle.pop(d.id, None)
        after = d.spec.autoscale.scale_to_zero_after_s
        reason = f"no demand for {idle_s:.0f} s (scale_to_zero_after_s {after:g})"
        await self.store.audit(
            "autoscale",
            f"{d.spec.model_id}@{d.spec.version}: scaled to zero ({reason}); its alias stays routed "
            "and a request wakes it",
            model_id=d.spec.model_id,
            version=d.spec.version,
            data={"from": before, "to": 0, "mode": "to_zero", "reason": reason},
        )
        self._wakeup.set()  # drain now (out of the routes first)

    async def wake(self, model_id: str) -> dict[str, Any]:
        """Demand for `model_id` (a gateway holds a request for it): in every region where an
        active deployment of it that scales to zero is at zero, it is scaled to
        max(1, min_replicas) at once, and its idle clock restarts.

        Idempotent: a wake of a model already waking or serving changes no count (several
        gateways, or one gateway's repeated calls while it holds requests, make one scale-up
        and one audit event); it only records the demand. Works on any control plane sharing
        the store (the leader converges to the persisted counts). NotFound for a model with no
        deployment. Returns {"model", "state": "serving" | "waking" | "not_scaled_to_zero",
        "woke": {"model@version": {region: replicas}}}."""
        deployments = await self.store.list_deployments(model_id=model_id)
        if not deployments:
            # Another model of a repository package wakes the package (routes_table routes it).
            owner = repository_models(
                [d for d in await self.store.list_deployments() if d.state != "deleted"]
            ).get(model_id)
            if owner is not None:
                deployments = await self.store.list_deployments(model_id=owner)
        if not deployments:
            raise NotFound(f"no deployment of model {model_id}", code="model_not_found")
        woke: dict[str, dict[str, int]] = {}
        sleepers = [
            d
            for d in deployments
            if d.state == "active" and wants_scale_to_zero(d.spec.autoscale, d.spec.min_replicas)
        ]
        async with self._wake_lock:
            for d in sleepers:
                now = datetime.now(UTC)
                # Demand, persisted (the leader's idle clock reads it, whoever took the call);
                # a wake every second per gateway writes at most once a second.
                if d.last_traffic_at is None or (now - d.last_traffic_at).total_seconds() >= 1.0:
                    d = await self.store.update_deployment(d.id, last_traffic_at=now)
                desired = await self.store.get_desired(d.id)
                for region in d.spec.regions:
                    if effective_desired(d, desired, region) == 0:
                        n = max(1, d.spec.min_replicas)
                        await self.store.set_desired(d.id, region, n)
                        woke.setdefault(f"{d.spec.model_id}@{d.spec.version}", {})[region] = n
                mine = woke.get(f"{d.spec.model_id}@{d.spec.version}")
                if mine:
                    await self.store.audit(
                        "autoscale",
                        f"{d.spec.model_id}@{d.spec.version}: woken from zero by demand "
                        f"(a gateway holds its requests): 0 -> {mine}",
                        model_id=d.spec.model_id,
                        version=d.spec.version,
                        data={"from": 0, "to": mine, "mode": "wake", "reason": "a gateway holds requests"},
                    )
        if woke:
            self._wakeup.set()
        if not sleepers:
            state = "not_scaled_to_zero"
        else:
            ids = {d.id for d in deployments if d.state == "active"}
            replicas = await self.store.list_replicas()
            state = (
                "serving"
                if any(r.deployment_id in ids and r.state == "ready" for r in replicas)
                else "waking"
            )
        return {"model": model_id, "state": state, "woke": woke}


def _models_of(d: Deployment) -> list[str]:
    """The models a kserve deployment's replicas serve (its fingerprint's "models"; none
    recorded for another kind, or for a deployment fingerprinted before they were)."""
    fingerprint = d.fingerprint or {}
    models = fingerprint.get("models") if fingerprint.get("kind") == "kserve" else None
    return [m for m in models if isinstance(m, str)] if isinstance(models, list) else []


def repository_models(deployments: list[Deployment]) -> dict[str, str]:
    """Model name -> the model_id of the repository package serving it, for every model of a
    kserve package other than its model_id. A name that is some deployment's model_id stays
    that deployment's alias; a name two packages hold goes to the smaller model_id (one
    route per name, the same whichever control plane publishes)."""
    aliases = {d.spec.model_id for d in deployments}
    owners: dict[str, str] = {}
    for d in sorted(deployments, key=lambda d: d.spec.model_id):
        for name in _models_of(d):
            if name not in aliases:
                owners.setdefault(name, d.spec.model_id)
    return owners


def effective_desired(d: Deployment, desired_by_region: dict[str, int], region: str) -> int:
    """The replicas `d` should have in `region`: the persisted count, else the spec's while the
    deployment is active (none while it is not)."""
    return desired_by_region.get(region, 0 if d.state != "active" else d.spec.replicas)
