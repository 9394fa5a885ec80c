"""The Python backend's worker processes under stress, in-process (PythonModel, no transport):
a worker whose forked helper outlives it, batches whose frames hold more arrays than one
sendmsg takes, BYTES outputs holding what is not bytes, failed requests leaving state behind in
the worker. Each model is written to a temporary folder as a Triton model directory."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from paved.kserve.backends import ModelSource
from paved.kserve.errors import KServeError
from paved.kserve.model import InferRequest
from paved.kserve.python_backend import create

# Generous bounds: reached only when the behaviour under test is broken (a hang).
STUCK_S = 60


def write_model(root, name: str, config: str, model: str) -> ModelSource:
    directory = root / name
    (directory / "1").mkdir(parents=True)
    (directory / "config.pbtxt").write_text(textwrap.dedent(config))
    (directory / "1" / "model.py").write_text(textwrap.dedent(model))
    parsed = model_config_pb2.ModelConfig()
    text_format.Parse((directory / "config.pbtxt").read_text(), parsed)
    return ModelSource(
        name=name,
        version="1",
        directory=str(directory),
        version_dir=str(directory / "1"),
        config=parsed,
        repository=None,
    )


async def infer_one(model, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    responses = await model.infer(InferRequest(model_name=model.name, inputs=inputs))
    [response] = [r async for r in responses]
    return response.outputs


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def ended(pid: int) -> bool:
    """Whether process `pid` ends (a SIGKILL sent is not yet a process gone)."""
    for _ in range(STUCK_S * 10):
        if not running(pid):
            return True
        await asyncio.sleep(0.1)
    return False


FORKING_CONFIG = """
    name: "forking"
    backend: "python"
    max_batch_size: 0
    input [ { name: "OP", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "PIDS", data_type: TYPE_INT64, dims: [ 2 ] } ]
    parameters { key: "paved_execute_timeout_s" value { string_value: "600" } }
"""
# A helper process forked by initialize() (multiprocessing's default start on Linux): it
# inherits the worker's end of the socket and its stdout and stderr. OP 1 exits the worker.
FORKING_MODEL = """
    import multiprocessing
    import os
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    def helper():
        time.sleep(3600)


    class TritonPythonModel:
        def initialize(self, args):
            self.helper = multiprocessing.get_context("fork").Process(target=helper, daemon=True)
            self.helper.start()

        def execute(self, requests):
            if int(requests[0].inputs()[0].as_numpy()[0]) == 1:
                os._exit(3)
            pids = np.array([os.getpid(), self.helper.pid], dtype=np.int64)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("PIDS", pids)])]
"""


def test_a_worker_whose_forked_helper_holds_its_socket_is_seen_dead_and_restarted(tmp_path):
    # The helper keeps the channel open after the worker died: the death is seen from the
    # process's exit, not the channel's end, and the helper does not outlive its worker.
    async def run():
        model = create(write_model(tmp_path, "forking", FORKING_CONFIG, FORKING_MODEL))
        await asyncio.wait_for(model.load(), STUCK_S)
        try:
            op = {"OP": np.array([0], dtype=np.int32)}
            worker, helper = (int(p) for p in (await infer_one(model, op))["PIDS"])
            with pytest.raises(KServeError) as e:
                await asyncio.wait_for(infer_one(model, {"OP": np.array([1], dtype=np.int32)}), STUCK_S)
            assert e.value.message.startswith("Stub process 'forking_0' is not healthy: ")
            assert "exited with code 3" in e.value.message
            new_worker, new_helper = (
                int(p) for p in (await asyncio.wait_for(infer_one(model, op), STUCK_S))["PIDS"]
            )
            assert new_worker != worker
            assert await ended(helper)
        finally:
            await asyncio.wait_for(model.close(), STUCK_S)
        assert await ended(new_worker) and await ended(new_helper)

    asyncio.run(run())


GARBLING_CONFIG = """
    name: "garbling"
    backend: "python"
    max_batch_size: 0
    input [ { name: "OP", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
"""
# OP 1: a thread of the model writes bytes that are no frame to the worker's channel a moment
# after the answer, while the worker is idle. Each initialize() appends a line to INITS.
GARBLING_MODEL = """
    import os
    import sys
    import threading
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    def garble():
        time.sleep(0.3)
        os.write(int(sys.argv[1]), b"\\xff" * 64)


    class TritonPythonModel:
        def initialize(self, args):
            with open(os.environ["INITS"], "a") as f:
                f.write(f"{os.getpid()}\\n")

        def execute(self, requests):
            if int(requests[0].inputs()[0].as_numpy()[0]) == 1:
                threading.Thread(target=garble, daemon=True).start()
            pid = np.array([os.getpid()], dtype=np.int64)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)])]
"""


def test_a_bad_frame_restarts_the_worker_once_and_never_touches_its_replacement(tmp_path, monkeypatch):
    """The death of a worker that sent a bad frame is handled once: a request arriving while it
    is handled waits for it (it started a second restart, and the first handling then closed
    the new worker's channel), the worker is killed at once (its requests waited 5 s for an
    exit that would not come), and the replacement keeps serving."""
    inits = tmp_path / "inits"
    monkeypatch.setenv("INITS", str(inits))

    async def run():
        model = create(write_model(tmp_path, "garbling", GARBLING_CONFIG, GARBLING_MODEL))
        await asyncio.wait_for(model.load(), STUCK_S)
        try:
            op = {"OP": np.array([0], dtype=np.int32)}
            first = int((await infer_one(model, {"OP": np.array([1], dtype=np.int32)}))["PID"][0])
            await asyncio.sleep(0.5)  # the bad frame is read now, its death being handled
            replacement = None
            for _ in range(20):
                try:
                    replacement = int((await asyncio.wait_for(infer_one(model, op), STUCK_S))["PID"][0])
                    break
                except KServeError as e:
                    assert "restarting" in e.message or "not healthy" in e.message, e.message
                    await asyncio.sleep(0.2)
            assert replacement is not None and replacement != first
            assert await ended(first)
            await asyncio.sleep(6)  # past the old handling's exit grace: nothing kills it late
            again = int((await asyncio.wait_for(infer_one(model, op), STUCK_S))["PID"][0])
            assert again == replacement
            assert inits.read_text().split() == [str(first), str(replacement)]
        finally:
            await asyncio.wait_for(model.close(), STUCK_S)

    asyncio.run(run())


WIDE_CONFIG = """
    name: "wide"
    backend: "python"
    max_batch_size: 1100
    input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
    dynamic_batching { max_queue_delay_microseconds: 600000000 }
"""
WIDE_MODEL = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            n = np.array([[len(requests)]], dtype=np.int32)
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("Y", r.inputs()[0].as_numpy() * 2), pb_utils.Tensor("N", n)]
                )
                for r in requests
            ]
"""


def test_a_batch_whose_responses_hold_more_arrays_than_one_sendmsg_takes(tmp_path):
    # 1100 one-row requests meet in one execute() (the batch is full at max_batch_size); its
    # 2200 output arrays travel in one frame, more parts than the kernel's IOV_MAX (1024).
    async def run():
        model = create(write_model(tmp_path, "wide", WIDE_CONFIG, WIDE_MODEL))
        await asyncio.wait_for(model.load(), STUCK_S)
        try:
            calls = [infer_one(model, {"X": np.array([[i]], dtype=np.float32)}) for i in range(1100)]
            results = await asyncio.wait_for(asyncio.gather(*calls), STUCK_S)
        finally:
            await asyncio.wait_for(model.close(), STUCK_S)
        assert [float(r["Y"][0, 0]) for r in results] == [2.0 * i for i in range(1100)]
        assert {int(r["N"][0, 0]) for r in results} == {1100}

    asyncio.run(run())


OBJECTS_CONFIG = """
    name: "objects"
    backend: "python"
    max_batch_size: 0
    input [ { name: "OP", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 2, 2 ] } ]
    output [ { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
"""
# A BYTES output holding what is not bytes: a str, an int, an object of the model's own class.
OBJECTS_MODEL = """
    import os

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class Label:
        def __str__(self):
            return "label"


    class TritonPythonModel:
        def execute(self, requests):
            out = np.array([[b"raw", "h\\u00e9"], [7, Label()]], dtype=np.object_)
            pid = np.array([os.getpid()], dtype=np.int64)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out), pb_utils.Tensor("PID", pid)])]
"""


def test_bytes_outputs_holding_other_objects_are_sent_as_their_text_as_triton_does(tmp_path):
    # Triton's python backend sends a BYTES element that is not bytes as str(element) in UTF-8;
    # here the model's own class could not even be unpickled by the server, which took the
    # frame for a broken worker and restarted it.
    async def run():
        model = create(write_model(tmp_path, "objects", OBJECTS_CONFIG, OBJECTS_MODEL))
        await asyncio.wait_for(model.load(), STUCK_S)
        try:
            op = {"OP": np.array([0], dtype=np.int32)}
            first = await asyncio.wait_for(infer_one(model, op), STUCK_S)
            second = await asyncio.wait_for(infer_one(model, op), STUCK_S)
        finally:
            await asyncio.wait_for(model.close(), STUCK_S)
        assert first["OUT"].tolist() == [[b"raw", "hé".encode()], [b"7", b"label"]]
        assert int(first["PID"][0]) == int(second["PID"][0])

    asyncio.run(run())


ERRORS_CONFIG = """
    name: "errors"
    backend: "python"
    max_batch_size: 0
    input [ { name: "OP", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "HELD", data_type: TYPE_INT64, dims: [ 1 ] } ]
"""
# OP 1 answers an error, OP 2 raises; OP 0 answers how many cancelled requests the worker holds
# (its runtime's record, read through pb_utils).
ERRORS_MODEL = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                op = int(request.inputs()[0].as_numpy()[0])
                if op == 1:
                    error = pb_utils.TritonError("refused", pb_utils.TritonError.INVALID_ARG)
                    responses.append(pb_utils.InferenceResponse(error=error))
                elif op == 2:
                    raise ValueError("boom")
                else:
                    held = np.array([len(pb_utils._runtime.cancelled)], dtype=np.int64)
                    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("HELD", held)]))
            return responses
"""


def test_requests_that_failed_leave_nothing_behind_in_the_worker(tmp_path):
    # A request that ended with an error was "cancelled" in the worker afterwards, and the
    # worker kept every such key for good: memory growing with each failed request.
    async def run():
        model = create(write_model(tmp_path, "errors", ERRORS_CONFIG, ERRORS_MODEL))
        await asyncio.wait_for(model.load(), STUCK_S)
        try:
            for op in [1, 2] * 20:
                with pytest.raises(KServeError):
                    await asyncio.wait_for(infer_one(model, {"OP": np.array([op], dtype=np.int32)}), STUCK_S)
            probe = {"OP": np.array([0], dtype=np.int32)}
            held = int((await asyncio.wait_for(infer_one(model, probe), STUCK_S))["HELD"][0])
        finally:
            await asyncio.wait_for(model.close(), STUCK_S)
        assert held == 0

    asyncio.run(run())


SELF_CALLING_CONFIG = """
    name: "selfish"
    backend: "python"
    max_batch_size: 0
    input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
    output [ { name: "ERROR", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""
# N > 0 calls this same model (one instance, busy with this very call) through BLS: the call
# waits on the model's own queue. ERROR is what exec() answered ("" when it answered).
SELF_CALLING_MODEL = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
                error = b""
                if n > 0:
                    inner = pb_utils.InferenceRequest(
                        model_name="selfish",
                        inputs=[pb_utils.Tensor("N", np.array([n - 1], dtype=np.int32))],
                        requested_output_names=["ERROR"],
                    ).exec()
                    error = inner.error().message().encode() if inner.has_error() else b""
                out = pb_utils.Tensor("ERROR", np.array([error], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse([out]))
            return responses
"""


def test_a_model_waiting_on_itself_through_bls_is_freed_when_its_client_leaves(tmp_path):
    """A model with one instance calling itself waits on its own queue: as in Triton, the call
    cannot be served. Once its client gives up, the BLS call is cancelled (the model gets a
    CANCELLED error from exec()) and the instance serves the next request; it was held for good."""
    from paved.kserve.repository import ModelRepository

    write_model(tmp_path, "selfish", SELF_CALLING_CONFIG, SELF_CALLING_MODEL)

    async def run():
        repository = ModelRepository()
        repository.load_repository_dir(str(tmp_path))
        repository.start_loading()
        await asyncio.wait_for(repository.wait_loaded(), STUCK_S)
        model = repository.get_ready("selfish")
        try:
            with pytest.raises(TimeoutError):  # the client's deadline
                await asyncio.wait_for(infer_one(model, {"N": np.array([1], dtype=np.int32)}), 2)
            plain = await asyncio.wait_for(infer_one(model, {"N": np.array([0], dtype=np.int32)}), STUCK_S)
            assert plain["ERROR"].tolist() == [b""]
        finally:
            await asyncio.wait_for(repository.close(), STUCK_S)

    asyncio.run(run())


def test_the_stub_forgets_cancels_of_requests_that_ended(monkeypatch):
    """A cancelled request's key is held while it may still run (is_cancelled), dropped at its
    final send or when execute() answered it, and the oldest go past a bound: a worker serving
    for months no longer keeps every cancelled key."""
    from paved.kserve.python_backend import stub as stub_mod
    from paved.kserve.python_backend import triton_python_backend_utils as pb_utils

    class Channel:
        def __init__(self) -> None:
            self.sent: list[tuple] = []

        def send(self, message: tuple) -> None:
            self.sent.append(message)

    stub = stub_mod.Stub(Channel())  # type: ignore[arg-type]
    stub.note_cancel(5)
    assert stub.is_cancelled(5)
    stub.send(5, None, 0)
    assert stub.is_cancelled(5)  # not its last response: still cancelled
    stub.send(5, None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert not stub.is_cancelled(5) and not stub.cancelled
    stub.note_cancel(6)
    stub.forget_cancel(6, 7)
    assert not stub.cancelled
    monkeypatch.setattr(stub_mod, "MAX_CANCELLED", 3)
    for key in range(10, 15):
        stub.note_cancel(key)
    assert list(stub.cancelled) == [12, 13, 14]
