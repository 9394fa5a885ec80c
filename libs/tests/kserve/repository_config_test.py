"""Triton model repositories served unchanged (paved.kserve.model_config, ModelRepository):

* config.pbtxt as Triton writes it (dynamic_batching, instance_group, parameters, reshape,
  optional, version_policy latest / all / specific) parses into tritonclient's ModelConfig;
  config.json still does; a name other than the directory's, two configs that differ, and
  a policy selecting no version are refused with the reason;
* the strict check names every field a backend does not implement, nested ones included;
* a repository directory served over gRPC and HTTP with tritonclient: version "1", "2" and
  "" (the latest) answer from their own boosters and say which version answered; metadata
  lists the versions; the latest policy loads only the newest folder; a model with an
  unsupported field (response_cache) or an unknown backend is listed UNAVAILABLE with its reason (and
  refuses requests with it) while the others serve; ServerReady stays false (strict
  readiness, as Triton's default);
* `paved.kserve.main --model-repository` serves a repository as a process and refuses a
  path that is not a directory with exit 2.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import kserve_main, run_kserve_main, serving, wait_for, xgb_model_dir
from paved.kserve.backends import ModelConfigError
from paved.kserve.model_config import (
    KIND_CPU,
    check_config,
    read_model_config,
    specs_from_config,
    versions_to_load,
)
from paved.kserve.server import KServeServer

# A config as found in Triton deployments (comments, nested lists, map entries).
TRITON_PBTXT = """
# A Triton model configuration, protobuf text format.
name: "scorer"
backend: "xgboost"
max_batch_size: 64
version_policy: { specific { versions: [ 1, 3 ] } }
input [
  {
    name: "features"
    data_type: TYPE_FP32
    dims: [ 4, 8 ]
    reshape: { shape: [ 32 ] }
  },
  {
    name: "mask"
    data_type: TYPE_BOOL
    dims: [ -1 ]
    optional: true
  }
]
output [
  {
    name: "scores"
    data_type: TYPE_FP32
    dims: [ 3 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 8, 16 ]
  max_queue_delay_microseconds: 100
  default_queue_policy { max_queue_size: 128 }
}
instance_group [ { count: 2, kind: KIND_CPU } ]
parameters: { key: "predict_type" value: { string_value: "margin" } }
parameters [ { key: "nthread", value: { string_value: "1" } } ]
"""

XGB_PBTXT = """
backend: "xgboost"
max_batch_size: 64
%(policy)s
input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 32 ] } ]
output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 preferred_batch_size: [ 8 ] }
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "nthread" value { string_value: "1" } }
"""
SUPPORTED = {"dynamic_batching", "instance_group", "parameters"}


def _model_dir(root, name: str, text: str, versions=()) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.pbtxt"), "w") as f:
        f.write(text)
    for version in versions:
        os.makedirs(os.path.join(path, str(version)), exist_ok=True)
    return path


# ---- parsing -----------------------------------------------------------------------------------
def test_a_triton_pbtxt_parses_with_every_field(tmp_path):
    path = _model_dir(tmp_path, "scorer", TRITON_PBTXT, versions=(1, 2, 3, "04", "notes"))
    config = read_model_config(path)
    assert (config.name, config.backend, config.max_batch_size) == ("scorer", "xgboost", 64)
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 128
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, KIND_CPU)]
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "predict_type": "margin",
        "nthread": "1",
    }
    inputs, outputs = specs_from_config(config)
    features, mask = inputs
    assert (features.datatype, features.dims, features.reshape, features.optional) == (
        "FP32",
        (4, 8),
        (32,),
        False,
    )
    assert (mask.datatype, mask.dims, mask.reshape, mask.optional) == ("BOOL", (-1,), None, True)
    assert [(o.name, o.dims) for o in outputs] == [("scores", (3,))]
    # Clients send dims; the model sees the reshape (batch dimension kept), and back.
    x = np.arange(2 * 32, dtype=np.float32).reshape(2, 4, 8)
    assert features.to_model(x, 64).shape == (2, 32)
    assert np.array_equal(features.to_model(x, 64), x.reshape(2, 32))
    assert mask.to_model(x, 64) is x
    # Specific versions: 1 and 3 (2 is present but not named; "04" is not a version folder).
    assert versions_to_load(path, config) == ["1", "3"]
    check_config(config, SUPPORTED, backend="test")


def test_output_reshape_maps_the_models_shape_back_to_dims(tmp_path):
    text = TRITON_PBTXT.replace("dims: [ 3 ]\n", "dims: [ 3 ]\n    reshape: { shape: [ 1, 3 ] }\n")
    config = read_model_config(_model_dir(tmp_path, "scorer", text))
    (scores,) = specs_from_config(config)[1]
    assert scores.reshape == (1, 3)
    assert scores.from_model(np.zeros((5, 1, 3), np.float32), 64).shape == (5, 3)


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("", ["3"]),  # Triton's default: the latest one
        ("version_policy: { latest { num_versions: 2 } }", ["2", "3"]),
        ("version_policy: { all { } }", ["1", "2", "3"]),
        ("version_policy: { specific { versions: [ 2, 7 ] } }", ["2"]),  # 7 has no folder: skipped
    ],
)
def test_version_policies(tmp_path, policy, expected):
    path = _model_dir(tmp_path, "m", XGB_PBTXT % {"policy": policy}, versions=(1, 2, 3))
    assert versions_to_load(path, read_model_config(path)) == expected


def test_a_policy_selecting_nothing_is_refused(tmp_path):
    path = _model_dir(
        tmp_path, "m", XGB_PBTXT % {"policy": "version_policy: { specific { versions: [ 9 ] } }"}
    )
    os.makedirs(os.path.join(path, "1"))
    with pytest.raises(
        ModelConfigError, match=r"specific \[9\] selects no version; version folders present: \['1'\]"
    ):
        versions_to_load(path, read_model_config(path))


def test_config_json_is_accepted_and_names_are_the_directorys(tmp_path):
    path = os.path.join(tmp_path, "m")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"backend": "xgboost", "max_batch_size": 4}')
    assert read_model_config(path).name == "m"
    # The same config in both forms is fine; two that differ are refused (Triton reads one).
    with open(os.path.join(path, "config.pbtxt"), "w") as f:
        f.write('backend: "xgboost"\nmax_batch_size: 4\n')
    assert read_model_config(path).max_batch_size == 4
    with open(os.path.join(path, "config.pbtxt"), "w") as f:
        f.write('backend: "xgboost"\nmax_batch_size: 8\n')
    with pytest.raises(ModelConfigError, match="both present and differ"):
        read_model_config(path)
    os.remove(os.path.join(path, "config.json"))
    with open(os.path.join(path, "config.pbtxt"), "w") as f:
        f.write('name: "other"\nbackend: "xgboost"\n')
    with pytest.raises(ModelConfigError, match="the name must be the directory's"):
        read_model_config(path)
    # A lone model directory (--model-dir) is named by its config.
    assert read_model_config(path, in_repository=False).name == "other"
    with open(os.path.join(path, "config.pbtxt"), "w") as f:
        f.write("backend: xgboost {")
    with pytest.raises(ModelConfigError, match=r"config\.pbtxt"):
        read_model_config(path)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("sequence_batching { }", "sequence_batching"),
        ("optimization { priority: PRIORITY_MAX }", "optimization"),
        ("model_transaction_policy { decoupled: true }", "model_transaction_policy"),
        ("dynamic_batching { priority_levels: 2 }", "dynamic_batching.priority_levels"),
        (
            "dynamic_batching { default_queue_policy { default_timeout_microseconds: 5 } }",
            "default_timeout_microseconds",
        ),
        (
            "instance_group [ { count: 1 kind: KIND_CPU rate_limiter { priority: 1 } } ]",
            r"instance_group\[0\].rate_limiter",
        ),
        ("instance_group [ { kind: KIND_GPU } ]", "instance_group kind KIND_GPU"),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true } ]',
            r"input\[0\].is_shape_tensor",
        ),
        (
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "l.txt" } ]',
            r"output\[0\].label_filename",
        ),
        ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]', r"dims \[0\]"),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] reshape { shape: [ 3 ] } } ]',
            "does not hold",
        ),
        ('output [ { name: "y" dims: [ 1 ] } ]', "data_type must be set"),
        ("dynamic_batching { preferred_batch_size: [ 65 ] }", "preferred_batch_size"),
    ],
)
def test_check_config_names_what_the_backend_does_not_do(tmp_path, extra, needle):
    base = 'backend: "xgboost"\nmax_batch_size: 64\n'
    config = read_model_config(_model_dir(tmp_path, "m", base + extra))
    with pytest.raises(ModelConfigError, match=needle):
        check_config(config, SUPPORTED, backend="test")


def test_a_harmless_transaction_policy_is_accepted(tmp_path):
    config = read_model_config(_model_dir(tmp_path, "m", "model_transaction_policy { decoupled: false }"))
    check_config(config, SUPPORTED, backend="test")


# ---- a repository served -------------------------------------------------------------------------
def _booster(rounds: int, seed: int) -> xgboost.Booster:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((300, 32)).astype(np.float32)
    y = rng.integers(0, 3, 300)
    params = {"objective": "multi:softprob", "num_class": 3, "max_depth": 2, "nthread": 1, "seed": 0}
    return xgboost.train(params, xgboost.DMatrix(x, label=y), num_boost_round=rounds)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("repo"))
    fixture = os.path.join(xgb_model_dir(), "model.ubj")
    # Two versions, both served; version 2 is another booster.
    path = _model_dir(root, "scorer", XGB_PBTXT % {"policy": "version_policy: { all { } }"}, versions=(1, 2))
    shutil.copyfile(fixture, os.path.join(path, "1", "model.ubj"))
    _booster(4, 1).save_model(os.path.join(path, "2", "model.ubj"))
    # The default policy: only the latest folder (3) loads.
    path = _model_dir(root, "latest", XGB_PBTXT % {"policy": ""}, versions=(1, 3))
    shutil.copyfile(fixture, os.path.join(path, "1", "model.ubj"))
    _booster(3, 2).save_model(os.path.join(path, "3", "model.ubj"))
    # Refused: a field the xgboost backend does not implement, and a backend paved lacks.
    path = _model_dir(
        root, "cached", XGB_PBTXT % {"policy": "response_cache { enable: true }"}, versions=(1,)
    )
    shutil.copyfile(fixture, os.path.join(path, "1", "model.ubj"))
    _model_dir(root, "tf", 'platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n', versions=(1,))
    os.makedirs(os.path.join(root, ".cache"))  # hidden: not a model
    return root


@pytest.fixture(scope="module")
def server(loop, repo):
    with serving(loop, KServeServer(host="127.0.0.1", grpc_port=0, http_port=0, model_repository=repo)) as s:
        yield s


def _x(rows: int = 3) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((rows, 32)).astype(np.float32)


def _infer(module, client, model: str, version: str):
    t = module.InferInput("input__0", [3, 32], "FP32")
    t.set_data_from_numpy(_x())
    return client.infer(model, [t], model_version=version)


@pytest.mark.parametrize("module_name", ["grpc", "http"])
def test_versions_answer_from_their_own_boosters(repo, gc, hc, module_name):
    module, client = (grpcclient, gc) if module_name == "grpc" else (httpclient, hc)
    booster = {
        v: xgboost.Booster(model_file=os.path.join(repo, "scorer", v, "model.ubj")) for v in ("1", "2")
    }
    expected = {v: b.inplace_predict(_x()) for v, b in booster.items()}
    assert not np.array_equal(expected["1"], expected["2"])
    for asked, served in (("1", "1"), ("2", "2"), ("", "2")):
        result = _infer(module, client, "scorer", asked)
        assert np.array_equal(result.as_numpy("output__0"), expected[served]), asked
        version = (
            result.get_response()["model_version"]
            if module_name == "http"
            else result.get_response().model_version
        )
        assert version == served
    assert client.is_model_ready("scorer", "1") and client.is_model_ready("scorer", "2")
    assert not client.is_model_ready("scorer", "3")
    with pytest.raises(InferenceServerException, match="'scorer' version 3 is not found"):
        _infer(module, client, "scorer", "3")
    meta = client.get_model_metadata("scorer", "1")
    versions = meta["versions"] if module_name == "http" else list(meta.versions)
    assert versions == ["1", "2"]


def test_the_latest_policy_loads_only_the_newest_folder(gc, repo):
    expected = xgboost.Booster(model_file=os.path.join(repo, "latest", "3", "model.ubj")).inplace_predict(
        _x()
    )
    result = _infer(grpcclient, gc, "latest", "")
    assert np.array_equal(result.as_numpy("output__0"), expected)
    assert result.get_response().model_version == "3"
    assert list(gc.get_model_metadata("latest").versions) == ["3"]
    with pytest.raises(InferenceServerException, match="'latest' version 1 is not found"):
        _infer(grpcclient, gc, "latest", "1")


def test_refused_models_are_listed_with_their_reason_while_the_rest_serve(gc, hc):
    index = {
        (m["name"], m["version"]): (m["state"], m.get("reason", "")) for m in hc.get_model_repository_index()
    }
    assert index[("scorer", "1")] == ("READY", "")
    assert index[("scorer", "2")] == ("READY", "")
    assert index[("latest", "3")] == ("READY", "")
    state, reason = index[("cached", "1")]
    assert state == "UNAVAILABLE" and "does not support response_cache" in reason, reason
    state, reason = index[("tf", "")]
    assert state == "UNAVAILABLE" and "tensorflow_savedmodel" in reason, reason
    assert not any(name == ".cache" for name, _ in index)
    grpc_index = {(m.name, m.version): (m.state, m.reason) for m in gc.get_model_repository_index().models}
    assert grpc_index == index
    # Their requests are refused with the reason; the server is not ready (strict readiness).
    with pytest.raises(InferenceServerException, match="response_cache") as e:
        _infer(grpcclient, gc, "cached", "")
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="tensorflow_savedmodel"):
        _infer(httpclient, hc, "tf", "1")
    assert not gc.is_model_ready("tf") and not gc.is_server_ready() and gc.is_server_live()


def test_the_main_serves_a_repository_and_refuses_a_missing_one(repo, tmp_path):
    missing = run_kserve_main("--model-repository", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and "--model-repository" in missing.stderr
        and "not a directory" in missing.stderr
    )
    with kserve_main("--model-repository", repo, "--log-level", "error") as (grpc_port, _):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert wait_for(
                lambda: client.is_model_ready("scorer", "1") and client.is_model_ready("scorer"), timeout=60
            )
            assert _infer(grpcclient, client, "scorer", "1").as_numpy("output__0").shape == (3, 3)
        finally:
            client.close()


def test_tritons_exit_on_error_and_strict_readiness_flags(repo):
    """--exit-on-error true: a repository model that fails to load ends the server at startup
    (status 1, each failure on stderr), as Triton's default; --strict-readiness false: the
    server reports ready while it serves, its refused models still not ready; a flag value
    that is not a boolean exits 2."""
    base = ["--model-repository", repo, "--grpc-port", "0", "--http-port", "0"]
    exited = run_kserve_main(*base, "--exit-on-error", "true", "--log-level", "error")
    assert exited.returncode == 1, exited.stderr
    assert "model 'tf' failed to load" in exited.stderr and "tensorflow_savedmodel" in exited.stderr
    assert "model 'cached'" in exited.stderr and "response_cache" in exited.stderr
    assert "--exit-on-error" in exited.stderr
    bad = run_kserve_main(*base, "--strict-readiness", "maybe")
    assert bad.returncode == 2 and "expected true or false" in bad.stderr
    lenient = ("--model-repository", repo, "--strict-readiness", "false", "--log-level", "error")
    with kserve_main(*lenient) as ports:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
        try:
            assert wait_for(lambda: client.is_model_ready("scorer", "1"), timeout=60)
            assert client.is_server_ready() and not client.is_model_ready("tf")
        finally:
            client.close()
