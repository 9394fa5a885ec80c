"""paved's KServe v2 server against the real tritonclient (gRPC and HTTP) on loopback.

One server for the module: a scripted FakeEngine (LLM + embedding model) and the //models/xgb
XGBoost fixture, on free ports, with a 1 MiB message limit so the size errors are cheap.
"""

import asyncio
import json
import logging
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import xgboost
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import (
    EMBED,
    LLM,
    SCHEMA,
    XGB,
    FakeEngine,
    llm_inputs,
    loopback_server,
    serving,
    stream,
    tensor,
    wait_for,
    xgb_model_dir,
)
from paved.frontend import structured
from paved.kserve.server import KServeServer
from paved.kserve.xgboost_model import XGBoostModel

LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(loop, engine):
    with serving(loop, loopback_server([engine], max_message_bytes=LIMIT)) as server:
        yield server


@pytest.fixture(scope="module")
def booster():
    return xgboost.Booster(model_file=f"{xgb_model_dir()}/model.ubj")


def rows(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 32)).astype(np.float32)


def grpc_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# ---- health and metadata ------------------------------------------------------------------------
def test_health_and_server_metadata(gc, hc):
    assert gc.is_server_live() and gc.is_server_ready()
    assert hc.is_server_live() and hc.is_server_ready()
    for meta in (gc.get_server_metadata(as_json=True), hc.get_server_metadata()):
        assert meta["name"] == "paved"
        assert "binary_tensor_data" in meta["extensions"]
    for name in (XGB, LLM, EMBED):
        assert gc.is_model_ready(name) and hc.is_model_ready(name)
    assert not gc.is_model_ready("no-such-model") and not hc.is_model_ready("no-such-model")
    assert not gc.is_model_ready(XGB, "2")


def test_model_metadata_and_config(gc, hc):
    meta = gc.get_model_metadata(LLM, as_json=True)
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]}
    assert inputs["text_input"] == ("BYTES", ["1"]) and inputs["sampling_parameters"] == ("BYTES", ["1"])
    assert {t["name"] for t in meta["outputs"]} >= {"text_output", "num_input_tokens", "num_output_tokens"}
    config = gc.get_model_config(LLM).config
    assert config.model_transaction_policy.decoupled and config.backend == "vllm"
    assert config.parameters["paved.max_model_len"].string_value == "256"
    assert config.parameters["paved.constraint_backends"].string_value == "paved,xgrammar"

    meta = hc.get_model_metadata(XGB)
    assert meta["inputs"] == [{"name": "input__0", "datatype": "FP32", "shape": [-1, 32]}]
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 3]}]
    config = hc.get_model_config(XGB)
    assert config["max_batch_size"] == 64 and config["input"][0]["dims"] == [32]
    assert config["dynamic_batching"]["preferred_batch_size"] == [32, 64]
    assert hc.get_model_metadata(XGB, model_version="1")["versions"] == ["1"]

    index = {m["name"]: m["state"] for m in hc.get_model_repository_index()}
    assert index == {XGB: "READY", LLM: "READY", EMBED: "READY"}
    assert {m.name for m in gc.get_model_repository_index().models} == {XGB, LLM, EMBED}


# ---- XGBoost -------------------------------------------------------------------------------------
def test_xgboost_grpc_matches_xgboost(gc, booster):
    x = rows(7)
    result = gc.infer(XGB, [tensor(grpcclient, "input__0", x, "FP32")])
    scores = result.as_numpy("output__0")
    assert scores.shape == (7, 3) and scores.dtype == np.float32
    assert np.array_equal(scores, booster.inplace_predict(x))


def test_xgboost_http_json_and_binary_match_xgboost(hc, booster):
    x = rows(5, seed=1)
    expected = booster.inplace_predict(x)
    for binary_in in (False, True):
        for binary_out in (False, True):
            result = hc.infer(
                XGB,
                [tensor(httpclient, "input__0", x, "FP32", binary_data=binary_in)],
                outputs=[httpclient.InferRequestedOutput("output__0", binary_data=binary_out)],
            )
            assert np.array_equal(result.as_numpy("output__0"), expected), (binary_in, binary_out)


def test_xgboost_typed_contents(server, booster):
    x = rows(2, seed=2)
    request = service_pb2.ModelInferRequest(model_name=XGB)
    t = request.inputs.add(name="input__0", datatype="FP32", shape=[2, 32])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    scores = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 3)
    assert np.array_equal(scores, booster.inplace_predict(x))


def test_xgboost_concurrent_requests_are_batched_and_exact(server, booster):
    x = rows(64, seed=3)
    expected = booster.inplace_predict(x)
    batcher = server.repository.get(XGB).batcher
    before = sum(n * c for n, c in batcher.batches.items() if n > 1)

    async def run():
        client = grpcaio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:

            async def one(i):
                inp = grpcaio.InferInput("input__0", [1, 32], "FP32")
                inp.set_data_from_numpy(x[i : i + 1])
                return (await client.infer(XGB, [inp])).as_numpy("output__0")

            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    for i, scores in enumerate(results):
        assert np.array_equal(scores[0], expected[i]), i
    assert sum(n * c for n, c in batcher.batches.items() if n > 1) > before, batcher.batches


# ---- LLM over the vLLM-backend tensors -------------------------------------------------------
def test_llm_infer_non_streaming_prepends_prompt(gc, engine):
    result = gc.infer(
        LLM,
        llm_inputs(
            grpcclient,
            "hello world",
            params={"max_tokens": "3", "temperature": "0.5", "top_k": -1},
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        ),
    )
    assert result.as_numpy("text_output").tolist() == [b"hello worldw0 w1 w2 "]
    assert result.as_numpy("num_input_tokens").tolist() == [2]
    assert result.as_numpy("num_output_tokens").tolist() == [3]
    sampling = engine.requests[-1].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k) == (3, 0.5, 0)

    result = gc.infer(LLM, llm_inputs(grpcclient, "hi", params={"max_tokens": 2}, exclude=True))
    assert result.as_numpy("text_output").tolist() == [b"w0 w1 "]


def test_llm_stream_sends_deltas_then_final(gc):
    responses = stream(
        gc,
        [
            (
                llm_inputs(
                    grpcclient, "a b", stream=True, params={"max_tokens": 4}, return_num_output_tokens=True
                ),
                {},
            )
        ],
    )
    assert all(error is None for _, error in responses)
    texts = [r.as_numpy("text_output")[0] for r, _ in responses]
    assert texts == [b"w0 ", b"w1 ", b"w2 ", b"w3 "]
    assert [r.as_numpy("num_output_tokens").tolist() for r, _ in responses] == [[1]] * 4
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in responses]
    assert finals == [False, False, False, True]


def test_stream_runs_requests_concurrently_and_by_id(gc):
    requests = [
        (llm_inputs(grpcclient, f"p{i}", stream=True, params={"max_tokens": 3}), {"request_id": f"r{i}"})
        for i in range(3)
    ]
    responses = stream(gc, requests)
    by_id = {}
    for result, error in responses:
        assert error is None
        by_id.setdefault(result.get_response().id, []).append(result.as_numpy("text_output")[0])
    assert by_id == {f"r{i}": [b"w0 ", b"w1 ", b"w2 "] for i in range(3)}


def test_stream_errors_are_in_band(gc):
    ((_, error),) = stream(gc, [(llm_inputs(grpcclient, "x", stream=True, exclude=False), {})])
    assert error is not None and "exclude_input_in_output" in str(error)


def test_stream_true_on_unary_infer_is_rejected(gc):
    error = grpc_error(lambda: gc.infer(LLM, llm_inputs(grpcclient, "x", stream=True, exclude=True)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in error.message()


@pytest.mark.parametrize(
    "params, backend, kind",
    [
        ({"structured_outputs": json.dumps({"json": SCHEMA})}, "paved", "paved"),
        ({"structured_outputs": {"json": SCHEMA}}, "paved", "paved"),
        ({"guided_decoding": json.dumps({"regex": "[a-z]+"})}, "xgrammar", "regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "xgrammar", "choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "xgrammar", "grammar"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            "paved",
            "paved",
        ),
        ({"response_format": json.dumps({"type": "json_object"})}, None, None),
        ({"paved_constraint": {"type": "choice", "items": ["a", "b"]}}, "paved", "paved"),
        (
            {"extra_args": {"paved_constraint": json.dumps({"type": "regex", "pattern": "[0-9]+"})}},
            "paved",
            "paved",
        ),
    ],
)
def test_constraints_reach_the_engine(gc, engine, params, backend, kind):
    result = gc.infer(LLM, llm_inputs(grpcclient, "q", params={"max_tokens": 32, **params}, exclude=True))
    constraint = engine.requests[-1].sampling.constraint
    assert constraint is not None, params
    if backend is not None:
        assert (constraint.backend, constraint.kind) == (backend, kind)
    if "json" in json.dumps(params) and kind == "paved" and "schema" in json.dumps(params):
        assert constraint.value == {"type": "json_schema", "schema": SCHEMA, "whitespace": "compact"}
    assert json.loads(result.as_numpy("text_output")[0]) == {"ok": True, "level": "high"}


def test_a_burst_of_one_new_schema_is_served_whole(server, engine, monkeypatch):
    # Triton clients score a batch of items against one schema at once: every request carrying
    # the same new spec waits on its one check (the frontend's admission), none is refused.
    # The check is made slow so that the burst arrives while it runs (with the old bounded pool,
    # requests past 64 pending got UNAVAILABLE); it runs once.
    checks = []
    real_route = structured._route_json

    def slow(*args):
        checks.append(args)
        time.sleep(0.5)
        return real_route(*args)

    monkeypatch.setattr(structured, "_route_json", slow)
    schema = {**SCHEMA, "title": "burst"}
    params = json.dumps({"max_tokens": 32, "structured_outputs": {"json": schema}})

    async def run():
        client = grpcaio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:

            async def one(i):
                try:
                    await client.infer(LLM, llm_inputs(grpcaio, f"item {i}", params=params, exclude=True))
                except InferenceServerException as e:
                    return e.message()
                return None

            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await client.close()

    errors = [e for e in asyncio.run(run()) if e is not None]
    assert errors == [], f"{len(errors)} of 200 refused, e.g. {errors[0]}"
    assert len(checks) == 1


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"stream": True}, "stream"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "whitespace_pattern"),
        (
            {
                "response_format": {"type": "json_object"},
                "paved_constraint": {"type": "regex", "pattern": "a"},
            },
            "both",
        ),
        ({"paved_constraint": {"type": "regex", "pattern": "("}}, "paved_constraint"),
        ({"paved_constraint": {"type": "choice", "items": ["a"], "colour": "red"}}, "colour"),
        ({"temperature": 9}, "temperature"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"extra_args": {"other": 1}}, "other"),
        ("not json", "not valid JSON"),
        ("[" * 3000 + "]" * 3000, "nested more than 128 levels deep"),
        # Valid JSON, not Unicode text: a lone surrogate escape (was a tokenizer TypeError).
        (r'{"stop": ["\ud800"]}', "stop.0 contains a lone UTF-16 surrogate"),
        (r'{"structured_outputs": "{\"regex\": \"\\ud800\"}"}', "regex contains a lone UTF-16 surrogate"),
    ],
)
def test_bad_sampling_parameters_are_invalid_argument(gc, hc, params, needle):
    error = grpc_error(lambda: gc.infer(LLM, llm_inputs(grpcclient, "q", params=params)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and needle in error.message(), error.message()
    with pytest.raises(InferenceServerException) as info:
        hc.infer(LLM, llm_inputs(httpclient, "q", params=params))
    assert info.value.status() == "400" and needle in info.value.message()


def test_sampling_parameters_as_request_parameters(gc, engine):
    result = gc.infer(LLM, llm_inputs(grpcclient, "q", exclude=True), parameters={"max_tokens": 2, "seed": 7})
    assert result.as_numpy("text_output").tolist() == [b"w0 w1 "]
    assert engine.requests[-1].sampling.seed == 7
    error = grpc_error(
        lambda: gc.infer(LLM, llm_inputs(grpcclient, "q", params={"max_tokens": 1}), parameters={"seed": 1})
    )
    assert "both" in error.message()


def test_logprobs_finish_reason_and_n(gc):
    result = gc.infer(
        LLM,
        llm_inputs(
            grpcclient,
            "q",
            params={"max_tokens": 2, "logprobs": 2, "n": 2},
            exclude=True,
            return_logprobs=True,
            return_cumulative_logprob=True,
            return_finish_reason=True,
        ),
    )
    assert result.as_numpy("text_output").tolist() == [b"w0 w1 ", b"w0 w1 "]
    assert result.as_numpy("finish_reason").tolist() == [b"length", b"length"]
    assert result.as_numpy("cumulative_logprob").tolist() == [-1.0, -1.0]
    positions = json.loads(result.as_numpy("logprobs")[0])
    assert len(positions) == 2
    assert positions[0]["0"] == {"logprob": -0.5, "rank": None, "decoded_token": "w0 "}
    assert positions[0]["100"]["rank"] == 1 and positions[0]["101"]["rank"] == 2

    result = gc.infer(LLM, llm_inputs(grpcclient, "q", params={"max_tokens": 1}, return_logprobs=True))
    assert result.as_numpy("logprobs").tolist() == [b"null"]


def test_embedding_request(gc, engine):
    body = json.dumps({"input": "a b c", "pooling_params": {"dimensions": [3]}})
    inputs = [
        tensor(grpcclient, "embedding_request", np.array([body.encode()], dtype=object), "BYTES"),
        tensor(grpcclient, "return_num_input_tokens", np.array([True]), "BOOL"),
    ]
    result = gc.infer(EMBED, inputs)
    assert json.loads(result.as_numpy("text_output")[0]) == [5.0, 0.5, 0.5]
    assert result.as_numpy("num_input_tokens").tolist() == [3]
    assert engine.embed_requests[-1].dimensions == 3


def test_http_generate_and_generate_stream(server):
    base = f"http://127.0.0.1:{server.http_port}/v2/models/{LLM}"
    with httpx.Client(timeout=10) as client:
        r = client.post(f"{base}/generate", json={"text_input": "a b", "parameters": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        assert r.json() == {"model_name": LLM, "model_version": "1", "text_output": "a bw0 w1 "}
        body = {"text_input": "x", "stream": True, "parameters": {"max_tokens": 3}}
        with client.stream("POST", f"{base}/generate_stream", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert [e["text_output"] for e in events] == ["w0 ", "w1 ", "w2 "]
        r = client.post(f"{base}/generate", json={"text_input": "x", "parameters": {"bogus": 1}})
        assert r.status_code == 400 and "bogus" in r.json()["error"]


# ---- errors ----------------------------------------------------------------------------------------
def test_unknown_model_is_not_found(gc, hc):
    x = rows(1)
    error = grpc_error(lambda: gc.infer("nope", [tensor(grpcclient, "input__0", x, "FP32")]))
    assert error.status() == "StatusCode.NOT_FOUND" and "nope" in error.message()
    assert grpc_error(lambda: gc.get_model_metadata("nope")).status() == "StatusCode.NOT_FOUND"
    assert grpc_error(lambda: gc.get_model_config("nope")).status() == "StatusCode.NOT_FOUND"
    assert grpc_error(lambda: gc.get_model_metadata(XGB, "7")).status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        hc.infer("nope", [tensor(httpclient, "input__0", x, "FP32")])
    assert info.value.status() == "404"
    with pytest.raises(InferenceServerException) as info:
        hc.get_model_config("nope")
    assert info.value.status() == "404"


@pytest.mark.parametrize(
    "name, value, datatype, needle",
    [
        ("input__0", rows(2).astype(np.float64), "FP64", "data-type is 'FP64'"),
        ("input__0", rows(2)[:, :31].copy(), "FP32", "unexpected shape"),
        ("input__0", np.zeros((65, 32), np.float32), "FP32", "batch-size must be between 1 and 64"),
        ("features", rows(2), "FP32", "unexpected inference input 'features'"),
    ],
)
def test_bad_tensors_are_invalid_argument_naming_the_tensor(gc, hc, name, value, datatype, needle):
    inputs = [tensor(grpcclient, name, value, datatype)]
    error = grpc_error(lambda: gc.infer(XGB, inputs))
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert needle in error.message() and name in error.message(), error.message()
    with pytest.raises(InferenceServerException) as info:
        hc.infer(XGB, [tensor(httpclient, name, value, datatype)])
    assert info.value.status() == "400" and name in info.value.message()


def test_missing_input_is_invalid_argument(gc):
    inputs = [tensor(grpcclient, "stream", np.array([False]), "BOOL")]
    error = grpc_error(lambda: gc.infer(LLM, inputs))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "text_input" in error.message()


def test_inconsistent_raw_size_is_invalid_argument(server):
    request = service_pb2.ModelInferRequest(model_name=XGB)
    request.inputs.add(name="input__0", datatype="FP32", shape=[1, 32])
    request.raw_input_contents.append(b"\0" * 100)
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input__0" in info.value.details()


def test_contents_and_raw_contents_together_are_invalid_argument(server):
    request = service_pb2.ModelInferRequest(model_name=XGB)
    tensor = request.inputs.add(name="input__0", datatype="FP32", shape=[1, 32])
    tensor.contents.fp32_contents.extend([1.0] * 32)
    request.raw_input_contents.append(np.zeros((1, 32), np.float32).tobytes())
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both contents and raw_input_contents" in info.value.details()


def test_malformed_http_infer_fields_are_400(server):
    """Wrong-typed tensor / output `parameters`, a non-boolean binary_data and a header length
    of digits int() refuses ('²', 5,000 zeros) are 400s naming the field (each was a 500, or binary output
    for binary_data "false"); an empty `outputs` list asks for every output, as over gRPC."""
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{XGB}/infer"
    good = {"name": "input__0", "datatype": "FP32", "shape": [1, 32], "data": [0.0] * 32}
    out = {"name": "output__0"}
    cases = [
        ({"inputs": [{**good, "parameters": 5}]}, {}, "'parameters' must be an object"),
        ({"inputs": [{**good, "parameters": ["binary_data_size"]}]}, {}, "'parameters' must be an object"),
        ({"inputs": [good], "outputs": [{**out, "parameters": 7}]}, {}, "'parameters' must be an object"),
        ({"inputs": [good], "outputs": [{**out, "parameters": {"binary_data": "false"}}]}, {}, "binary_data"),
        ({"inputs": [good]}, {"Inference-Header-Content-Length": "²".encode("latin-1")}, "Inference-Header"),
        ({"inputs": [good]}, {"Inference-Header-Content-Length": "0" * 5000}, "Inference-Header"),
    ]
    for body, headers, needle in cases:
        r = httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.status_code, r.text)
    r = httpx.post(url, json={"inputs": [good], "outputs": []}, timeout=30)
    assert r.status_code == 200 and [o["name"] for o in r.json()["outputs"]] == ["output__0"], r.text
    index = f"http://127.0.0.1:{server.http_port}/v2/repository/index"
    r = httpx.post(index, json={"ready": "false"}, timeout=30)  # was read as true
    assert r.status_code == 400 and "'ready' must be a boolean" in r.json()["error"], r.text
    assert httpx.post(index, json={"ready": False}, timeout=30).status_code == 200


def test_compressed_http_bodies_are_read_whole_or_refused(server):
    """gzip and deflate bodies are inflated (bounded); one cut short or with data after its end
    is a 400, never read as the prefix that arrived."""
    import gzip
    import zlib

    url = f"http://127.0.0.1:{server.http_port}/v2/models/{XGB}/infer"
    body = json.dumps(
        {"inputs": [{"name": "input__0", "datatype": "FP32", "shape": [1, 32], "data": [0.0] * 32}]}
    ).encode()
    packed = gzip.compress(body)
    for encoding, content in (("gzip", packed), ("deflate", zlib.compress(body))):
        r = httpx.post(url, content=content, headers={"content-encoding": encoding}, timeout=30)
        assert r.status_code == 200, r.text
    for content, needle in ((packed[:-12], "truncated"), (packed + packed, "after its end")):
        r = httpx.post(url, content=content, headers={"content-encoding": "gzip"}, timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"], r.text


def test_oversized_messages(gc, hc):
    big = np.zeros((LIMIT // 128 + 64, 32), np.float32)  # > 1 MiB
    error = grpc_error(lambda: gc.infer(XGB, [tensor(grpcclient, "input__0", big, "FP32")]))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    with pytest.raises(InferenceServerException) as info:
        hc.infer(XGB, [tensor(httpclient, "input__0", big, "FP32", binary_data=True)])
    assert info.value.status() == "413" and "limit" in info.value.message()


def test_not_ready_model_is_unavailable(gc, hc, engine):
    engine.set_ready(False)
    try:
        assert not gc.is_server_ready() and not gc.is_model_ready(LLM)
        error = grpc_error(lambda: gc.infer(LLM, llm_inputs(grpcclient, "q")))
        assert error.status() == "StatusCode.UNAVAILABLE"
        with pytest.raises(InferenceServerException) as info:
            hc.infer(LLM, llm_inputs(httpclient, "q"))
        assert info.value.status() == "503"
    finally:
        engine.set_ready(True)
    assert gc.is_server_ready()


def test_cancelled_stream_aborts_the_engine_request(gc, engine):
    responses = stream(
        gc, [(llm_inputs(grpcclient, "hang", stream=True), {"request_id": "to-cancel"})], cancel_after=2
    )
    assert len(responses) == 2
    admitted = engine.requests[-1].request_id
    assert wait_for(lambda: admitted in engine.aborted), engine.aborted


def test_unary_deadline_aborts_the_engine_request(gc, engine):
    before = len(engine.requests)
    # Long enough to be admitted even on a busy machine; "hang" never finishes by itself.
    error = grpc_error(lambda: gc.infer(LLM, llm_inputs(grpcclient, "hang"), client_timeout=2))
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert len(engine.requests) == before + 1
    admitted = engine.requests[-1].request_id
    assert wait_for(lambda: admitted in engine.aborted), engine.aborted


def test_unsupported_features_say_so(gc, hc, server):
    error = grpc_error(lambda: gc.register_system_shared_memory("r", "/k", 8))
    assert error.status() == "StatusCode.UNIMPLEMENTED" and "not supported" in error.message()
    assert grpc_error(lambda: gc.get_log_settings()).status() == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException) as info:
        hc.load_model(XGB)
    assert info.value.status() == "501"
    r = httpx.get(f"http://127.0.0.1:{server.http_port}/v2/nothing/here")
    assert r.status_code == 404 and "error" in r.json()


# ---- readiness ----------------------------------------------------------------------------------
class _GatedModel(XGBoostModel):
    """Loads only once the test opens the gate."""

    gate: asyncio.Event

    async def load(self):
        await self.gate.wait()
        await super().load()


def test_server_ready_only_when_every_model_is_loaded(loop):
    engine = FakeEngine(ready=False)

    async def start():
        model = _GatedModel.from_directory(xgb_model_dir())
        model.gate = asyncio.Event()
        server = KServeServer([engine], [model], host="127.0.0.1", grpc_port=0, http_port=0)
        await server.start()
        return server, model

    server, model = loop.run(start())
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.is_server_live() and not client.is_server_ready()
        assert not client.is_model_ready(XGB) and not client.is_model_ready(LLM)
        states = {m.name: m.state for m in client.get_model_repository_index().models}
        assert states[XGB] == "LOADING"
        r = httpx.get(f"http://127.0.0.1:{server.http_port}/v2/health/ready")
        assert r.status_code == 400 and "error" in r.json()
        # paved's own probe paths (the gateway's and the launcher's): 503 while loading.
        r = httpx.get(f"http://127.0.0.1:{server.http_port}/health/ready")
        assert r.status_code == 503 and "error" in r.json()
        assert httpx.get(f"http://127.0.0.1:{server.http_port}/health/live").status_code == 200
        error = grpc_error(lambda: client.infer(XGB, [tensor(grpcclient, "input__0", rows(1), "FP32")]))
        assert error.status() == "StatusCode.UNAVAILABLE"

        loop.loop.call_soon_threadsafe(model.gate.set)
        assert wait_for(lambda: client.is_model_ready(XGB))
        assert not client.is_server_ready()  # the engine is still loading
        engine.set_ready(True)
        assert client.is_server_ready() and client.is_model_ready(LLM)
        assert httpx.get(f"http://127.0.0.1:{server.http_port}/health/ready").status_code == 200
    finally:
        client.close()
        loop.run(server.stop(grace_s=1))


def test_busy_port_fails_at_start(loop, server):
    async def start():
        await KServeServer([], [], host="127.0.0.1", grpc_port=None, http_port=server.http_port).start()

    with pytest.raises(OSError):
        loop.run(start())


def test_http_client_disconnect_aborts_the_engine_request(server, engine):
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{LLM}"
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hang"]}]}
    before = len(engine.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/infer", json=body, timeout=2)
    assert len(engine.requests) == before + 1
    admitted = engine.requests[-1].request_id
    assert wait_for(lambda: admitted in engine.aborted), engine.aborted

    with httpx.Client(timeout=10) as client:
        with client.stream(
            "POST", f"{url}/generate_stream", json={"text_input": "hang", "stream": True}
        ) as r:
            assert next(r.iter_lines()).startswith("data: ")
        admitted = engine.requests[-1].request_id
    assert wait_for(lambda: admitted in engine.aborted), engine.aborted


class _Admission:
    """A one-slot admission bound, like the OpenAI frontend's registry."""

    def __init__(self):
        self.in_flight = 0

    def __call__(self, model: str, sequences: int):
        from paved.engine.protocol import EngineOverloadedError

        if self.in_flight + sequences > 1:
            raise EngineOverloadedError(f"model {model!r} is at capacity")
        self.in_flight += sequences
        admission = self

        class Ticket:
            def release(self):
                admission.in_flight -= sequences

        return Ticket()


def test_shared_admission_bound(loop):
    admission = _Admission()

    async def start():
        server = KServeServer(
            [FakeEngine()], [], host="127.0.0.1", grpc_port=0, http_port=None, admission=admission
        )
        await server.start()
        return server

    server = loop.run(start())
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.infer(LLM, llm_inputs(grpcclient, "q", params={"max_tokens": 1}))
        assert admission.in_flight == 0  # released when the response ended
        error = grpc_error(lambda: client.infer(LLM, llm_inputs(grpcclient, "q", params={"n": 2})))
        assert error.status() == "StatusCode.UNAVAILABLE" and "capacity" in error.message()
        responses = stream(client, [(llm_inputs(grpcclient, "hang", stream=True), {})], cancel_after=1)
        assert len(responses) == 1
        assert wait_for(lambda: admission.in_flight == 0)  # released by the cancellation too
    finally:
        client.close()
        loop.run(server.stop(grace_s=1))


def test_http_json_text_with_a_lone_surrogate_is_400(server):
    body = rb'{"inputs":[{"name":"text_input","datatype":"BYTES","shape":[1],"data":["\ud800"]}]}'
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/models/{LLM}/infer", content=body)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]


@pytest.mark.parametrize("depth", [129, 5000])
def test_http_bodies_nested_too_deep_are_400(server, depth):
    # 5000 levels made json.loads raise RecursionError, answered as a 500.
    deep = b"[" * depth + b"]" * depth
    for path, body in (
        ("infer", b'{"inputs":[{"name":"input__0","datatype":"FP32","shape":[1,32],"data":' + deep + b"}]}"),
        ("generate", b'{"text_input":"a","parameters":{"x":' + deep + b"}}"),
    ):
        model = XGB if path == "infer" else LLM
        r = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/{path}", content=body)
        assert r.status_code == 400, r.text
        assert "nested more than 128 levels deep" in r.json()["error"]


# ---- request ids and the access log ---------------------------------------------------------
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


def access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "paved.kserve.access"]


def access_line(caplog, request_id: str) -> dict:
    # The line is written once the call has ended on the server's side, which may be just
    # after the client has its answer.
    assert wait_for(lambda: any(e["request_id"] == request_id for e in access_lines(caplog)), timeout=10), (
        access_lines(caplog)
    )
    (line,) = [e for e in access_lines(caplog) if e["request_id"] == request_id]
    return line


def test_access_lines_carry_the_callers_request_id_and_trace(server, gc, hc, caplog):
    caplog.set_level(logging.INFO, logger="paved.kserve.access")
    ids = {"traceparent": TRACEPARENT}
    gc.infer(XGB, [tensor(grpcclient, "input__0", rows(2), "FP32")], headers={**ids, "x-request-id": "g-1"})
    line = access_line(caplog, "g-1")
    assert line["trace_id"] == TRACE_ID and line["parent_span_id"] == CALLER_SPAN
    assert line["span_id"] != CALLER_SPAN and len(line["span_id"]) == 16
    assert (line["protocol"], line["method"], line["model"], line["status"]) == (
        "kserve-grpc",
        "ModelInfer",
        XGB,
        "OK",
    )
    assert line["duration_ms"] >= 0
    # Nothing of the request's tensors reaches the line.
    assert set(line) == {
        "request_id",
        "trace_id",
        "span_id",
        "parent_span_id",
        "protocol",
        "method",
        "model",
        "status",
        "duration_ms",
    }

    hc.infer(XGB, [tensor(httpclient, "input__0", rows(2), "FP32")], headers={**ids, "x-request-id": "h-1"})
    line = access_line(caplog, "h-1")
    assert (line["trace_id"], line["protocol"], line["method"], line["model"], line["status"]) == (
        TRACE_ID,
        "kserve-http",
        "ModelInfer",
        XGB,
        200,
    )

    # An error is logged with its code; the HTTP side answers the request id.
    r = httpx.get(
        f"http://127.0.0.1:{server.http_port}/v2/models/nope/config", headers={"x-request-id": "h-2"}
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == "h-2"
    assert access_line(caplog, "h-2")["status"] == 404
    error = grpc_error(lambda: gc.get_model_metadata("nope", headers={"x-request-id": "g-2"}))
    assert "NOT_FOUND" in str(error.status())
    line = access_line(caplog, "g-2")
    assert (line["method"], line["model"], line["status"]) == ("ModelMetadata", "nope", "NOT_FOUND")

    # A stream's line is written when it ends, naming its model.
    inputs = llm_inputs(grpcclient, "a b", stream=True, params={"max_tokens": 2})
    responses = stream(gc, [(inputs, {})], headers={"x-request-id": "s-1"})
    assert [e for _, e in responses if e is not None] == []
    line = access_line(caplog, "s-1")
    assert (line["method"], line["model"], line["status"]) == ("ModelStreamInfer", LLM, "OK")


def test_malformed_request_id_is_replaced_and_sent_back(server, caplog):
    caplog.set_level(logging.INFO, logger="paved.kserve.access")
    request = service_pb2.ModelReadyRequest(name=XGB)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelReady.with_call(request, metadata=(("x-request-id", "kept-1"),), timeout=10)
        assert dict(call.trailing_metadata())["x-request-id"] == "kept-1"
        _, call = stub.ModelReady.with_call(request, metadata=(("x-request-id", "bad id!"),), timeout=10)
        new_id = dict(call.trailing_metadata())["x-request-id"]
    assert new_id != "bad id!" and len(new_id) == 32
    line = access_line(caplog, new_id)
    assert line["method"] == "ModelReady" and line["parent_span_id"] is None
    assert not any(e["request_id"] == "bad id!" for e in access_lines(caplog))


def test_http_client_leaving_takes_its_request_out_of_the_batch_queue(loop, tmp_path):
    """A request waiting in a batcher's queue (a 60 s queue delay) whose HTTP client gives up
    leaves the queue at once, as a gRPC call past its deadline does; it stayed queued until
    its batch ran, so clients that time out and retry could fill the bounded queue."""
    import shutil

    source = xgb_model_dir()
    with open(f"{source}/config.json") as f:
        config = json.load(f)
    config["dynamic_batching"] = {"max_queue_delay_microseconds": 60_000_000, "preferred_batch_size": [32]}
    config["parameters"]["paved_adaptive_queue_delay"] = {"string_value": "false"}
    shutil.copy(f"{source}/model.ubj", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = XGBoostModel.from_directory(str(tmp_path))
    with serving(loop, KServeServer([], [model], host="127.0.0.1", grpc_port=None, http_port=0)) as server:
        url = f"http://127.0.0.1:{server.http_port}/v2/models/{model.name}/infer"
        data = rows(1).ravel().tolist()
        body = {"inputs": [{"name": "input__0", "shape": [1, 32], "datatype": "FP32", "data": data}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=1)
        assert wait_for(lambda: model.batcher._pending_rows == 0), model.batcher._pending_rows
        assert not model.batcher.batches  # nothing ran: the request left before its batch
