"""The real tritonserver (triton_server.py) serves the conformance repository's python models, and
paved's client library (tritonclient 2.73, main venv) talks to it: gRPC and HTTP, sync and
asyncio, and a decoupled stream. This is the harness's own check: when it fails, the conformance
test's Triton side cannot be trusted either."""

from __future__ import annotations

import asyncio
import queue
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.triton_server import find_triton_home, triton_server

REPOSITORY = Path(__file__).resolve().parent / "testdata" / "conformance"
# The models Triton's wheel has a backend for (python, ensemble): not torch_linear/onnx_linear.
TRITON_MODELS = ("add_sub", "stream", "bls", "raises", "double", "pipeline")


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    with triton_server(REPOSITORY, tmp_path_factory.mktemp("triton"), models=TRITON_MODELS) as urls:
        yield urls


def _add_sub_inputs(module, a: np.ndarray, b: np.ndarray) -> list:
    inputs = [
        module.InferInput("INPUT0", list(a.shape), "FP32"),
        module.InferInput("INPUT1", list(b.shape), "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_find_triton_home_names_the_command_when_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PAVED_TRITON_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"tools/bazel builds it"):
        find_triton_home()


def test_serves_over_grpc_and_http(triton):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    with grpcclient.InferenceServerClient(triton.grpc) as gc:
        assert gc.is_server_ready()
        assert gc.get_server_metadata().version == "2.51.0"
        result = gc.infer("add_sub", _add_sub_inputs(grpcclient, a, b))
        assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
        assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
        index = {m.name: m.state for m in gc.get_model_repository_index().models}
    # Explicit model control: the models Triton has no backend for are listed, not loaded.
    assert index["add_sub"] == "READY" and index["torch_linear"] == ""
    with httpclient.InferenceServerClient(triton.http) as hc:
        result = hc.infer("add_sub", _add_sub_inputs(httpclient, a, b))
        assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
        bls_in = httpclient.InferInput("X", [4], "FP32")
        bls_in.set_data_from_numpy(a[0])
        assert np.array_equal(hc.infer("bls", [bls_in]).as_numpy("Y"), (a[0] + 1) * 2)
    with urllib.request.urlopen(triton.metrics, timeout=10) as response:
        assert b'nv_inference_request_success{model="add_sub",version="1"}' in response.read()


def test_asyncio_grpc_client(triton):
    async def run() -> list[np.ndarray]:
        client = grpcaio.InferenceServerClient(triton.grpc)
        try:
            rows = [np.full((1, 4), i, dtype=np.float32) for i in range(8)]
            results = await asyncio.gather(
                *(client.infer("add_sub", _add_sub_inputs(grpcaio, r, r)) for r in rows)
            )
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await client.close()

    outputs = asyncio.run(run())
    assert [float(o[0, 0]) for o in outputs] == [2.0 * i for i in range(8)]


def test_model_error_reaches_the_client(triton):
    x = grpcclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([-1], dtype=np.float32))
    with grpcclient.InferenceServerClient(triton.grpc) as gc, pytest.raises(InferenceServerException) as e:
        gc.infer("raises", [x])
    assert e.value.status() == "StatusCode.INTERNAL"
    assert "negative input refused by the model" in e.value.message()


def test_decoupled_stream(triton):
    results: queue.Queue = queue.Queue()
    count = grpcclient.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([3], dtype=np.int32))
    data = grpcclient.InferInput("DATA", [2], "FP32")
    data.set_data_from_numpy(np.array([1.5, -2.0], dtype=np.float32))
    with grpcclient.InferenceServerClient(triton.grpc) as gc:
        gc.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            gc.async_stream_infer("stream", [count, data], request_id="r1", enable_empty_final_response=True)
            got = []
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    got.append((int(result.as_numpy("INDEX")[0]), result.as_numpy("OUT").tolist()))
                if final:
                    break
        finally:
            gc.stop_stream()
    assert got == [(0, [1.5, -2.0]), (1, [3.0, -4.0]), (2, [4.5, -6.0])]
