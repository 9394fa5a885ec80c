"""Dynamically batched repository models: one request's bad input fails that request alone,
never the others that share its batch.

The ONNX model is an Identity over a string tensor (onnxruntime's Python API takes string
tensors as str, so paved decodes BYTES as UTF-8 and refuses other bytes). Its config batches
two requests at most 60 s apart with preferred_batch_size 2, so two concurrent requests are
one batch (the test checks the batcher ran one batch of 2 rows). Before the fix, the decode
ran over the whole batch: the valid request failed with the other's INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from paved.kserve.errors import KServeError
from paved.kserve.repository import InferRequest, ModelRepository

CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 60000000 }
"""


@pytest.fixture
def repository_dir(tmp_path) -> str:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.STRING, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, ["batch", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(tmp_path / "strings" / "1")
    onnx.save(model, str(tmp_path / "strings" / "1" / "model.onnx"))
    (tmp_path / "strings" / "config.pbtxt").write_text(CONFIG)
    return str(tmp_path)


def test_a_request_with_bad_bytes_fails_alone_in_its_batch(repository_dir):
    async def run():
        repository = ModelRepository()
        repository.load_repository_dir(repository_dir)
        repository.start_loading()
        await repository.wait_loaded()
        model = repository.get_ready("strings")

        async def infer(value: bytes):
            request = InferRequest("strings", inputs={"x": np.array([[value]], dtype=object)})
            try:
                return [r.outputs["y"] async for r in await repository.infer(model, request)]
            except KServeError as e:
                return e

        try:
            return await asyncio.gather(infer("héllo".encode()), infer(b"\xff\xfe")), model
        finally:
            await repository.close()

    (good, bad), model = asyncio.run(run())
    assert dict(model.batcher.batches) == {2: 1}  # both requests were one execution
    assert isinstance(bad, KServeError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in bad.message
    assert not isinstance(good, KServeError), good
    (y,) = good
    assert y.shape == (1, 1) and y[0, 0] in ("héllo", "héllo".encode())
