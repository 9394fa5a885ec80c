"""The pytorch, onnxruntime and ensemble backends on paved's KServe server, through tritonclient
(gRPC and HTTP) on loopback.

The model repository is testdata/torch_onnx_ensemble (config.pbtxt files as Triton reads
them), copied to a temp dir with the weights the test makes: TorchScript modules
(torch.jit.script) and an ONNX export (torch.onnx.export) of small Linear layers. Every answer
is compared with the framework's own output for the same rows; an ensemble's with its steps
run by hand. The server also serves a scripted LLM (kserve_fakes.FakeEngine) for the ensemble
with an LLM step.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import (
    LLM,
    XGB,
    FakeEngine,
    kserve_main,
    llm_inputs,
    serving,
    stream,
    tensor,
    wait_for,
    xgb_model_dir,
)
from paved.kserve import ensemble, onnx_model, torch_model
from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.errors import KServeError
from paved.kserve.model import InferRequest
from paved.kserve.model_config import read_model_config
from paved.kserve.server import KServeServer

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "testdata", "torch_onnx_ensemble")


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + y, x * y


def _linear(n_in: int, n_out: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out).eval()


class LateRepository:
    """The RepositoryView an ensemble gets before the server that holds the repository exists."""

    target = None

    def get_ready(self, name, version=""):
        return self.target.get_ready(name, version)

    def get(self, name, version=""):
        return self.target.get(name, version)

    def infer(self, model, request):
        return self.target.infer(model, request)


def source(directory: str, repository=None) -> ModelSource:
    config = read_model_config(directory)
    return ModelSource(
        name=config.name,
        version="1",
        directory=directory,
        version_dir=os.path.join(directory, "1"),
        config=config,
        repository=repository or LateRepository(),
    )


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The test repository with its weights; returns (directory, reference modules)."""
    root = str(tmp_path_factory.mktemp("repo"))
    shutil.copytree(TESTDATA, root, dirs_exist_ok=True)
    # The XGBoost step of ens_xgb: the //models/xgb fixture as a repository model.
    os.makedirs(os.path.join(root, XGB, "1"))
    shutil.copy(os.path.join(xgb_model_dir(), "config.json"), os.path.join(root, XGB))
    shutil.copy(os.path.join(xgb_model_dir(), "model.ubj"), os.path.join(root, XGB, "1"))
    for name in os.listdir(root):
        os.makedirs(os.path.join(root, name, "1"), exist_ok=True)
    refs = {
        "torch_linear": _linear(4, 3, 1),
        "torch_head": _linear(3, 2, 2),
        "torch_pair": Pair(),
        "onnx_linear": _linear(4, 3, 3),
    }
    for name in ("torch_linear", "torch_head", "torch_pair"):
        torch.jit.script(refs[name]).save(os.path.join(root, name, "1", "model.pt"))
    torch.onnx.export(
        refs["onnx_linear"],
        (torch.zeros(2, 4),),
        os.path.join(root, "onnx_linear", "1", "model.onnx"),
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        dynamo=False,
    )
    return root, refs


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(loop, repo, engine):
    """The test repository served as Triton serves one (`model_repository`: every model built
    by its backend through paved.kserve.backends), beside a scripted LLM."""
    root, _ = repo
    kserve = KServeServer([engine], host="127.0.0.1", grpc_port=0, http_port=0, model_repository=root)
    with serving(loop, kserve) as started:
        yield started


@pytest.fixture(scope="module")
def session(repo):
    root, _ = repo
    return ort.InferenceSession(
        os.path.join(root, "onnx_linear", "1", "model.onnx"), providers=["CPUExecutionProvider"]
    )


def rows(n: int, width: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def torch_ref(module: torch.nn.Module, *args: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return module(*(torch.from_numpy(a) for a in args)).numpy()


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# ---- metadata --------------------------------------------------------------------------------
def test_models_ready_with_their_platforms_and_configs(gc, hc):
    for name, platform in (
        ("torch_linear", "pytorch_libtorch"),
        ("torch_head", "pytorch_libtorch"),
        ("onnx_linear", "onnxruntime_onnx"),
        ("ens_scores", "ensemble"),
        ("ens_llm", "ensemble"),
    ):
        assert gc.is_model_ready(name) and hc.is_model_ready(name), name
        assert hc.get_model_metadata(name)["platform"] == platform, name
    meta = gc.get_model_metadata("onnx_linear", as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "4"]}]
    config = gc.get_model_config("onnx_linear").config
    assert config.instance_group[0].count == 2 and list(config.dynamic_batching.preferred_batch_size) == [
        16,
        32,
    ]
    config = hc.get_model_config("ens_scores")
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "torch_head",
        "onnx_linear",
        "torch_linear",
    ]


# ---- pytorch -----------------------------------------------------------------------------------
def test_torch_grpc_and_http_equal_torch(gc, hc, repo):
    _, refs = repo
    x = rows(5)
    expected = torch_ref(refs["torch_linear"], x)
    got = gc.infer("torch_linear", [tensor(grpcclient, "INPUT__0", x, "FP32")]).as_numpy("OUTPUT__0")
    assert got.dtype == np.float32 and np.array_equal(got, expected)
    for binary in (False, True):
        result = hc.infer(
            "torch_linear",
            [tensor(httpclient, "INPUT__0", x, "FP32", binary_data=binary)],
            outputs=[httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary)],
        )
        assert np.array_equal(result.as_numpy("OUTPUT__0"), expected), binary


def test_torch_inputs_by_forward_argument_name_and_outputs_by_index(gc, hc):
    x = rows(2, 5, seed=1)
    y = rows(2, 5, seed=2)
    inputs = [tensor(grpcclient, "x", x, "FP32"), tensor(grpcclient, "y", y, "FP32")]
    result = gc.infer("torch_pair", inputs)
    assert np.array_equal(result.as_numpy("SUM__0"), x + y)
    assert np.array_equal(result.as_numpy("PRODUCT__1"), x * y)
    result = hc.infer(
        "torch_pair",
        [tensor(httpclient, "y", y, "FP32"), tensor(httpclient, "x", x, "FP32")],
        outputs=[httpclient.InferRequestedOutput("PRODUCT__1", binary_data=False)],
    )
    assert np.array_equal(result.as_numpy("PRODUCT__1"), x * y) and result.as_numpy("SUM__0") is None


def test_torch_execution_error_is_internal_with_torch_message(gc, hc):
    # dims [-1] on both inputs: the config admits lengths the module cannot add.
    inputs = [tensor(grpcclient, "x", rows(1, 3), "FP32"), tensor(grpcclient, "y", rows(1, 5), "FP32")]
    error = error_of(lambda: gc.infer("torch_pair", inputs))
    assert error.status() == "StatusCode.INTERNAL"
    assert (
        "model 'torch_pair': pytorch execution failed" in error.message()
        and "size of tensor" in error.message()
    )
    error = error_of(
        lambda: hc.infer(
            "torch_pair",
            [tensor(httpclient, "x", rows(1, 3), "FP32"), tensor(httpclient, "y", rows(1, 5), "FP32")],
        )
    )
    assert error.status() == "500" and "pytorch execution failed" in error.message()
    # The model keeps serving.
    good = [tensor(grpcclient, "x", rows(1, 3), "FP32"), tensor(grpcclient, "y", rows(1, 3), "FP32")]
    assert gc.infer("torch_pair", good).as_numpy("SUM__0").shape == (1, 3)


@pytest.mark.parametrize("model,name", [("torch_linear", "INPUT__0"), ("onnx_linear", "input")])
def test_shape_datatype_and_batch_errors(gc, hc, model, name):
    cases = [
        (rows(2, 5), "FP32", "unexpected shape for input"),
        (rows(2).astype(np.float64), "FP64", "data-type is 'FP64'"),
        (rows(65), "FP32", "batch-size must be between 1 and 64"),
    ]
    for value, datatype, message in cases:
        grpc_input = [tensor(grpcclient, name, value, datatype)]
        error = error_of(lambda: gc.infer(model, grpc_input))  # noqa: B023 - called at once
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and message in error.message(), error
        http_input = [tensor(httpclient, name, value, datatype)]
        error = error_of(lambda: hc.infer(model, http_input))  # noqa: B023 - called at once
        assert error.status() == "400" and message in error.message(), error
    error = error_of(lambda: gc.infer(model, [tensor(grpcclient, "nope", rows(1), "FP32")]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"


# ---- onnxruntime -------------------------------------------------------------------------------
def test_onnx_grpc_and_http_equal_onnxruntime(gc, hc, session, repo):
    _, refs = repo
    x = rows(6, seed=4)
    (expected,) = session.run(["output"], {"input": x})
    got = gc.infer("onnx_linear", [tensor(grpcclient, "input", x, "FP32")]).as_numpy("output")
    assert np.array_equal(got, expected)
    got = hc.infer("onnx_linear", [tensor(httpclient, "input", x, "FP32", binary_data=False)]).as_numpy(
        "output"
    )
    assert np.array_equal(got, expected)
    # The export is the module it came from.
    np.testing.assert_allclose(got, torch_ref(refs["onnx_linear"], x), rtol=1e-5, atol=1e-6)


# ---- dynamic batching ------------------------------------------------------------------------
class Gate:
    """Holds every execution of `model` until released, counting the rows held."""

    def __init__(self, model):
        self.model = model
        self.original = model._execute
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.held_rows = 0
        self.held_calls = 0
        model._execute = self

    def __call__(self, inputs):
        with self.lock:
            self.held_rows += len(next(iter(inputs.values())))
            self.held_calls += 1
        self.open.wait(30)
        return self.original(inputs)

    def restore(self):
        self.open.set()
        self.model._execute = self.original


@pytest.mark.parametrize(
    "model,name,transport", [("torch_linear", "INPUT__0", "grpc"), ("onnx_linear", "input", "http")]
)
def test_concurrent_requests_are_batched_and_exact(server, repo, session, model, name, transport):
    _, refs = repo
    n = 24
    x = rows(n, seed=5)
    served = server.repository.get(model)
    instances = served.instances
    before = dict(served.batcher.batches)
    gate = Gate(served)
    url = f"127.0.0.1:{server.grpc_port if transport == 'grpc' else server.http_port}"
    module = grpcclient if transport == "grpc" else httpclient
    client = module.InferenceServerClient(url, **({"concurrency": n} if transport == "http" else {}))

    def one(i):
        return client.infer(model, [tensor(module, name, x[i : i + 1], "FP32")]).as_numpy(
            served.outputs[0].name
        )

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            # Every instance busy, every other request waiting for one: then let them run.
            assert wait_for(
                lambda: gate.held_calls == instances and gate.held_rows + served.batcher._pending_rows == n
            )
            gate.open.set()
            results = [f.result(30) for f in futures]
    finally:
        gate.restore()
        client.close()
    batches = {k: v - before.get(k, 0) for k, v in served.batcher.batches.items() if v - before.get(k, 0)}
    assert sum(size * count for size, count in batches.items()) == n, batches
    # What waited for a free instance went as one execution: at most one per instance came before it.
    assert sum(batches.values()) <= instances + 1, batches
    if model == "onnx_linear":
        (expected,) = session.run(["output"], {"input": x})
    else:
        expected = torch_ref(refs[model], x)
    for i, got in enumerate(results):
        # A row's result may differ in the last bits with the batch it was computed in.
        np.testing.assert_allclose(got[0], expected[i], rtol=1e-5, atol=1e-6)


# ---- ensembles ---------------------------------------------------------------------------------
def test_ensemble_equals_its_steps_by_hand(gc, hc, session, repo):
    _, refs = repo
    x = rows(3, seed=6)
    (hidden,) = session.run(["output"], {"input": x})
    scores = torch_ref(refs["torch_head"], hidden)
    side = torch_ref(refs["torch_linear"], x)
    result = gc.infer("ens_scores", [tensor(grpcclient, "features", x, "FP32")])
    assert np.array_equal(result.as_numpy("hidden"), hidden)
    assert np.array_equal(result.as_numpy("scores"), scores)
    assert np.array_equal(result.as_numpy("side"), side)
    result = hc.infer(
        "ens_scores",
        [tensor(httpclient, "features", x, "FP32")],
        outputs=[httpclient.InferRequestedOutput("scores", binary_data=False)],
    )
    assert np.array_equal(result.as_numpy("scores"), scores) and result.as_numpy("side") is None


def test_ensemble_of_xgboost_then_torch_equals_its_steps_by_hand(gc, hc, repo):
    _, refs = repo
    x = rows(5, 32, seed=10)
    probs = xgboost.Booster(model_file=os.path.join(xgb_model_dir(), "model.ubj")).inplace_predict(x)
    scores = torch_ref(refs["torch_head"], probs.astype(np.float32))
    for module, client in ((grpcclient, gc), (httpclient, hc)):
        result = client.infer("ens_xgb", [tensor(module, "features", x, "FP32")])
        assert np.array_equal(result.as_numpy("probs"), probs), module
        assert np.array_equal(result.as_numpy("scores"), scores), module


def test_ensemble_step_error_names_the_step(gc, hc):
    x = rows(2).astype(np.float64)
    error = error_of(lambda: gc.infer("ens_mismatch", [tensor(grpcclient, "features", x, "FP64")]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ensemble 'ens_mismatch' step 0 (model 'onnx_linear')" in error.message()
    assert "data-type is 'FP64'" in error.message()
    error = error_of(lambda: hc.infer("ens_mismatch", [tensor(httpclient, "features", x, "FP64")]))
    assert error.status() == "400" and "step 0 (model 'onnx_linear')" in error.message()


def _prompt(module, text, **extra):
    inputs = [tensor(module, "prompt", np.array([text.encode()], dtype=object), "BYTES")]
    for key, value in extra.items():
        datatype = "BOOL" if isinstance(value, bool) else "BYTES"
        array = np.array([value]) if isinstance(value, bool) else np.array([value.encode()], dtype=object)
        inputs.append(tensor(module, key, array, datatype))
    return inputs


def test_ensemble_with_llm_step_unary_equals_the_llm(gc, hc):
    params = '{"max_tokens": 3}'
    direct = gc.infer(LLM, llm_inputs(grpcclient, "hello there", params=params)).as_numpy("text_output")
    got = gc.infer("ens_llm", _prompt(grpcclient, "hello there", params=params)).as_numpy("text")
    assert list(got) == list(direct) and got[0].startswith(b"hello there")
    got = hc.infer("ens_llm", _prompt(httpclient, "hello there", params=params)).as_numpy("text")
    assert list(got) == list(direct)


def test_ensemble_with_llm_step_streams_each_response(gc):
    params = '{"max_tokens": 4}'
    direct = stream(gc, [(llm_inputs(grpcclient, "hi", stream=True, params=params), {})])
    through = stream(gc, [(_prompt(grpcclient, "hi", stream=True, params=params), {})], model="ens_llm")
    assert all(error is None for _, error in direct + through), through
    want = [r.as_numpy("text_output").tolist() for r, _ in direct if r.as_numpy("text_output") is not None]
    got = [r.as_numpy("text").tolist() for r, _ in through if r.as_numpy("text") is not None]
    assert len(got) == 4 and got == want
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in through]
    assert finals == [False, False, False, True]


def test_cancelling_an_ensemble_stream_aborts_its_llm_step(gc, engine):
    aborted = len(engine.aborted)
    # The scripted engine streams "hang" until its request is aborted.
    out = stream(gc, [(_prompt(grpcclient, "hang", stream=True), {})], model="ens_llm", cancel_after=2)
    assert len(out) == 2 and all(error is None for _, error in out)
    assert wait_for(lambda: len(engine.aborted) > aborted)


def test_ensemble_with_streaming_step_on_unary_infer_is_refused(gc):
    error = error_of(lambda: gc.infer("ens_llm", _prompt(grpcclient, "hi", stream=True)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "step 0 (model 'fake-llm')" in error.message() and "decoupled transport" in error.message()


# ---- configs refused at create / load ------------------------------------------------------------
def _ensemble_config(
    steps: list[tuple[str, dict, dict]], inputs=("a",), outputs=("z",)
) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name="ens", platform="ensemble", max_batch_size=8)
    for name in inputs:
        config.input.add(name=name, data_type=model_config_pb2.TYPE_FP32, dims=[4])
    for name in outputs:
        config.output.add(name=name, data_type=model_config_pb2.TYPE_FP32, dims=[4])
    for model, input_map, output_map in steps:
        step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        step.input_map.update(input_map)
        step.output_map.update(output_map)
    return config


def _create_ensemble(config):
    return ensemble.create(ModelSource(config.name, "1", "/nowhere", "/nowhere/1", config, LateRepository()))


@pytest.mark.parametrize(
    "steps,kwargs,reason",
    [
        (
            [("m", {"IN": "b"}, {"OUT": "z"})],
            {},
            "input 'IN' reads tensor 'b', which is neither an ensemble input",
        ),
        (
            [("m", {"IN": "a"}, {"OUT": "b"}), ("n", {"IN": "b"}, {"OUT": "c"})],
            {},
            "ensemble output 'z' is not written by any step",
        ),
        (
            [("m", {"IN": "a", "IN2": "c"}, {"OUT": "b"}), ("n", {"IN": "b"}, {"OUT": "c", "OUT2": "z"})],
            {},
            "the steps form a cycle",
        ),
        (
            [("m", {"IN": "a"}, {"OUT": "z"}), ("n", {"IN": "a"}, {"OUT": "z"})],
            {},
            "tensor 'z' is written by both step 0 (model 'm') and step 1 (model 'n')",
        ),
        ([("m", {"IN": "a"}, {"OUT": "a"})], {}, "writes 'a', which is an ensemble input"),
        (
            [("m", {"IN": "a"}, {"OUT": "z"})],
            {"inputs": ("a", "unused")},
            "input(s) ['unused'] are not read by any step",
        ),
        ([("ens", {"IN": "a"}, {"OUT": "z"})], {}, "step 0 calls the ensemble itself"),
        ([], {}, "needs at least one step"),
    ],
)
def test_ensemble_graph_errors_refused_at_create(steps, kwargs, reason):
    with pytest.raises(ModelConfigError) as info:
        _create_ensemble(_ensemble_config(steps, **kwargs))
    assert reason in str(info.value)


def test_ensemble_graph_in_any_step_order_is_accepted():
    config = _ensemble_config([("n", {"IN": "b"}, {"OUT": "z"}), ("m", {"IN": "a"}, {"OUT": "b"})])
    model = _create_ensemble(config)
    assert [s.model_name for s in model.steps] == ["n", "m"]


def _torch_config(**fields) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name="t", platform="pytorch_libtorch", max_batch_size=4)
    config.input.add(name="INPUT__0", data_type=model_config_pb2.TYPE_FP32, dims=[4])
    config.output.add(name="OUTPUT__0", data_type=model_config_pb2.TYPE_FP32, dims=[3])
    for key, value in fields.items():
        if key == "parameters":
            for k, v in value.items():
                config.parameters[k].string_value = v
        elif key == "output_name":
            config.output[0].name = value
        elif key == "input_name":
            config.input[0].name = value
        elif key == "input_type":
            config.input[0].data_type = value
        else:
            setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"output_name": "scores"}, "output 'scores' must be named <name>__<index>"),
        ({"input_type": model_config_pb2.TYPE_STRING}, "BYTES is not supported by the pytorch backend"),
        ({"parameters": {"ENABLE_JIT_PROFILING": "true"}}, "unknown parameter(s) ['ENABLE_JIT_PROFILING']"),
        ({"parameters": {"INFERENCE_MODE": "yes"}}, "INFERENCE_MODE must be 'true' or 'false'"),
        ({"parameters": {"INTRA_OP_THREAD_COUNT": "0"}}, "INTRA_OP_THREAD_COUNT must be an integer >= 1"),
    ],
)
def test_torch_config_errors_refused_at_create(tmp_path, fields, reason):
    config = _torch_config(**fields)
    with pytest.raises(ModelConfigError) as info:
        torch_model.create(
            ModelSource("t", "1", str(tmp_path), str(tmp_path / "1"), config, LateRepository())
        )
    assert reason in str(info.value)


def _load(create, config, directory) -> str:
    model = create(
        ModelSource(config.name, "1", str(directory), str(directory / "1"), config, LateRepository())
    )
    with pytest.raises(ModelConfigError):
        asyncio.run(model.load())
    state, reason = model.state()
    assert state == "UNAVAILABLE"
    return reason


def test_torch_input_names_must_match_forward_or_the_index_convention(tmp_path, repo):
    root, _ = repo
    (tmp_path / "1").mkdir()
    shutil.copy(os.path.join(root, "torch_linear", "1", "model.pt"), tmp_path / "1" / "model.pt")
    reason = _load(torch_model.create, _torch_config(input_name="features"), tmp_path)
    assert "input names ['features'] neither match forward's arguments ['input']" in reason
    assert "does not exist" in _load(
        torch_model.create, _torch_config(default_model_filename="other.pt"), tmp_path
    )


def test_onnx_config_checked_against_the_model_at_load(tmp_path, repo):
    root, _ = repo
    (tmp_path / "1").mkdir()
    shutil.copy(os.path.join(root, "onnx_linear", "1", "model.onnx"), tmp_path / "1" / "model.onnx")

    def config(input_name="input", dims=(4,), data_type=model_config_pb2.TYPE_FP32):
        c = model_config_pb2.ModelConfig(name="o", backend="onnxruntime", max_batch_size=4)
        c.input.add(name=input_name, data_type=data_type, dims=list(dims))
        c.output.add(name="output", data_type=model_config_pb2.TYPE_FP32, dims=[3])
        return c

    assert "config input(s) ['x'] are not inputs of the model" in _load(
        onnx_model.create, config("x"), tmp_path
    )
    assert "does not fit the config's [5]" in _load(onnx_model.create, config(dims=(5,)), tmp_path)
    reason = _load(onnx_model.create, config(data_type=model_config_pb2.TYPE_FP64), tmp_path)
    assert "input 'input' is tensor(float) in the model but FP64 in the config" in reason
    # The right config loads and answers like onnxruntime.
    model = onnx_model.create(
        ModelSource("o", "1", str(tmp_path), str(tmp_path / "1"), config(), LateRepository())
    )

    async def run():
        await model.load()
        try:
            x = rows(2)
            responses = await model.infer(InferRequest("o", inputs={"input": x}))
            return x, [r async for r in responses]
        finally:
            await model.close()

    x, (response,) = asyncio.run(run())
    (expected,) = ort.InferenceSession(str(tmp_path / "1" / "model.onnx")).run(["output"], {"input": x})
    assert np.array_equal(response.outputs["output"], expected)


def test_request_parameters_are_refused(loop, server):
    async def run():
        model = server.repository.get("torch_linear")
        with pytest.raises(KServeError) as info:
            await model.infer(InferRequest("torch_linear", inputs={"INPUT__0": rows(1)}, parameters={"k": 1}))
        return info.value

    error = loop.run(run())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "takes no request parameters" in error.message


# ---- other ways in -----------------------------------------------------------------------------
def test_models_created_directly_in_an_in_process_repository(loop, repo, session):
    """The backends' create() without the repository loader: ModelSources built by hand, the
    ensemble's RepositoryView bound once the server's repository exists."""
    root, refs = repo
    late = LateRepository()
    names = ("onnx_linear", "torch_head", "torch_linear")
    models = [
        create(source(os.path.join(root, name), late))
        for name, create in zip(
            names, (onnx_model.create, torch_model.create, torch_model.create), strict=True
        )
    ]
    models.append(ensemble.create(source(os.path.join(root, "ens_scores"), late)))
    kserve = KServeServer(classic_models=models, host="127.0.0.1", grpc_port=0, http_port=0)
    late.target = kserve.repository
    x = rows(2, seed=7)
    with serving(loop, kserve) as started:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{started.grpc_port}")
        try:
            result = client.infer("ens_scores", [tensor(grpcclient, "features", x, "FP32")])
        finally:
            client.close()
    (hidden,) = session.run(["output"], {"input": x})
    assert np.array_equal(result.as_numpy("scores"), torch_ref(refs["torch_head"], hidden))


def test_refused_models_are_listed_with_the_reason_while_the_rest_serve(loop, repo, tmp_path):
    root, refs = repo
    for name in ("torch_linear", "ens_scores", "onnx_linear", "torch_head"):
        shutil.copytree(os.path.join(root, name), tmp_path / name)
    # A graph error: the ensemble reads a tensor nothing writes.
    broken = (
        (tmp_path / "ens_scores" / "config.pbtxt")
        .read_text()
        .replace('key: "INPUT__0" value: "hidden"', 'key: "INPUT__0" value: "hiden"')
    )
    (tmp_path / "ens_broken").mkdir()
    (tmp_path / "ens_broken" / "1").mkdir()
    (tmp_path / "ens_broken" / "config.pbtxt").write_text(broken)
    # Input names that are neither forward's arguments nor <name>__<index>: refused at load.
    shutil.copytree(os.path.join(root, "torch_linear"), tmp_path / "torch_misnamed")
    config = (tmp_path / "torch_misnamed" / "config.pbtxt").read_text().replace('"INPUT__0"', '"features"')
    (tmp_path / "torch_misnamed" / "config.pbtxt").write_text(config)
    kserve = KServeServer(host="127.0.0.1", grpc_port=0, http_port=0, model_repository=str(tmp_path))
    with serving(loop, kserve, ready=False) as started:
        loop.run(started.repository.wait_loaded())
        client = httpclient.InferenceServerClient(f"127.0.0.1:{started.http_port}")
        try:
            index = {
                m["name"]: (m["state"], m.get("reason", "")) for m in client.get_model_repository_index()
            }
            x = rows(1, seed=8)
            side = client.infer("ens_scores", [tensor(httpclient, "features", x, "FP32")]).as_numpy("side")
        finally:
            client.close()
    state, reason = index["ens_broken"]
    assert state == "UNAVAILABLE"
    assert (
        "input 'INPUT__0' reads tensor 'hiden', which is neither an ensemble input nor any step's output"
        in reason
    )
    state, reason = index["torch_misnamed"]
    assert state == "UNAVAILABLE" and "input names ['features'] neither match forward's arguments" in reason
    assert index["ens_scores"] == ("READY", "") and index["torch_linear"] == ("READY", "")
    assert np.array_equal(side, torch_ref(refs["torch_linear"], x))


def test_the_main_serves_the_repository(repo, session, tmp_path):
    """`python -m paved.kserve.main --model-repository DIR`, Triton's flag, as a process."""
    root, refs = repo
    for name in ("torch_linear", "ens_scores", "onnx_linear", "torch_head"):
        shutil.copytree(os.path.join(root, name), tmp_path / name)
    with kserve_main("--model-repository", str(tmp_path), "--log-level", "error") as (grpc_port, _):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert wait_for(client.is_server_ready, timeout=60)
            x = rows(4, seed=9)
            result = client.infer("ens_scores", [tensor(grpcclient, "features", x, "FP32")])
        finally:
            client.close()
    (hidden,) = session.run(["output"], {"input": x})
    assert np.array_equal(result.as_numpy("hidden"), hidden)
    assert np.array_equal(result.as_numpy("scores"), torch_ref(refs["torch_head"], hidden))
    assert np.array_equal(result.as_numpy("side"), torch_ref(refs["torch_linear"], x))


def test_onnx_config_without_tensors_is_completed_from_the_model(tmp_path, repo, session):
    root, _ = repo
    (tmp_path / "1").mkdir()
    shutil.copy(os.path.join(root, "onnx_linear", "1", "model.onnx"), tmp_path / "1" / "model.onnx")
    config = model_config_pb2.ModelConfig(name="auto", platform="onnxruntime_onnx", max_batch_size=8)
    model = onnx_model.create(
        ModelSource("auto", "1", str(tmp_path), str(tmp_path / "1"), config, LateRepository())
    )
    x = rows(3, seed=11)

    async def run():
        await model.load()
        try:
            responses = await model.infer(InferRequest("auto", inputs={"input": x}))
            return [r async for r in responses]
        finally:
            await model.close()

    (response,) = asyncio.run(run())
    assert [(s.name, s.datatype, s.dims) for s in model.inputs] == [("input", "FP32", (4,))]
    assert [(s.name, s.datatype, s.dims) for s in model.outputs] == [("output", "FP32", (3,))]
    assert [t.name for t in model.config().input] == ["input"]
    (expected,) = session.run(["output"], {"input": x})
    assert np.array_equal(response.outputs["output"], expected)


def test_a_model_folder_without_a_config_is_completed_from_its_model_file(loop, repo, session, tmp_path):
    """Triton's auto-complete for a configless folder: model.onnx names the onnxruntime backend
    and the model its tensors (no batching: max_batch_size 0), model.py the python backend and
    its auto_complete_config the rest; a folder whose model file tells nothing (model.pt) or
    names two backends is refused with the reason, the rest serve."""
    root, _ = repo
    (tmp_path / "bare_onnx" / "1").mkdir(parents=True)
    shutil.copy(os.path.join(root, "onnx_linear", "1", "model.onnx"), tmp_path / "bare_onnx" / "1")
    shutil.copytree(os.path.join(root, "torch_linear"), tmp_path / "bare_torch")
    (tmp_path / "bare_torch" / "config.pbtxt").unlink()
    (tmp_path / "two_files" / "1").mkdir(parents=True)
    shutil.copy(os.path.join(root, "onnx_linear", "1", "model.onnx"), tmp_path / "two_files" / "1")
    (tmp_path / "two_files" / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    # A Python model declaring itself in auto_complete_config (the backend from model.py).
    shutil.copytree(os.path.join(HERE, "testdata", "python_backend", "auto"), tmp_path / "bare_python")
    (tmp_path / "bare_python" / "config.pbtxt").unlink()
    kserve = KServeServer(host="127.0.0.1", grpc_port=0, http_port=0, model_repository=str(tmp_path))
    x = rows(1, seed=5)[0]  # max_batch_size 0: the model's own shape, batch included
    with serving(loop, kserve, ready=False) as started:
        loop.run(started.repository.wait_loaded())
        client = httpclient.InferenceServerClient(f"127.0.0.1:{started.http_port}")
        try:
            listed = client.get_model_repository_index()
            index = {m["name"]: (m["state"], m.get("reason", "")) for m in listed}
            config = client.get_model_config("bare_onnx")
            result = client.infer("bare_onnx", [tensor(httpclient, "input", x[None, :], "FP32")])
            doubled = client.infer("bare_python", [tensor(httpclient, "X", np.ones((1, 2)), "FP64")])
        finally:
            client.close()
    assert index["bare_onnx"] == ("READY", "")
    assert config["backend"] == "onnxruntime" and config.get("max_batch_size", 0) == 0
    assert [t["name"] for t in config["input"]] == ["input"]
    (expected,) = session.run(["output"], {"input": x[None, :]})
    assert np.array_equal(result.as_numpy("output"), expected)
    assert index["bare_python"] == ("READY", "")
    assert np.array_equal(doubled.as_numpy("Y"), np.full((1, 2), 2.0))
    state, reason = index["bare_torch"]
    assert state == "UNAVAILABLE" and "no config.pbtxt" in reason and "model.onnx" in reason
    state, reason = index["two_files"]
    assert state == "UNAVAILABLE" and "several backends (onnxruntime, python)" in reason
