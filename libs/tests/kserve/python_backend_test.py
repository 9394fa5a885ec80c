"""Triton's Python backend on paved's KServe server (paved.kserve.python_backend), through
tritonclient over gRPC and HTTP against a server on loopback.

The models (testdata/python_backend/<model>/config.pbtxt + 1/model.py, unchanged Triton model
directories) cover: a batched add/sub model with two instances, a decoupled streaming model, a
BLS model calling both (exec, async_exec, exec(decoupled=True), an unknown model), a model whose
config comes from auto_complete_config, a Python model wrapping the server's LLM through a
streaming BLS call, and a faulty model that raises, answers errors, crashes (os._exit,
SIGSEGV) and hangs: each fails its request with a clear status, and the model serves again
after its worker is restarted.
"""

from __future__ import annotations

import logging
import os
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import LLM, FakeEngine, serving, stream, tensor, wait_for
from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.python_backend import create

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "testdata", "python_backend")
GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
MODELS = ("add_sub", "repeat", "bls", "faulty", "auto", "llm_wrap")


class LateRepository:
    """A RepositoryView bound to the server's repository once the server exists (the models
    are built before it)."""

    repository = None

    def get_ready(self, name, version=""):
        return self.repository.get_ready(name, version)

    def infer(self, model, request):
        return self.repository.infer(model, request)


def source(name: str, view=None, config: model_config_pb2.ModelConfig | None = None) -> ModelSource:
    directory = os.path.join(REPO, name)
    if config is None:
        config = model_config_pb2.ModelConfig()
        with open(os.path.join(directory, "config.pbtxt")) as f:
            text_format.Parse(f.read(), config)
    return ModelSource(
        name=name,
        version="1",
        directory=directory,
        version_dir=os.path.join(directory, "1"),
        config=config,
        repository=view or LateRepository(),
    )


@pytest.fixture(scope="module")
def server(loop):
    from paved.kserve.server import KServeServer

    view = LateRepository()
    models = [create(source(name, view)) for name in MODELS]
    kserve = KServeServer([FakeEngine()], models, host="127.0.0.1", grpc_port=0, http_port=0)
    view.repository = kserve.repository
    with serving(loop, kserve) as started:
        yield started


def model(server, name):
    return server.repository.get(name)


def pair(module, a, b):
    return [tensor(module, "INPUT0", a, "FP32"), tensor(module, "INPUT1", b, "FP32")]


def stream_all(gc, model_name, inputs, *, parameters=None, timeout=30):
    """Every response of one ModelStreamInfer request (until its final flag or an error)."""
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        gc.async_stream_infer(model_name, inputs, parameters=parameters, enable_empty_final_response=True)
        out = []
        while True:
            result, error = results.get(timeout=timeout)
            out.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        gc.stop_stream()


# ---- batched model ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_add_sub_answers_over_both_transports(server, gc, hc, module):
    client = gc if module is grpcclient else hc
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    result = client.infer("add_sub", pair(module, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("REQUESTS").shape == (2, 1)


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_large_answers_are_encoded_off_the_event_loop(server, gc, hc, module, monkeypatch):
    """An answer over the decode threshold (here 0 bytes) is encoded on the body pool, as a
    large request is decoded there: encoding 64 MiB on the loop would stall every call."""
    import threading

    from paved.http import off_loop
    from paved.kserve import grpc_server, http_server

    threads: list[str] = []
    monkeypatch.setattr(off_loop, "OFF_LOOP_BYTES", 0)
    transport = grpc_server if module is grpcclient else http_server
    name = "encode_response" if module is grpcclient else "_encode_infer"
    encode = getattr(transport, name)

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(transport, name, recording)
    client = gc if module is grpcclient else hc
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    result = client.infer("add_sub", pair(module, a, a))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    assert threads and all(t.startswith("paved-body") for t in threads), threads


def test_add_sub_config_and_metadata_are_the_pbtxt(server, gc):
    config = gc.get_model_config("add_sub").config
    assert config.backend == "python"
    assert config.max_batch_size == 8
    assert config.instance_group[0].count == 2
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1", "REQUESTS"]
    meta = gc.get_model_metadata("add_sub")
    assert meta.platform == "python"
    assert [list(t.shape) for t in meta.inputs] == [[-1, 4], [-1, 4]]


def test_dynamic_batching_passes_concurrent_requests_to_one_execute(server, gc):
    # 200 ms queue delay and 6 requests sent at once: they meet in fewer execute() calls than
    # requests, each answered with its own rows.
    done: queue.Queue = queue.Queue()
    inputs = []
    for i in range(6):
        a = np.full((1, 4), i, dtype=np.float32)
        inputs.append(a)
        gc.async_infer(
            "add_sub",
            pair(grpcclient, a, a),
            callback=lambda result, error, i=i: done.put((i, result, error)),
        )
    results = {}
    for _ in range(6):
        i, result, error = done.get(timeout=30)
        assert error is None, error
        results[i] = result
    for i, result in results.items():
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), inputs[i] * 2)
    shared = [int(r.as_numpy("REQUESTS")[0, 0]) for r in results.values()]
    assert max(shared) > 1


def test_batch_over_max_batch_size_is_refused(server, gc):
    a = np.zeros((9, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException) as e:
        gc.infer("add_sub", pair(grpcclient, a, a))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


# ---- decoupled -------------------------------------------------------------------------------
@pytest.mark.parametrize("from_thread", [False, True])
def test_decoupled_streams_n_responses_then_final(server, gc, from_thread):
    values = np.array([5, 6, 7], dtype=np.int32)
    responses = stream_all(
        gc,
        "repeat",
        [tensor(grpcclient, "IN", values, "INT32")],
        parameters={"from_thread": True} if from_thread else None,
    )
    assert all(error is None for _, error in responses)
    data = [r for r, _ in responses if r.get_response().outputs]
    assert [int(r.as_numpy("OUT")[0]) for r in data] == [5, 6, 7]
    assert [int(r.as_numpy("IDX")[0]) for r in data] == [0, 1, 2]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in responses]
    assert finals == [False, False, False, True]


def test_cancelled_stream_is_seen_by_the_model(server, gc, caplog):
    caplog.set_level(logging.INFO, logger="paved.kserve.python_backend.worker")
    values = np.arange(1_000_000, dtype=np.int32)  # far more responses than it will send
    request = ([tensor(grpcclient, "IN", values, "INT32")], {"request_id": "to-cancel"})
    responses = stream(gc, [request], model="repeat", cancel_after=2)
    assert len(responses) == 2

    def seen():
        return any("request 'to-cancel' cancelled after" in r.getMessage() for r in caplog.records)

    assert wait_for(seen, timeout=30)


def test_a_stream_its_client_does_not_read_is_cut_at_a_bound(server, gc, caplog, monkeypatch):
    """A model's send() cannot wait for the client: what a stalled client leaves unread is held
    up to a bound, then the request fails (RESOURCE_EXHAUSTED) and is cancelled in the model,
    instead of growing in memory for as long as the model sends."""
    import threading

    from paved.kserve.python_backend import served

    monkeypatch.setattr(served, "MAX_HELD_RESPONSES", 64)
    caplog.set_level(logging.INFO, logger="paved.kserve.python_backend.worker")
    reading = threading.Event()
    got: list = []

    def callback(result, error):
        reading.wait(120)  # the client reads nothing until the model was cancelled
        got.append((result, error))

    values = np.arange(1_000_000, dtype=np.int32)
    gc.start_stream(callback=callback)
    try:
        gc.async_stream_infer("repeat", [tensor(grpcclient, "IN", values, "INT32")], request_id="unread")

        def cancelled():
            return any("request 'unread' cancelled after" in r.getMessage() for r in caplog.records)

        assert wait_for(cancelled, timeout=120)
        reading.set()
        assert wait_for(lambda: bool(got) and got[-1][1] is not None, timeout=60)
    finally:
        reading.set()
        gc.stop_stream()
    assert "its client has not read" in str(got[-1][1])
    assert len(got) < len(values)


def test_decoupled_over_http_generate_stream(server, hc):
    import json
    import urllib.request

    body = json.dumps({"IN": [1, 2]}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v2/models/repeat/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        events = [
            json.loads(line[len(b"data: ") :])
            for line in response.read().splitlines()
            if line.startswith(b"data: ")
        ]
    assert [e["OUT"] for e in events if "OUT" in e] == [1, 2]


# ---- BLS -------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_bls_calls_other_models_of_the_server(server, gc, hc, module):
    client = gc if module is grpcclient else hc
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    result = client.infer("bls", pair(module, a, b))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)
    np.testing.assert_array_equal(result.as_numpy("STREAMED"), [1, 2, 3, 4])
    error = result.as_numpy("ERROR")[0]
    assert b"no_such_model" in (error if isinstance(error, bytes) else error.encode())


def test_python_model_wraps_the_llm_through_streaming_bls(server, gc):
    prompt = np.array([b"hello there"], dtype=np.object_)
    responses = stream_all(gc, "llm_wrap", [tensor(grpcclient, "PROMPT", prompt, "BYTES")])
    assert all(error is None for _, error in responses)
    pieces = [r.as_numpy("TEXT")[0] for r, _ in responses if r.get_response().outputs]
    assert pieces == [b"[w0 ]", b"[w1 ]", b"[w2 ]"]
    engine = server.repository.engines[0]
    assert engine.requests[-1].prompt.text == "HELLO THERE"
    assert engine.requests[-1].model == LLM


# ---- auto-complete ---------------------------------------------------------------------------
def test_auto_complete_config_declares_the_tensors(server, gc, hc):
    config = gc.get_model_config("auto").config
    assert config.max_batch_size == 4
    assert config.HasField("dynamic_batching")
    assert [t.name for t in config.input] == ["X"]
    x = np.array([[1.5, -2.0]], dtype=np.float64)
    result = hc.infer("auto", [tensor(httpclient, "X", x, "FP64")])
    np.testing.assert_array_equal(result.as_numpy("Y"), 2 * x)


# ---- failures --------------------------------------------------------------------------------
def op(module, value):
    return [tensor(module, "OP", np.array([value], dtype=np.int32), "INT32")]


def faulty_pid(client, module):
    return int(client.infer("faulty", op(module, 0)).as_numpy("PID")[0])


def test_exception_in_execute_fails_the_request_as_triton_does(server, gc, hc):
    with pytest.raises(InferenceServerException) as e:
        gc.infer("faulty", op(grpcclient, 4))
    assert e.value.status() == "StatusCode.INTERNAL"
    message = e.value.message()
    assert message.startswith("Failed to process the request(s) for model 'faulty_0', message: ")
    assert "ValueError: boom from faulty\n\nAt:\n" in message
    assert "faulty/1/model.py(" in message  # the model's frame, as Triton reports it
    with pytest.raises(InferenceServerException) as e:
        hc.infer("faulty", op(httpclient, 4))
    assert e.value.status() == "500"
    assert "boom from faulty" in e.value.message()


def test_triton_error_codes_map_to_statuses(server, gc, hc):
    with pytest.raises(InferenceServerException) as e:
        gc.infer("faulty", op(grpcclient, 5))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == "op 5 is refused"
    with pytest.raises(InferenceServerException) as e:
        hc.infer("faulty", op(httpclient, 5))
    assert e.value.status() == "400"


def test_outputs_not_requested_are_dropped_as_triton_does(server, gc):
    # The model answers UNDECLARED instead of PID: not requested (not even declared), not sent.
    result = gc.infer("faulty", op(grpcclient, 6))
    assert result.as_numpy("PID") is None
    assert result.get_response().outputs == []


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_decoupled_model_refuses_unary_infer(server, gc, hc, module):
    client = gc if module is grpcclient else hc
    with pytest.raises(InferenceServerException) as e:
        client.infer("repeat", [tensor(module, "IN", np.array([1], dtype=np.int32), "INT32")])
    assert e.value.status() in ("StatusCode.UNIMPLEMENTED", "501")
    assert "doesn't support models with decoupled transaction policy" in e.value.message()


@pytest.mark.parametrize(
    ("value", "reason"),
    [(1, "exited with code 3"), (3, "killed by signal SIGSEGV"), (2, "did not finish execute() within 2 s")],
    ids=["os_exit", "segfault", "hang"],
)
def test_crash_or_hang_fails_the_request_and_the_model_serves_again(server, gc, value, reason):
    before = faulty_pid(gc, grpcclient)
    with pytest.raises(InferenceServerException) as e:
        gc.infer("faulty", op(grpcclient, value), client_timeout=60)
    assert e.value.status() == "StatusCode.INTERNAL"
    assert e.value.message().startswith("Stub process 'faulty_0' is not healthy: ")
    assert reason in e.value.message()
    # The restart may still be under way: a request then waits for it.
    after = faulty_pid(gc, grpcclient)
    assert after != before
    assert server.repository.ready()


def test_python_model_output_goes_to_the_server_log(server, gc, caplog):
    caplog.set_level(logging.INFO, logger="paved.kserve.python_backend.worker")
    before = faulty_pid(gc, grpcclient)
    with pytest.raises(InferenceServerException):
        gc.infer("faulty", op(grpcclient, 4))
    lines = [r.getMessage() for r in caplog.records]
    # The traceback the worker printed to stderr, prefixed with model and instance.
    tagged = [line for line in lines if line.startswith("[faulty/faulty_0] ")]
    assert any("boom from faulty" in line for line in tagged), lines
    assert faulty_pid(gc, grpcclient) == before


# ---- config checks ---------------------------------------------------------------------------
def _set_parameter(config, key, value):
    config.parameters[key].string_value = value


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.sequence_batching.SetInParent(), "sequence_batching"),
        (lambda c: c.instance_group.add(count=1, kind=GPU), "KIND_CPU"),
        (lambda c: _set_parameter(c, "paved_execute_timeout_s", "0"), "paved_execute_timeout_s"),
        (lambda c: _set_parameter(c, "EXECUTION_ENV_PATH", "env.tar.gz"), "EXECUTION_ENV_PATH"),
        (lambda c: setattr(c, "default_model_filename", "missing.py"), "missing.py"),
        (lambda c: c.dynamic_batching.preferred_batch_size.append(9), "preferred_batch_size"),
    ],
)
def test_config_the_backend_cannot_serve_fails_create(change, field):
    config = model_config_pb2.ModelConfig()
    with open(os.path.join(REPO, "add_sub", "config.pbtxt")) as f:
        text_format.Parse(f.read(), config)
    change(config)
    with pytest.raises(ModelConfigError, match=field):
        create(source("add_sub", config=config))


# ---- pb_utils in-process -----------------------------------------------------------------------
def test_pb_utils_tensor_dlpack_round_trip_shares_memory():
    from paved.kserve.python_backend import triton_python_backend_utils as pb_utils

    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb_utils.Tensor("T", array)
    assert t.triton_dtype() == 11  # TYPE_FP32
    back = pb_utils.Tensor.from_dlpack("U", t.to_dlpack())
    assert back.name() == "U" and back.shape() == [2, 3]
    array[0, 0] = 42
    assert back.as_numpy()[0, 0] == 42  # no copy
    via_protocol = pb_utils.Tensor.from_dlpack("V", t)
    np.testing.assert_array_equal(via_protocol.as_numpy(), array)
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("S", np.array(["text"]))  # Triton asks for np.object_
    strings = pb_utils.Tensor("B", np.array([b"a", b"bc"]))
    assert strings.as_numpy().dtype == np.object_
    with pytest.raises(pb_utils.TritonModelException):
        strings.to_dlpack()


def test_pb_utils_bytes_serialization_and_config_helpers():
    from paved.kserve.python_backend import triton_python_backend_utils as pb_utils

    values = np.array([b"x", b"", b"yz"], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(values)
    assert encoded.tobytes() == b"\x01\x00\x00\x00x\x00\x00\x00\x00\x02\x00\x00\x00yz"
    assert list(pb_utils.deserialize_bytes_tensor(encoded)) == [b"x", b"", b"yz"]
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    config = {"input": [{"name": "A", "data_type": "TYPE_FP32"}], "output": []}
    assert pb_utils.get_input_config_by_name(config, "A")["data_type"] == "TYPE_FP32"
    assert pb_utils.get_output_config_by_name(config, "A") is None


def test_pb_utils_model_config_keeps_what_the_file_says():
    from paved.kserve.python_backend import triton_python_backend_utils as pb_utils

    config = pb_utils.ModelConfig(
        '{"name": "m", "max_batch_size": 8, "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}]}'
    )
    with pytest.raises(ValueError, match="max_batch_size 8"):
        config.set_max_batch_size(4)
    with pytest.raises(ValueError, match="TYPE_FP32"):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [2]})
    with pytest.raises(ValueError, match="dims"):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "Y", "data_type": "TYPE_FP32"})
    config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
    config.set_model_transaction_policy({"decoupled": True})
    assert config.as_dict()["output"] == [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]
    assert pb_utils.using_decoupled_model_transaction_policy(config.as_dict())
    with pytest.raises(pb_utils.TritonModelException, match="inside a model's worker"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[]).exec()
