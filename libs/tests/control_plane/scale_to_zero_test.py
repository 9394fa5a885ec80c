"""Scale to zero without a fleet: the idle clock, the policy's validation (API and store), the
routes parser's models at zero, and the controller's decisions on a real SQLite store with a
driver that only records (idle -> zero with its audit event, the alias kept in the routes and
marked, concurrent wakes making one scale-up, the KPA never choosing zero)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.api import create_app
from paved.control_plane.autoscaler import Autoscaler, IdleClock, wants_scale_to_zero
from paved.control_plane.controller import Controller
from paved.control_plane.metrics_source import MetricsSourceError
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.control_plane.types import AutoscalePolicy, DeploymentSpec, Replica
from paved.gateway.access.auth import AdminAuth
from paved.gateway.errors import GatewayError
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import RoutesError, parse_routes
from paved.metrics.gauges import ReplicaMetrics

KEY = "admin-key-for-tests-0123456789"
ZERO = AutoscalePolicy(enabled=True, scale_to_zero_after_s=30.0)


# ---- the idle clock --------------------------------------------------------------------------


def test_the_idle_clock_is_due_only_after_the_delay_without_demand():
    clock = IdleClock(1000.0)
    assert not clock.due(ZERO, 0, 1029.9)
    assert clock.due(ZERO, 0, 1030.0)
    clock.demand(1020.0)  # a request seen: the delay starts again
    assert not clock.due(ZERO, 0, 1049.0) and clock.due(ZERO, 0, 1050.0)
    clock.demand(900.0)  # an older reading read late changes nothing
    clock.demand(None)
    assert clock.last_demand == 1020.0 and clock.idle_for(1050.0) == 30.0
    with pytest.raises(ValueError):
        clock.demand(float("nan"))


@pytest.mark.parametrize(
    ("policy", "min_replicas"),
    [
        (ZERO, 1),  # a floor above zero
        (dataclasses.replace(ZERO, enabled=False), 0),
        (dataclasses.replace(ZERO, scale_to_zero_after_s=None), 0),
    ],
)
def test_the_idle_clock_never_scales_to_zero_what_does_not_ask_for_it(policy, min_replicas):
    clock = IdleClock(0.0)
    assert not wants_scale_to_zero(policy, min_replicas)
    assert not clock.due(policy, min_replicas, 1e9)


# ---- validation ------------------------------------------------------------------------------


@pytest.fixture
def plane(tmp_path: Path):
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    feed = RoutesFeed(store)
    controller = Controller(store, {"local": _Records()}, feed, GatewayAnalyzer([]))
    app = create_app(store, controller, feed, AdminAuth(KEY).check)
    asyncio.run(store.start())
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c, store, controller


def _body(**autoscale: Any) -> dict[str, Any]:
    from fleet import tiny_package

    return {
        "model_id": "tiny",
        "version": "v1",
        "package_uri": tiny_package(),
        "engine": "sim://tiny",
        "min_replicas": 0,
        "autoscale": {"enabled": True, **autoscale},
    }


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"autoscale": {"scale_to_zero_after_s": 0}}, "autoscale.scale_to_zero_after_s", "greater than 0"),
        ({"autoscale": {"scale_to_zero_after_s": -1}}, "autoscale.scale_to_zero_after_s", "greater than 0"),
        ({"autoscale": {"scale_to_zero_after_s": 1e9}}, "autoscale.scale_to_zero_after_s", "less than"),
        ({"autoscale": {"scale_to_zero_after_s": "60"}}, "autoscale.scale_to_zero_after_s", None),
        ({"min_replicas": 1}, None, "needs min_replicas 0"),
        ({"autoscale": {"enabled": False, "scale_to_zero_after_s": 60}}, None, "needs autoscale.enabled"),
    ],
)
def test_a_bad_scale_to_zero_policy_is_a_400_naming_it(plane, change, param, words):
    client = plane[0]
    body = _body(scale_to_zero_after_s=60)
    autoscale = change.pop("autoscale", None)
    if autoscale is not None:
        body["autoscale"] = {"enabled": True, **autoscale}
    body.update(change)
    r = client.post("/v1/deployments", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if words is not None:
        assert words in error["message"], error


def test_a_valid_policy_is_stored_and_a_floor_above_zero_is_refused_later(plane):
    client = plane[0]
    r = client.post("/v1/deployments", json=_body(scale_to_zero_after_s=60))
    assert r.status_code == 201, r.text
    assert r.json()["autoscale"]["scale_to_zero_after_s"] == 60
    r = client.patch("/v1/deployments/tiny/v1", json={"min_replicas": 1})
    assert r.status_code == 400 and "needs min_replicas 0" in r.json()["error"]["message"], r.text
    r = client.post("/v1/models/nosuch/wake")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = client.post("/v1/models/bad%20name/wake")
    assert r.status_code == 400, r.text
    del client.headers["Authorization"]
    assert client.post("/v1/models/tiny/wake").status_code == 401


# ---- the routes parser -----------------------------------------------------------------------


def test_the_routes_parser_keeps_a_model_at_zero_and_nothing_else_without_backends():
    table = parse_routes({"models": [{"alias": "m", "scaled_to_zero": True, "waking": True}]})
    route = table.models["m"]
    assert route.scaled_to_zero and route.waking and route.backends == ()
    assert parse_routes(table.to_obj()) == table
    backend = {"url": "http://127.0.0.1:9", "version": "v1"}
    plain = parse_routes({"models": [{"alias": "m", "backends": [backend]}]})
    # Flags off are not written: tables without models at zero keep their revisions.
    assert "scaled_to_zero" not in plain.to_obj()["models"][0]
    bad = [
        ({"alias": "m", "backends": []}, "models[0].backends"),
        ({"alias": "m", "scaled_to_zero": True, "backends": [backend]}, "models[0].backends"),
        ({"alias": "m", "waking": True, "backends": [backend]}, "models[0].waking"),
        ({"alias": "m", "scaled_to_zero": "yes"}, "models[0].scaled_to_zero"),
        ({"alias": "m", "scaled_to_zero": True, "current": "v1"}, "models[0].current"),
        ({"alias": "m", "versions": ["v1"], "backends": [backend]}, "models[0].versions"),
        ({"alias": "m", "scaled_to_zero": True, "versions": "v1"}, "models[0].versions"),
        ({"alias": "m", "scaled_to_zero": True, "versions": ["v1", "v1"]}, "models[0].versions"),
        ({"alias": "m", "scaled_to_zero": True, "versions": ["v@1"]}, "models[0].versions[0]"),
        ({"alias": "m", "scaled_to_zero": True, "versions": [1]}, "models[0].versions[0]"),
    ]
    for model, where in bad:
        with pytest.raises(RoutesError) as caught:
            parse_routes({"models": [model]})
        assert str(caught.value).startswith(where + ":"), caught.value

    # At zero, the versions it will serve: pins to them are known, any other is not.
    pinned = parse_routes({"models": [{"alias": "m", "scaled_to_zero": True, "versions": ["v1", "v2"]}]})
    assert pinned.models["m"].versions == ("v1", "v2") and pinned.models["m"].backends == ()
    assert parse_routes(pinned.to_obj()) == pinned
    router = Router(pinned)
    assert router.route("m@v2").alias == "m"
    with pytest.raises(GatewayError) as caught:
        router.route("m@v9")
    assert caught.value.status == 404
    with pytest.raises(GatewayError) as caught:
        Router(table).route("m@v1")  # a table at zero that lists no version: every pin unknown
    assert caught.value.status == 404


# ---- the controller --------------------------------------------------------------------------


class _Records:
    """A driver whose replicas are records only."""

    async def create(self, req: Any) -> Replica:
        raise AssertionError("the test's controller loop is not running")

    async def drain(self, replica: Replica, timeout_s: float = 30.0) -> None:
        pass

    async def delete(self, replica: Replica) -> None:
        pass

    async def alive(self, replica: Replica) -> bool:
        return True

    async def exit_reason(self, replica: Replica) -> str | None:
        return None

    async def locate(self, replica: Replica) -> Replica:
        return replica


async def _deployment(store: ControlStore, model: str, policy: AutoscalePolicy, replicas: int = 1) -> Any:
    spec = DeploymentSpec(
        model_id=model, version="v1", package_uri="/pkg", min_replicas=0, max_replicas=4,
        replicas=replicas, regions=("local",), engine="sim://tiny", autoscale=policy,
    )  # fmt: skip
    return await store.create_deployment(spec, {"kind": "generate"})


def test_an_idle_deployment_goes_to_zero_stays_routed_and_concurrent_wakes_make_one_scale_up(tmp_path):
    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        feed = RoutesFeed(store)
        controller = Controller(store, {"local": _Records()}, feed, GatewayAnalyzer([]))
        try:
            d = await _deployment(store, "tiny", ZERO)
            plain = await _deployment(store, "other", dataclasses.replace(ZERO, scale_to_zero_after_s=None))
            # Watched for longer than the delay with no demand (the clock is set back rather
            # than the test waiting 30 s).
            controller._idle[d.id] = IdleClock(time.time() - 60)
            await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) == {"local": 0}
            assert await store.get_desired(plain.id) == {}  # no policy: untouched
            (event,) = [e for e in await store.list_audit(model_id="tiny") if e.kind == "autoscale"]
            assert event.data["mode"] == "to_zero" and "scaled to zero" in event.message, event

            table = await controller.routes_table()
            (model,) = table["models"]  # "other" has no replica and no policy: not routed
            assert model == {
                "alias": "tiny",
                "kind": "generate",
                "strategy": "least_outstanding",
                "backends": [],
                "scaled_to_zero": True,
                "versions": ["v1"],  # what a wake brings up: tiny@v1 is held, not a 404
            }
            await controller.publish_routes()  # the gateway's parser accepts it

            answers = await asyncio.gather(*(controller.wake("tiny") for _ in range(5)))
            assert await store.get_desired(d.id) == {"local": 1}
            assert [a["woke"] for a in answers].count({}) == 4, answers
            assert {a["state"] for a in answers} == {"waking"}
            wakes = [e for e in await store.list_audit(model_id="tiny") if e.data.get("mode") == "wake"]
            assert len(wakes) == 1, wakes
            woken = await store.get_deployment("tiny", "v1")
            assert woken is not None and woken.last_traffic_at is not None  # demand recorded
            (model,) = (await controller.routes_table())["models"]
            assert model["scaled_to_zero"] and model["waking"]

            # Its first replica is ready: routed like any other, the marks gone.
            await store.add_replica(
                Replica(
                    id="rep_1", deployment_id=d.id, region="local", state="ready",
                    url="http://127.0.0.1:9", admin_url="http://127.0.0.1:9",
                )
            )  # fmt: skip
            (model,) = (await controller.routes_table())["models"]
            assert len(model["backends"]) == 1 and "scaled_to_zero" not in model and "waking" not in model
            assert (await controller.wake("tiny"))["state"] == "serving"
            assert (await controller.wake("other"))["state"] == "not_scaled_to_zero"
            assert await store.get_desired(plain.id) == {}
        finally:
            await store.close()

    asyncio.run(main())


def test_the_kpa_never_chooses_zero_for_an_idle_deployment(tmp_path):
    """Zero load with min_replicas 0, past the scale-down delay: the KPA steps down to one
    replica, not to zero (zero is the idle clock's decision, after its own delay)."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        controller = Controller(store, {"local": _Records()}, RoutesFeed(store), GatewayAnalyzer([]))
        try:
            policy = dataclasses.replace(ZERO, scale_to_zero_after_s=3600.0, scale_down_delay_s=2.0)
            d = await _deployment(store, "tiny", policy, replicas=2)
            for i in range(2):
                await store.add_replica(
                    Replica(
                        id=f"rep_{i}", deployment_id=d.id, region="local", state="ready",
                        url=f"http://127.0.0.1:{9 + i}", admin_url="http://127.0.0.1:9",
                    )
                )  # fmt: skip
            await store.set_desired(d.id, "local", 2)
            # Its own clock, a second on at every reading: by the second pass the scale-down
            # delay has passed.
            ticks = iter(range(10_000))
            controller._scalers[(d.id, "local")] = Autoscaler(policy, clock=lambda: float(next(ticks)))
            await controller._autoscale(await store.list_deployments())
            await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) == {"local": 1}
        finally:
            await store.close()

    asyncio.run(main())


class _Gauges:
    """A metrics source whose replicas all carry `load` (ReplicaMetrics), or none answers."""

    name = "test"
    configured = True

    def __init__(self, load: ReplicaMetrics) -> None:
        self.load = load
        self.up = True
        self.asked: list[list[str]] = []

    async def gateway_counters(self) -> Any:
        raise MetricsSourceError("no gateway counters in this test")

    async def replica_gauges(self, replicas: Any, model_id: str) -> list[ReplicaMetrics]:
        self.asked.append([r.id for r in replicas])
        return [self.load for _ in replicas] if self.up else []


async def _ready(store: ControlStore, d: Any, n: int, region: str = "local", start: int = 0) -> None:
    for i in range(start, start + n):
        await store.add_replica(
            Replica(
                id=f"rep_{region}_{i}", deployment_id=d.id, region=region, state="ready",
                url=f"http://127.0.0.1:{9 + i}", admin_url="http://127.0.0.1:9",
                metrics_url=f"http://127.0.0.1:{9 + i}/metrics",
            )
        )  # fmt: skip


def test_a_metrics_outage_is_held_not_read_as_zero_load(tmp_path):
    """Replicas whose gauges cannot be read (Prometheus down, every scrape failing) are not
    idle: the KPA holds (a loaded deployment kept its size), and the idle clock does not run
    (a scale-to-zero deployment is not taken to zero while it serves). Both happened before."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        source = _Gauges(ReplicaMetrics(waiting=8, running=16, kv_usage=0.9))
        controller = Controller(
            store, {"local": _Records()}, RoutesFeed(store), GatewayAnalyzer([], source=source)
        )
        try:
            policy = AutoscalePolicy(enabled=True, scale_down_delay_s=2.0)
            d = await _deployment(store, "busy", dataclasses.replace(policy), replicas=4)
            await _ready(store, d, 4)
            await store.set_desired(d.id, "local", 4)
            ticks = iter(range(10_000))
            controller._scalers[(d.id, "local")] = Autoscaler(policy, clock=lambda: float(next(ticks)))
            for _ in range(3):
                await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) == {"local": 4}
            source.up = False
            for _ in range(80):  # well past the scale-down delay on the scaler's clock
                await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) == {"local": 4}

            z = await _deployment(store, "sleepy", ZERO)
            await _ready(store, z, 1, start=10)
            controller._idle[z.id] = IdleClock(time.time() - 60)  # last demand long ago
            await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(z.id) == {}  # still serving, not taken to zero
        finally:
            await store.close()

    asyncio.run(main())


def test_each_region_is_sized_for_its_own_load(tmp_path):
    """Two regions of two replicas, each exactly at its target: each keeps two. One scaler for
    the whole deployment sized every region for the total load (4 each, 8 for a load of 4)."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        source = _Gauges(ReplicaMetrics(waiting=0, running=8, kv_usage=0.2))
        drivers = {"a": _Records(), "b": _Records()}
        controller = Controller(store, drivers, RoutesFeed(store), GatewayAnalyzer([], source=source))  # type: ignore[arg-type]
        try:
            policy = AutoscalePolicy(enabled=True, target_in_flight=8)
            spec = DeploymentSpec(
                model_id="m", version="v1", package_uri="/pkg", min_replicas=1, max_replicas=8,
                replicas=2, regions=("a", "b"), engine="sim://tiny", autoscale=policy,
            )  # fmt: skip
            d = await store.create_deployment(spec, {"kind": "generate"})
            for region in ("a", "b"):
                await _ready(store, d, 2, region=region)
                await store.set_desired(d.id, region, 2)
            for _ in range(3):
                await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) == {"a": 2, "b": 2}
            assert sorted(len(ids) for ids in source.asked[:2]) == [2, 2]  # read region by region
        finally:
            await store.close()

    asyncio.run(main())


# ---- the dashboard ---------------------------------------------------------------------------


def test_the_dashboard_shows_models_at_zero_and_waking_with_their_held_requests():
    from paved.control_plane.dashboard import _merge_usage, parse_gateway_usage, traffic_split

    routes = {
        "models": [
            {"alias": "a", "backends": [], "scaled_to_zero": True},
            {"alias": "b", "backends": [], "scaled_to_zero": True, "waking": True},
        ]
    }
    assert [(t["alias"], t["zero"], t["versions"]) for t in traffic_split(routes)] == [
        ("a", "scaled_to_zero", []),
        ("b", "waking", []),
    ]
    text = 'paved_gateway_held_requests{model="b"} 3.0\n'
    parts = [parse_gateway_usage(text), parse_gateway_usage(text)]
    assert _merge_usage(parts)["held"] == {"b": 6.0}


def test_the_sim_engines_start_delay_is_a_checked_uri_option():
    from paved.engine.sim_config import SimConfig

    assert SimConfig.from_uri("sim://tiny?start_delay_s=2.5").start_delay_s == 2.5
    assert SimConfig.from_uri("sim://tiny").start_delay_s == 0
    for bad in ("-1", "nan", "4000", "soon"):
        with pytest.raises(ValueError, match="start_delay_s"):
            SimConfig.from_uri(f"sim://tiny?start_delay_s={bad}")


def test_a_woken_deployment_is_not_put_back_to_zero_while_its_replica_starts(tmp_path):
    """A cold start longer than the idle delay: the replica a wake started has not served yet,
    so the deployment is not idle; once it is ready the delay counts again."""

    async def main() -> None:
        store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
        await store.start()
        controller = Controller(store, {"local": _Records()}, RoutesFeed(store), GatewayAnalyzer([]))
        try:
            d = await _deployment(store, "tiny", ZERO)
            await store.add_replica(
                Replica(
                    id="rep_1", deployment_id=d.id, region="local", state="starting",
                    url="", admin_url="",
                )
            )  # fmt: skip
            controller._idle[d.id] = IdleClock(time.time() - 60)
            await controller._autoscale(await store.list_deployments())
            assert await store.get_desired(d.id) != {"local": 0}
            assert not [e for e in await store.list_audit(model_id="tiny") if e.data.get("mode") == "to_zero"]
        finally:
            await store.close()

    asyncio.run(main())
