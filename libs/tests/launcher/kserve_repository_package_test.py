"""A whole Triton model repository as a kserve-mode package:

* build_package takes the repository folder (no config at its top, `<model>/config.pbtxt`
  per model): model.json's layout is "repository", the model id must be one of its models
  (the one the control plane probes), a folder that is neither a model directory nor a
  repository is refused, and a lone model directory may carry config.pbtxt (its `name` is
  checked like config.json's);
* the control plane's fingerprint is the hash of every model's config: a changed config is a
  changed "kserve" field, a new booster is not;
* the launcher serves the package through `paved.kserve.main --model-repository`: every model
  and version answers over gRPC and HTTP, /health/ready is 200, SIGTERM exits 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost

from paved.control_plane.fingerprint import fingerprint_diff, fingerprint_package
from paved.launcher.build import build_package
from paved.launcher.gate import free_port
from paved.launcher.package import PackageError, parse_model_json
from paved.launcher.testing import LauncherProcess
from paved.runfiles import runfile

PBTXT = """
backend: "xgboost"
max_batch_size: 16
version_policy: { all { } }
input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 32 ] } ]
output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
parameters { key: "nthread" value { string_value: "1" } }
"""


def _booster(rounds: int) -> xgboost.Booster:
    rng = np.random.default_rng(rounds)
    x = rng.standard_normal((200, 32)).astype(np.float32)
    params = {"objective": "multi:softprob", "num_class": 3, "max_depth": 2, "nthread": 1, "seed": 0}
    return xgboost.train(params, xgboost.DMatrix(x, label=rng.integers(0, 3, 200)), num_boost_round=rounds)


def _repository(root) -> str:
    root = str(root)
    for version in ("1", "2"):
        os.makedirs(os.path.join(root, "scorer", version))
    shutil.copyfile(runfile("models/xgb/model.ubj"), os.path.join(root, "scorer", "1", "model.ubj"))
    _booster(3).save_model(os.path.join(root, "scorer", "2", "model.ubj"))
    with open(os.path.join(root, "scorer", "config.pbtxt"), "w") as f:
        f.write(PBTXT)
    # A second model in the protobuf-JSON form, its name left to its folder.
    os.makedirs(os.path.join(root, "ranker", "1"))
    _booster(2).save_model(os.path.join(root, "ranker", "1", "model.ubj"))
    with open(runfile("models/xgb/config.json")) as f:
        config = json.load(f)
    del config["name"]
    with open(os.path.join(root, "ranker", "config.json"), "w") as f:
        json.dump(config, f)
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    return _repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def package(tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("pkg") / "pkg"
    build_package(repo, str(out), "scorer", "1", mode="kserve")
    return out


def test_the_package_is_the_repository_named_by_one_of_its_models(package, repo, tmp_path):
    m = parse_model_json((package / "model.json").read_text())
    assert m.mode == "kserve" and m.tokenizer is None and m.kserve_layout() == "repository"
    assert {f.path for f in m.weights.files} >= {
        "scorer/config.pbtxt",
        "scorer/2/model.ubj",
        "ranker/config.json",
    }
    with pytest.raises(
        ValueError, match=r"model_id 'missing' is not a model of the repository \(\['ranker', 'scorer'\]\)"
    ):
        build_package(repo, str(tmp_path / "p1"), "missing", "1", mode="kserve")
    raw = json.loads((package / "model.json").read_text())
    raw["weights"]["files"] = [
        f for f in raw["weights"]["files"] if not f["path"].endswith(("config.pbtxt", ".json"))
    ]
    with pytest.raises(PackageError, match="found neither"):
        parse_model_json(json.dumps(raw))
    # A lone model directory may hold config.pbtxt: its top-level `name` must be the model id.
    lone = tmp_path / "lone"
    shutil.copytree(os.path.join(repo, "scorer"), lone)
    (lone / "config.pbtxt").write_text('name: "lone"  # the model\n' + PBTXT)
    assert (
        build_package(str(lone), str(tmp_path / "p2"), "lone", "1", mode="kserve").kserve_layout() == "model"
    )
    with pytest.raises(ValueError, match="names the model 'lone', not 'scorer'"):
        build_package(str(lone), str(tmp_path / "p3"), "scorer", "1", mode="kserve")


def test_the_fingerprint_follows_every_models_config(package, tmp_path):
    fp = fingerprint_package(str(package))
    assert fp["kind"] == "kserve" and set(fp["kserve"]) == {"configs_sha256"}
    # A new booster for a version keeps the interface; a changed config does not.
    repo = _repository(tmp_path / "repo")
    _booster(5).save_model(os.path.join(repo, "scorer", "2", "model.ubj"))
    build_package(repo, str(tmp_path / "same"), "scorer", "2", mode="kserve")
    assert fingerprint_diff(fp, fingerprint_package(str(tmp_path / "same"))) == []
    with open(os.path.join(repo, "ranker", "config.json")) as f:
        config = json.load(f)
    config["output"][0]["dims"] = [-1]
    with open(os.path.join(repo, "ranker", "config.json"), "w") as f:
        json.dump(config, f)
    build_package(repo, str(tmp_path / "changed"), "scorer", "3", mode="kserve")
    assert fingerprint_diff(fp, fingerprint_package(str(tmp_path / "changed"))) == ["kserve"]


def test_the_launcher_serves_every_model_and_version_of_the_repository(package, repo, tmp_path):
    grpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    args = [
        str(package), "--cache-dir", str(tmp_path / "cache"), "--port", str(http_port),
        "--admin-port", str(admin_port), "--grpc-port", str(grpc_port),
    ]  # fmt: skip
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
    try:
        assert proc.wait_line(r"paved launcher: ready: scorer:1 on http", 120), proc.stderr()[-3000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health/ready", timeout=10) as r:
            assert r.status == 200
        x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        h = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        try:
            for model, version, folder in (
                ("scorer", "1", "1"),
                ("scorer", "2", "2"),
                ("scorer", "", "2"),
                ("ranker", "", "1"),
            ):
                expected = xgboost.Booster(
                    model_file=os.path.join(repo, model, folder, "model.ubj")
                ).inplace_predict(x)
                for module, client in ((grpcclient, g), (httpclient, h)):
                    t = module.InferInput("input__0", [4, 32], "FP32")
                    t.set_data_from_numpy(x)
                    result = client.infer(model, [t], model_version=version)
                    assert np.array_equal(result.as_numpy("output__0"), expected), (model, version)
            index = {(m.name, m.version, m.state) for m in g.get_model_repository_index().models}
            assert index == {("scorer", "1", "READY"), ("scorer", "2", "READY"), ("ranker", "1", "READY")}
        finally:
            g.close()
            h.close()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr()[-3000:]
    finally:
        proc.kill()
