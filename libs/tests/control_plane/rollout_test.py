"""The rollout state machine over a fake Fleet and a real SQLite ControlStore: phases and
weights, the capacity invariant (hypothesis), health-gate and analysis failures (traffic back
first), restart mid-rollout, compare-and-set, abort, waves halting, the fast-rollback window,
versioned and first deploys, params validation."""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paved.control_plane import rollout
from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.controller import Controller
from paved.control_plane.errors import BadRequest, ControlError
from paved.control_plane.rollout import Analysis, RolloutParams, advance, check_fingerprint, request_abort
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore, RolloutRecord
from paved.control_plane.types import DeploymentSpec, Replica
from paved.gateway.metrics import GatewayMetrics

T0 = 1_000_000.0
GOOD = Analysis(requests=100, errors=0, p99_s=0.2)


@dataclass
class FakeFleet:
    """Desired counts converge one `tick` at a time: scale-downs at once (draining replicas
    leave the routes first), scale-ups become ready (or failed) on the next tick."""

    store: ControlStore
    desired: dict[tuple[str, str], int] = field(default_factory=dict)
    ready: dict[tuple[str, str], int] = field(default_factory=dict)
    failed: dict[tuple[str, str], int] = field(default_factory=dict)
    weights: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)  # deployments whose new replicas fail
    stuck: set[str] = field(default_factory=set)  # deployments whose replicas never get ready
    analysis: Callable[[str, str, float], Analysis] = lambda version, region, weight: GOOD
    pairs: list[tuple[str, str, int]] = field(default_factory=list)  # (old id, new id, cap)
    regions: tuple[str, ...] = ("local",)
    scale_errors: int = 0  # the next N scale calls raise 503

    async def scale(self, deployment_id: str, region: str, replicas: int) -> None:
        assert replicas >= 0
        if self.scale_errors:
            self.scale_errors -= 1
            raise ControlError(503, "database is down")
        self.calls.append(("scale", deployment_id, region, replicas))
        self.desired[(deployment_id, region)] = replicas
        key = (deployment_id, region)
        self.ready[key] = min(self.ready.get(key, 0), replicas)
        self.check()

    async def counts(self, deployment_id: str, region: str) -> tuple[int, int]:
        key = (deployment_id, region)
        return self.ready.get(key, 0), self.failed.get(key, 0)

    async def set_weights(self, model_id: str, region: str, weights: dict[str, float]) -> None:
        self.calls.append(("set_weights", model_id, region, dict(weights)))
        self.weights[(model_id, region)] = dict(weights)

    async def counters(self, model_id: str, version: str, region: str) -> dict[str, Any] | None:
        return None

    async def analyze(
        self, model_id: str, version: str, region: str, since: float, baseline: dict[str, Any] | None
    ) -> Analysis:
        self.calls.append(("analyze", version, region, since))
        return self.analysis(version, region, self.weights.get((model_id, region), {}).get(version, 0.0))

    async def activate(self, deployment_id: str) -> None:
        self.calls.append(("activate", deployment_id))
        await self.store.update_deployment(deployment_id, state="active")

    async def deactivate(self, deployment_id: str) -> None:
        self.calls.append(("deactivate", deployment_id))
        await self.store.update_deployment(deployment_id, state="inactive")
        for (dep, region), _ in list(self.desired.items()):
            if dep == deployment_id:
                self.desired[(dep, region)] = 0
                self.ready[(dep, region)] = 0

    def tick(self) -> None:
        for key, want in list(self.desired.items()):
            if self.ready.get(key, 0) >= want or key[0] in self.stuck:
                continue
            if key[0] in self.broken:
                self.failed[key] = self.failed.get(key, 0) + 1
                continue
            self.ready[key] = want
        self.check()

    def check(self) -> None:
        for old, new, cap in self.pairs:
            for region in self.regions:
                d = self.desired.get((old, region), 0) + self.desired.get((new, region), 0)
                r = self.ready.get((old, region), 0) + self.ready.get((new, region), 0)
                assert d <= cap, f"desired {d} > cap {cap} in {region}: {self.desired}"
                assert r <= cap, f"ready {r} > cap {cap} in {region}: {self.ready}"

    def mutations(self, start: int = 0) -> list[tuple[Any, ...]]:
        return [c for c in self.calls[start:] if c[0] in ("scale", "set_weights")]

    def weight_history(self, region: str, version: str) -> list[float]:
        return [c[3].get(version) for c in self.calls if c[0] == "set_weights" and c[2] == region]


@dataclass
class World:
    store: ControlStore
    fleet: FakeFleet
    record: RolloutRecord
    old_id: str | None
    new_id: str
    url: str


async def make_world(
    tmp: Path,
    *,
    n: int = 4,
    params: dict[str, Any] | None = None,
    regions: tuple[str, ...] = ("local",),
    strategy: str = "red_black",
    first: bool = False,
) -> World:
    url = f"sqlite:///{tmp / 'control.db'}"
    store = ControlStore(url)
    await store.start()
    fleet = FakeFleet(store, regions=regions)
    old_id = None
    if not first:
        old = await store.create_deployment(
            DeploymentSpec(
                "m", "v1", "/pkg/v1", strategy=strategy, replicas=n, max_replicas=8, regions=regions
            ),
            {},
        )
        old_id = old.id
        for region in regions:
            fleet.desired[(old.id, region)] = n
            fleet.ready[(old.id, region)] = n
    new = await store.create_deployment(
        DeploymentSpec("m", "v2", "/pkg/v2", strategy=strategy, replicas=n, max_replicas=8, regions=regions),
        {},
    )
    await store.update_deployment(new.id, state="inactive")
    p = RolloutParams.from_dict(params or {})
    if old_id is not None and strategy == "red_black":  # versioned lives side by side
        fleet.pairs.append((old_id, new.id, n + p.surge))
    from_version = None if (first or strategy == "versioned") else "v1"
    record = await store.create_rollout("m", from_version, "v2", strategy, p.to_dict())  # type: ignore[arg-type]
    return World(store, fleet, record, old_id, new.id, url)


async def drive(
    w: World, now: float = T0, *, until: Callable[[RolloutRecord], bool] | None = None, steps: int = 2000
) -> tuple[RolloutRecord, float]:
    rec = w.record
    for _ in range(steps):
        rec, nxt = await advance(rec, w.fleet, w.store, now)
        w.fleet.tick()
        if rec.status != "running" or (until is not None and until(rec)):
            return rec, now
        assert nxt >= now
        now = nxt
    raise AssertionError(f"rollout did not finish in {steps} steps: {rec.phase} {rec.state}")


async def phase_sequence(store: ControlStore, rollout_id: str) -> list[str]:
    """The phases entered, from the audit log ('<prev> -> <next>: why')."""
    events = await store.list_audit(rollout_id=rollout_id, limit=1000)
    seq = []
    for e in events:
        if e.kind == "rollout.phase":
            body = e.message.split("): ", 1)[1]
            seq.append(body.split(" -> ", 1)[1].split(": ", 1)[0])
    return seq


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- happy path ------------------------------------------------------------------------------


def test_happy_path_phases_and_weights(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=4, params={"interval_s": 10, "fast_rollback_window_s": 60})
        rec, _ = await drive(w)
        assert rec.status == "succeeded", rec.reason
        assert rec.phase == "done"
        assert await phase_sequence(w.store, rec.id) == [
            "starting",
            "health_gate",
            "shift:0",
            "analysis:0",
            "shift:1",
            "analysis:1",
            "shift:2",
            "analysis:2",
            "promoted",
            "done",
        ]
        # Pinned before the new version has replicas; 75 is the capacity-following step the
        # surge forces between 50% (2+2) and 100% (4 new) with one spare replica.
        assert w.fleet.weight_history("local", "v2") == [0, 25, 50, 75, 100]
        assert all(c[3]["v1"] == 100 - c[3]["v2"] for c in w.fleet.calls if c[0] == "set_weights")
        assert w.fleet.desired[(w.new_id, "local")] == 4
        assert w.fleet.desired[(w.old_id, "local")] == 0
        new = await w.store.get_deployment("m", "v2")
        old = await w.store.get_deployment("m", "v1")
        assert new is not None and new.state == "active"
        assert old is not None and old.state == "inactive"
        # The old version was kept warm (1 replica) through promotion until done.
        scale_old = [c[3] for c in w.fleet.calls if c[0] == "scale" and c[1] == w.old_id]
        assert scale_old == [3, 2, 1, 0]
        kinds = {e.kind for e in await w.store.list_audit(rollout_id=rec.id, limit=1000)}
        assert {
            "rollout.phase",
            "rollout.scale",
            "rollout.weights",
            "rollout.analysis",
            "rollout.finished",
        } <= kinds

    run(go())


def test_analysis_waits_for_the_interval_and_is_idempotent(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2, params={"interval_s": 30})
        rec, now = await drive(w, until=lambda r: r.phase == "analysis:0")
        before = len(w.fleet.calls)
        # Calling again before the interval is over changes nothing and names the due time.
        for _ in range(3):
            rec2, nxt = await advance(rec, w.fleet, w.store, now)
            assert rec2.phase == "analysis:0"
            assert nxt <= now + rollout.MAX_WAIT_S
        assert w.fleet.calls[before:] == []
        analyses = [c for c in w.fleet.calls if c[0] == "analyze"]
        assert analyses == []
        rec, _ = await drive(w, now)
        assert rec.status == "succeeded"
        # Analysis looked at the window since the weight was set, 30 s later at the earliest.
        first = next(c for c in w.fleet.calls if c[0] == "analyze")
        assert first[3] >= T0

    run(go())


# ---- the capacity invariant ------------------------------------------------------------------


@st.composite
def rollout_shapes(draw: Any) -> tuple[list[int], int, int, int]:
    inner = draw(st.lists(st.integers(1, 99), max_size=4, unique=True))
    phases = [*sorted(inner), 100]
    return phases, draw(st.integers(1, 6)), draw(st.integers(0, 2)), draw(st.integers(0, 2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=rollout_shapes())
def test_capacity_never_exceeds_n_plus_surge(shape: tuple[list[int], int, int, int]) -> None:
    phases, n, surge, warm = shape

    async def go(tmp: Path) -> None:
        params = {
            "phases": phases,
            "surge": surge,
            "warm_reserve": warm,
            "interval_s": 1,
            "fast_rollback_window_s": 5,
        }
        w = await make_world(tmp, n=n, params=params)
        # FakeFleet.check asserts ready_old + ready_new <= N + surge (and the same for desired)
        # after every scale call and every tick.
        rec, _ = await drive(w)
        assert rec.status == "succeeded", rec.reason
        assert w.fleet.desired[(w.new_id, "local")] == n
        assert w.fleet.desired[(w.old_id, "local")] == 0
        history = w.fleet.weight_history("local", "v2")
        assert history[-1] == 100
        assert history == sorted(history), "the new version's weight only goes up"
        for p in phases:
            assert p in history or p == 100
        await w.store.close()

    with tempfile.TemporaryDirectory() as d:
        run(go(Path(d)))


# ---- failures roll back, traffic first -------------------------------------------------------


def test_health_gate_failure_rolls_back(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2)
        w.fleet.broken.add(w.new_id)
        rec, _ = await drive(w)
        assert rec.status == "rolled_back"
        assert "failed in local" in (rec.reason or "")
        seq = await phase_sequence(w.store, rec.id)
        assert seq[:2] == ["starting", "health_gate"] and seq[-1] == "rolling_back"
        assert w.fleet.desired[(w.new_id, "local")] == 0
        assert w.fleet.desired[(w.old_id, "local")] == 2
        assert w.fleet.weights[("m", "local")] == {"v2": 0.0, "v1": 100.0}

    run(go())


def test_health_timeout_rolls_back(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2, params={"health_timeout_s": 30})
        w.fleet.stuck.add(w.new_id)
        rec, _ = await drive(w)
        assert rec.status == "rolled_back"
        assert "not ready in local: 0/1 replicas ready after" in (rec.reason or "")

    run(go())


def test_analysis_failure_at_50_rolls_back_traffic_first(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=4)

        def analysis(version: str, region: str, weight: float) -> Analysis:
            return Analysis(42, 13, 0.3) if weight == 50 else GOOD

        w.fleet.analysis = analysis
        rec, now = await drive(w, until=lambda r: r.phase == "analysis:1")
        mark = len(w.fleet.calls)
        rec, _ = await drive(w, now)
        assert rec.status == "rolled_back"
        assert (
            rec.reason
            == "analysis failed at 50% in local: error rate 0.31 > 0.05 over 42 requests; rolling back"
        )
        after = [c for c in w.fleet.calls[mark:] if c[0] != "analyze"]
        assert after[0] == ("set_weights", "m", "local", {"v2": 0.0, "v1": 100.0})
        assert [c[0] for c in after[1:3]] == ["scale", "scale"]
        assert w.fleet.desired[(w.new_id, "local")] == 0
        assert w.fleet.desired[(w.old_id, "local")] == 4
        messages = [e.message for e in await w.store.list_audit(rollout_id=rec.id, limit=1000)]
        assert any("error rate 0.31 > 0.05 over 42 requests; rolling back" in m for m in messages)

    run(go())


def test_p99_and_inconclusive_analysis(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=1, params={"min_requests": 10, "max_p99_s": 1.0, "interval_s": 10})
        results = iter([Analysis(3, 0, None), Analysis(5, 0, None), Analysis(50, 0, 2.5)])
        w.fleet.analysis = lambda version, region, weight: next(results)
        rec, _ = await drive(w)
        assert rec.status == "rolled_back"
        assert "p99 2.500 s > 1 s over 50 requests" in (rec.reason or "")
        analyses = [c for c in w.fleet.calls if c[0] == "analyze"]
        assert len(analyses) == 3  # two inconclusive intervals, then a verdict

    run(go())


def test_inconclusive_three_times_passes(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=1, params={"phases": [100], "min_requests": 10})
        w.fleet.analysis = lambda version, region, weight: Analysis(0, 0, None)
        rec, _ = await drive(w)
        assert rec.status == "succeeded"
        assert len([c for c in w.fleet.calls if c[0] == "analyze"]) == 3
        messages = [e.message for e in await w.store.list_audit(rollout_id=rec.id, limit=1000)]
        assert any("still inconclusive after 3 intervals" in m for m in messages)

    run(go())


# ---- restart, compare-and-set, abort -------------------------------------------------------


def test_restart_mid_rollout_continues_from_the_persisted_record(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=4)
        rec, now = await drive(w, until=lambda r: r.phase == "shift:1")
        stale = w.record  # what a restarted loop might still hold: the record as created
        await w.store.close()
        # A new control plane: a fresh store on the same database, the same fleet (replicas
        # outlive the control plane).
        store2 = ControlStore(w.url)
        await store2.start()
        w2 = World(store2, w.fleet, stale, w.old_id, w.new_id, w.url)
        w.fleet.store = store2
        rec, _ = await drive(w2, now)
        assert rec.status == "succeeded"
        seq = await phase_sequence(store2, rec.id)
        assert seq.count("starting") == 1 and seq.count("shift:1") == 1 and seq[-1] == "done"
        assert w.fleet.weight_history("local", "v2") == [0, 25, 50, 75, 100]
        await store2.close()

    run(go())


@dataclass
class GatewayFleet(FakeFleet):
    """The fake fleet, with the analysis of the real controller: its GatewayAnalyzer scraping a
    gateway's /metrics (the gateway's own GatewayMetrics, served on loopback)."""

    controller: Controller | None = None

    async def counters(self, model_id: str, version: str, region: str) -> dict[str, Any] | None:
        assert self.controller is not None
        return await self.controller.counters(model_id, version, region)

    async def analyze(
        self, model_id: str, version: str, region: str, since: float, baseline: dict[str, Any] | None
    ) -> Analysis:
        assert self.controller is not None
        self.calls.append(("analyze", version, region, since))
        return cast(Analysis, await self.controller.analyze(model_id, version, region, since, baseline))


class FakeGateway:
    """A gateway's /metrics on loopback, counted by the gateway's own GatewayMetrics."""

    def __init__(self) -> None:
        self.metrics = GatewayMetrics()
        self.url = ""

    def answer(self, backend: str, status: str, n: int) -> None:
        self.metrics.requests.labels(tenant="t", model="m", backend=backend, status=status).inc(n)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[FakeGateway]:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
            yield self
        finally:
            await runner.cleanup()


def test_analysis_after_a_restart_counts_the_requests_before_it(tmp_path: Path) -> None:
    """A control plane restarted during a phase's analysis judges the whole phase: the
    gateways' cumulative counters at the phase's start are persisted with it, so the errors
    answered before the restart are counted (the issue saw "over 21 requests" of ~75)."""
    backend = "http://127.0.0.1:9/v2-a"

    async def go(gateway: FakeGateway) -> None:
        def answer(status: str, n: int) -> None:
            gateway.answer(backend, status, n)

        metrics_url = gateway.url
        params = {"phases": [50, 100], "interval_s": 10, "max_error_rate": 0.1, "min_requests": 10}
        w = await make_world(tmp_path, n=2, params=params)

        def control_plane(store: ControlStore) -> GatewayFleet:
            controller = Controller(store, {}, RoutesFeed(store), GatewayAnalyzer([metrics_url]))
            fleet = GatewayFleet(store, regions=w.fleet.regions, controller=controller)
            # The replicas outlive the control plane: the fake's view of them carries over.
            fleet.desired, fleet.ready, fleet.pairs = w.fleet.desired, w.fleet.ready, w.fleet.pairs
            return fleet

        await w.store.add_replica(
            Replica("rep_v2a", w.new_id, "local", "ready", backend, "http://127.0.0.1:9")
        )
        w.fleet = control_plane(w.store)
        answer("200", 30)  # before the phase: not the phase's to judge
        rec, now = await drive(w, until=lambda r: r.phase == "analysis:0")
        answer("200", 40)
        answer("503", 20)
        await w.store.close()

        store2 = ControlStore(w.url)
        await store2.start()
        fleet2 = control_plane(store2)
        assert fleet2.controller is not None
        await fleet2.controller.analyzer.scrape_once()  # its first sample, as at its start
        answer("200", 15)
        due = rec.state["weights_at"] + 10
        rec, _ = await drive(World(store2, fleet2, rec, w.old_id, w.new_id, w.url), max(now, due))
        assert rec.status == "rolled_back", rec.reason
        assert "error rate 0.27 > 0.1 over 75 requests" in (rec.reason or "")
        await store2.close()

    async def main() -> None:
        async with FakeGateway().serving() as gateway:
            await go(gateway)

    run(main())


def test_analysis_counts_a_restarted_gateway_from_zero() -> None:
    """A gateway's counters start again at zero when it restarts: the window then counts what
    it answered since (a counter reset, as Prometheus' increase() reads it), never a negative."""
    backend = "http://127.0.0.1:9/v2-a"

    async def go() -> None:
        first, restarted = FakeGateway(), FakeGateway()
        async with first.serving():
            analyzer = GatewayAnalyzer([first.url])
            first.answer(backend, "200", 50)
            assert await analyzer.scrape_once()
            baseline = analyzer.counters({backend})
        restarted.answer(backend, "200", 5)
        restarted.answer(backend, "503", 2)
        async with restarted.serving():
            analyzer.urls = [restarted.url]
            assert await analyzer.scrape_once()
            assert analyzer.analyze({backend}, 0.0, baseline) == Analysis(7, 2, None)

    run(go())


def test_a_fleet_error_midway_is_retried_by_the_next_advance(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=4)
        rec, now = await drive(w, until=lambda r: r.phase == "shift:2")
        w.fleet.scale_errors = 1
        errors = 0
        for _ in range(50):
            try:
                rec, nxt = await advance(rec, w.fleet, w.store, now)
            except ControlError as e:
                assert e.status == 503
                errors += 1
                continue
            w.fleet.tick()
            if rec.status != "running":
                break
            now = nxt
        assert errors == 1
        assert rec.status == "succeeded"
        assert w.fleet.weight_history("local", "v2") == [0, 25, 50, 75, 100]

    run(go())


def test_compare_and_set_refuses_a_stale_step(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2)
        rec, now = await drive(w, until=lambda r: r.phase == "analysis:0")

        class StaleStore:
            """Hands out the record as it was, as a second control plane that read it earlier would."""

            def __init__(self, inner: ControlStore, snapshot: RolloutRecord):
                self.inner, self.snapshot = inner, snapshot

            async def get_rollout(self, rollout_id: str) -> RolloutRecord:
                return self.snapshot

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        snapshot = rec
        rec, _ = await drive(w, now, until=lambda r: r.phase != "analysis:0")
        with pytest.raises(ControlError) as e:
            await advance(snapshot, w.fleet, StaleStore(w.store, snapshot), now + 1000)  # type: ignore[arg-type]
        assert e.value.status == 409

    run(go())


def test_abort_mid_rollout(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=4)
        rec, now = await drive(w, until=lambda r: r.phase == "analysis:0")
        flagged = await request_abort(w.store, rec, reason="operator said stop")
        assert flagged.state["abort_requested"] is True
        mark = len(w.fleet.calls)
        rec, nxt = await advance(rec, w.fleet, w.store, now)
        assert rec.phase == "rolling_back"
        assert w.fleet.calls[mark] == ("set_weights", "m", "local", {"v2": 0.0, "v1": 100.0})
        w.fleet.tick()
        rec, _ = await drive(w, nxt)
        assert rec.status == "rolled_back"
        assert "operator said stop (in phase analysis:0)" in (rec.reason or "")
        assert w.fleet.desired[(w.old_id, "local")] == 4
        assert w.fleet.desired[(w.new_id, "local")] == 0
        with pytest.raises(ControlError) as e:
            await request_abort(w.store, rec)
        assert e.value.status == 409
        # Finished: advance is a no-op.
        rec2, nxt2 = await advance(rec, w.fleet, w.store, now + 10_000)
        assert rec2.status == "rolled_back" and nxt2 == math.inf

    run(go())


def test_keep_failed_keeps_what_fits_the_surge(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2, params={"keep_failed": True})
        w.fleet.analysis = lambda version, region, weight: Analysis(10, 10, None)
        rec, _ = await drive(w)
        assert rec.status == "rolled_back"
        assert w.fleet.desired[(w.new_id, "local")] == 1  # cap 3 - old 2
        assert w.fleet.desired[(w.old_id, "local")] == 2
        assert ("deactivate", w.new_id) not in w.fleet.calls

    run(go())


# ---- fast rollback window, waves ------------------------------------------------------------


def test_fast_rollback_inside_the_window(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=3, params={"fast_rollback_window_s": 120, "warm_reserve": 1})
        rec, now = await drive(w, until=lambda r: r.phase == "promoted")
        assert w.fleet.desired[(w.old_id, "local")] == 1  # warm reserve
        assert w.fleet.weights[("m", "local")] == {"v2": 100.0, "v1": 0.0}
        await request_abort(w.store, rec, reason="fast rollback")
        mark = len(w.fleet.calls)
        rec, _ = await advance(rec, w.fleet, w.store, now + 1)
        # Instant: the first thing done is one weights publish back to the warm old version.
        assert w.fleet.calls[mark] == ("set_weights", "m", "local", {"v2": 0.0, "v1": 100.0})
        rec, _ = await drive(w, now + 2)
        assert rec.status == "rolled_back"
        assert w.fleet.desired[(w.old_id, "local")] == 3
        old = await w.store.get_deployment("m", "v1")
        assert old is not None and old.state == "active"

    run(go())


def test_waves_halt_in_region_2_rolls_back_regions_1_and_2(tmp_path: Path) -> None:
    async def go() -> None:
        regions = ("r1", "r2", "r3")
        params = {"waves": [["r1"], ["r2"], ["r3"]], "bake_s": 30, "phases": [50, 100]}
        w = await make_world(tmp_path, n=2, params=params, regions=regions)
        w.fleet.analysis = lambda version, region, weight: (
            Analysis(20, 10, None) if region == "r2" and weight == 100 else GOOD
        )
        rec, _ = await drive(w)
        assert rec.status == "halted"
        assert (rec.reason or "").startswith("analysis failed at 100% in r2: error rate 0.50 > 0.05")
        seq = await phase_sequence(w.store, rec.id)
        assert "bake:0" in seq and "bake:1" not in seq
        for region in ("r1", "r2"):
            assert w.fleet.weights[("m", region)] == {"v2": 0.0, "v1": 100.0}
            assert w.fleet.desired[(w.old_id, region)] == 2
            assert w.fleet.desired[(w.new_id, region)] == 0
        # Region 3 was never touched.
        assert not [c for c in w.fleet.calls if c[0] in ("scale", "set_weights") and c[2] == "r3"]
        assert w.fleet.desired[(w.old_id, "r3")] == 2
        # The rollback moved traffic in both regions before any replica changed.
        last_analyze = max(i for i, c in enumerate(w.fleet.calls) if c[0] == "analyze")
        back = (
            ("set_weights", "m", "r1", {"v2": 0.0, "v1": 100.0}),
            ("set_weights", "m", "r2", {"v2": 0.0, "v1": 100.0}),
        )
        assert tuple(w.fleet.calls[last_analyze + 1 : last_analyze + 3]) == back

    run(go())


def test_waves_succeed_in_order(tmp_path: Path) -> None:
    async def go() -> None:
        regions = ("r1", "r2")
        w = await make_world(
            tmp_path, n=1, params={"waves": [["r2"], ["r1"]], "phases": [100]}, regions=regions
        )
        rec, _ = await drive(w)
        assert rec.status == "succeeded"
        touched = [c[2] for c in w.fleet.calls if c[0] == "set_weights"]
        assert touched.index("r1") > max(i for i, r in enumerate(touched) if r == "r2") - 2
        assert touched[0] == "r2"

    run(go())


# ---- versioned and first deploys -----------------------------------------------------------


def test_versioned_rollout_serves_side_by_side(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2, strategy="versioned")
        await w.store.set_current("m", "v1")
        rec, _ = await drive(w)
        assert rec.status == "succeeded"
        assert await phase_sequence(w.store, rec.id) == ["starting", "health_gate", "done"]
        assert not [c for c in w.fleet.calls if c[0] == "set_weights"]
        v1 = await w.store.get_deployment("m", "v1")
        v2 = await w.store.get_deployment("m", "v2")
        assert v1 is not None and v1.current and v2 is not None and not v2.current
        assert v2.state == "active"

    run(go())


def test_versioned_promote_moves_current(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=1, strategy="versioned", params={"promote": True})
        await w.store.set_current("m", "v1")
        rec, _ = await drive(w)
        assert rec.status == "succeeded"
        v2 = await w.store.get_deployment("m", "v2")
        assert v2 is not None and v2.current

    run(go())


def test_first_deploy_and_its_failure(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=2, first=True)
        rec, _ = await drive(w)
        assert rec.status == "succeeded"
        assert w.fleet.desired[(w.new_id, "local")] == 2
        assert w.fleet.weights[("m", "local")] == {"v2": 100.0}

    async def broken(tmp: Path) -> None:
        w = await make_world(tmp, n=2, first=True)
        w.fleet.broken.add(w.new_id)
        rec, _ = await drive(w)
        assert rec.status == "failed"
        assert w.fleet.desired[(w.new_id, "local")] == 0

    run(go())
    (tmp_path / "b").mkdir()
    run(broken(tmp_path / "b"))


# ---- params and fingerprints -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"phases": []}, "phases"),
        ({"phases": [50, 25, 100]}, "increasing"),
        ({"phases": [25, 50]}, "end at 100"),
        ({"phases": [0, 100]}, "1..100"),
        ({"phases": [True, 100]}, "1..100"),
        ({"interval_s": -1}, "interval_s"),
        ({"health_timeout_s": 0}, "health_timeout_s"),
        ({"max_error_rate": 1.5}, "max_error_rate"),
        ({"surge": -1}, "surge"),
        ({"surge": 1.5}, "surge"),
        ({"keep_failed": "yes"}, "keep_failed"),
        ({"waves": [["a"], ["a"]]}, "twice"),
        ({"waves": [[]]}, "non-empty"),
        ({"bogus": 1}, "unknown"),
        ({"interval_s": float("nan")}, "finite"),
    ],
)
def test_params_are_validated(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        RolloutParams.from_dict(params)
    assert needle in e.value.message


def test_params_round_trip() -> None:
    p = RolloutParams.from_dict(
        {"phases": [10, 100], "waves": [["a", "b"], ["c"]], "max_p99_s": 2, "promote": True}
    )
    assert p.waves == (("a", "b"), ("c",))
    assert RolloutParams.from_dict(p.to_dict()) == p
    assert RolloutParams.from_dict(None) == RolloutParams()


def test_waves_must_cover_the_regions(tmp_path: Path) -> None:
    async def go() -> None:
        w = await make_world(tmp_path, n=1, regions=("r1", "r2"), params={"waves": [["r1"]]})
        rec, _ = await drive(w)
        assert rec.status == "failed"
        assert "must cover exactly" in (rec.reason or "")

    run(go())


def test_check_fingerprint() -> None:
    fp = {"kind": "generate", "tokenizer_sha256": "a", "chat_template_sha256": "b", "max_model_len": 2048}
    check_fingerprint(fp, dict(fp), force=False)
    changed = {**fp, "tokenizer_sha256": "z", "max_model_len": 4096}
    with pytest.raises(BadRequest) as e:
        check_fingerprint(fp, changed, force=False)
    assert "max_model_len, tokenizer_sha256" in e.value.message
    assert "use the versioned strategy or force" in e.value.message
    check_fingerprint(fp, changed, force=True)


def test_a_failing_reconcile_pass_with_a_step_due_backs_off():
    """A pass that fails while a rollout step is already due was run again at once, in a
    tight loop that starved the API on the same event loop (a NUL in a stored engine URI made
    every pass fail). After a failure the next pass waits, doubling up to the pass interval."""
    controller = Controller(None, {}, None, None, interval_s=5.0)  # type: ignore[arg-type]
    passes = 0

    async def failing() -> None:
        nonlocal passes
        passes += 1
        raise ValueError("embedded null byte")

    async def main() -> None:
        controller.reconcile = failing  # type: ignore[method-assign]
        controller._wake["ro_due"] = time.time() - 1  # a step already due
        loop = asyncio.create_task(controller._loop())
        await asyncio.sleep(1.0)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(main())
    assert 1 <= passes <= 6, passes  # 0.1 + 0.2 + 0.4 s waits fit in the second; thousands before
    assert controller.last_error == "ValueError: embedded null byte"
