"""Every model of a kserve package that is a Triton model repository is routed, not only the
model_id the package names:

1. the route table: the fingerprint records the repository's models; each other model gets
   its own route to the replicas of the package versions that hold it (same weights, options
   and scale-to-zero marks), a name that is another deployment's model_id stays that
   deployment's, and a wake of another model wakes the package;
2. for real (the control-plane main, the local driver's launcher serving the repository, a
   gateway main following the routes): both models of the package answer through the
   gateway over KServe gRPC and HTTP, equal to xgboost's own predictions.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from fleet import FAST, gateway_for, make_fleet

from paved.control_plane.analysis import GatewayAnalyzer
from paved.control_plane.controller import Controller, repository_models
from paved.control_plane.fingerprint import fingerprint_package
from paved.control_plane.local_driver import LocalDriver
from paved.control_plane.routes_feed import RoutesFeed
from paved.control_plane.store import ControlStore
from paved.control_plane.types import AutoscalePolicy, DeploymentSpec, Replica
from paved.gateway.routing.routes import parse_routes
from paved.launcher.build import build_package
from paved.runfiles import runfile

PBTXT = """
backend: "xgboost"
max_batch_size: 16
input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 32 ] } ]
output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
parameters { key: "nthread" value { string_value: "1" } }
"""


def _repository(root: Path) -> Path:
    """scorer (the package's model_id, the shipped booster) and ranker (a booster of its own)."""
    for model in ("scorer", "ranker"):
        (root / model / "1").mkdir(parents=True)
        (root / model / "config.pbtxt").write_text(PBTXT)
    shutil.copyfile(runfile("models/xgb/model.ubj"), root / "scorer" / "1" / "model.ubj")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((200, 32)).astype(np.float32)
    params = {"objective": "multi:softprob", "num_class": 3, "max_depth": 2, "nthread": 1, "seed": 0}
    booster = xgboost.train(params, xgboost.DMatrix(x, label=rng.integers(0, 3, 200)), num_boost_round=2)
    booster.save_model(str(root / "ranker" / "1" / "model.ubj"))
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return _repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def package(tmp_path_factory, repo) -> str:
    out = tmp_path_factory.mktemp("pkg") / "pkg"
    build_package(str(repo), str(out), "scorer", "1", mode="kserve")
    return str(out)


def test_the_fingerprint_lists_the_repositorys_models(package):
    fp = fingerprint_package(package)
    assert fp["kind"] == "kserve" and fp["models"] == ["ranker", "scorer"]


def _replica(d, port: int) -> Replica:
    return Replica(
        id=f"rep_{d.spec.model_id}_{d.spec.version}", deployment_id=d.id, region="local", state="ready",
        url=f"http://127.0.0.1:{port}", admin_url=f"http://127.0.0.1:{port}",
        kserve_grpc=f"127.0.0.1:{port + 1000}", kserve_http=f"http://127.0.0.1:{port}",
    )  # fmt: skip


def test_every_model_of_the_package_gets_a_route(tmp_path, package):
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31500, 31520), work_dir=tmp_path / "work")
    controller = Controller(store, {"local": driver}, RoutesFeed(store), GatewayAnalyzer([]))
    fp = fingerprint_package(package)

    async def run():
        await store.start()
        spec = {"package_uri": package, "engine": "package", "route": {"max_model_len": 64}}
        v1 = await store.create_deployment(DeploymentSpec(model_id="scorer", version="v1", **spec), fp)
        # v2 of the package no longer holds ranker: ranker stays on v1's replicas alone.
        v2 = await store.create_deployment(
            DeploymentSpec(model_id="scorer", version="v2", **spec), {**fp, "models": ["scorer"]}
        )
        await controller.activate(v1.id)
        for d, port in ((v1, 1), (v2, 2)):
            await store.add_replica(_replica(d, port))
        table = await controller.routes_table()
        # A deployment whose model_id is "ranker" takes the name back.
        own = await store.create_deployment(
            DeploymentSpec(model_id="ranker", version="v1", package_uri=package, engine="package"), fp
        )
        await store.add_replica(_replica(own, 3))
        taken = await controller.routes_table()
        owners = repository_models(await store.list_deployments())
        return table, taken, owners

    table, taken, owners = asyncio.run(run())
    parse_routes(table)  # what the gateway accepts
    routes = {m["alias"]: m for m in table["models"]}
    assert set(routes) == {"scorer", "ranker"}
    scorer, ranker = routes["scorer"], routes["ranker"]
    assert [(b["version"], b["weight"], b["kserve_grpc"]) for b in ranker["backends"]] == [
        ("v1", 1.0, "127.0.0.1:1001")
    ]
    assert {b["version"] for b in scorer["backends"]} == {"v1", "v2"}
    assert ranker["kind"] == "kserve" and ranker["max_model_len"] == 64
    assert {k: v for k, v in ranker.items() if k not in ("alias", "backends")} == {
        k: v for k, v in scorer.items() if k not in ("alias", "backends")
    }
    # Once "ranker" is a deployment's own model_id, the repository's model of that name is not
    # routed to the scorer package any more (one route per name).
    by_alias = {m["alias"]: m for m in taken["models"]}
    assert {b["url"] for b in by_alias["ranker"]["backends"]} == {"http://127.0.0.1:3"}
    assert owners == {}


def test_a_wake_of_another_model_wakes_the_package(tmp_path, package):
    store = ControlStore(f"sqlite:///{tmp_path / 'cp.sqlite'}")
    driver = LocalDriver("local", port_range=(31500, 31520), work_dir=tmp_path / "work")
    controller = Controller(store, {"local": driver}, RoutesFeed(store), GatewayAnalyzer([]))
    fp = fingerprint_package(package)

    async def run():
        await store.start()
        spec = DeploymentSpec(
            model_id="scorer", version="v1", package_uri=package, engine="package", min_replicas=0,
            autoscale=AutoscalePolicy(enabled=True, scale_to_zero_after_s=60),
        )  # fmt: skip
        d = await store.create_deployment(spec, fp)
        await controller.activate(d.id)
        await store.set_desired(d.id, "local", 0)
        table = await controller.routes_table()
        woke = await controller.wake("ranker")
        return table, woke, await store.get_desired(d.id)

    table, woke, desired = asyncio.run(run())
    ranker = next(m for m in table["models"] if m["alias"] == "ranker")
    assert ranker["scaled_to_zero"] and ranker["versions"] == ["v1"] and ranker["backends"] == []
    assert woke["woke"] == {"scorer@v1": {"local": 1}} and desired == {"local": 1}


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def test_both_models_answer_through_the_gateway_over_grpc_and_http(fleet, tmp_path, repo, package):
    cp, _, _ = fleet()
    gw = gateway_for(cp, tmp_path / "gwk", "--kserve-grpc-port", "0")
    try:
        gw.tenant("team")
        auth = {"authorization": f"Bearer {gw.key('team')}"}
        cp.api(
            "POST",
            "/v1/deployments",
            {"model_id": "scorer", "version": "v1", "package_uri": package, "engine": "package"},
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "scorer", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded"
        x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
        gc = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
        hc = httpclient.InferenceServerClient(gw.url.removeprefix("http://"))
        try:
            cp.wait_for(
                "both models ready through the gateway",
                lambda: all(gc.is_model_ready(m, headers=auth) for m in ("scorer", "ranker")),
            )
            for model in ("scorer", "ranker"):
                booster = xgboost.Booster(model_file=os.path.join(repo, model, "1", "model.ubj"))
                expected = booster.inplace_predict(x)
                for module, client in ((grpcclient, gc), (httpclient, hc)):
                    t = module.InferInput("input__0", [4, 32], "FP32")
                    t.set_data_from_numpy(x)
                    result = client.infer(model, [t], headers=dict(auth))
                    assert np.array_equal(result.as_numpy("output__0"), expected), (model, module.__name__)
            index = {m["name"] for m in gc.get_model_repository_index(headers=auth, as_json=True)["models"]}
            assert index == {"scorer", "ranker"}
        finally:
            gc.close()
            hc.close()
    finally:
        gw.stop()
