"""The frontend process serving both APIs, and fronting a remote model (real vLLM, real clients).

Process A: `python -m paved.frontend.server --model <tiny> --kserve-grpc-port 0
--kserve-http-port 0 --kserve-model-dir <xgb>`: the OpenAI API and KServe v2 over one
in-process vLLM engine, plus an XGBoost model on KServe only.

Process B: `python -m paved.frontend.server --engine kserve://127.0.0.1:<A's gRPC> --model tiny`:
the OpenAI API in remote mode, fronting A over KServe v2 gRPC.

tritonclient (gRPC and HTTP) talks to A; the official openai client to both.
"""

import json
import queue
import signal
import socket

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost
from servers import ServerProcess
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import llm_inputs, wait_for, xgb_model_dir
from paved.testing.fixtures import tiny_model_dir

MODEL = "tiny"
# Inside paved's JSON subset: the remote model's card says paved enforces it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "score"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def local():
    server = ServerProcess(
        "--model",
        tiny_model_dir(),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--kserve-grpc-port",
        "0",
        "--kserve-http-port",
        "0",
        "--kserve-model-dir",
        xgb_model_dir(),
        ready_timeout_s=600,
    )
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def remote(local):
    server = ServerProcess(
        "--engine",
        f"kserve://127.0.0.1:{local.kserve_grpc_port}?tokenizer={tiny_model_dir()}",
        "--model",
        MODEL,
        ready_timeout_s=120,
    )
    yield server
    server.terminate()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def start_llm_stream(server, text: str, params: dict) -> tuple:
    """One decoupled ModelStreamInfer request to `server`'s KServe port; (client, queue of
    (result, error)). The caller stops the stream and closes the client."""
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.kserve_grpc_port}")
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)))
    gc.async_stream_infer(
        MODEL, llm_inputs(grpcclient, text, params=params, stream=True, return_num_output_tokens=True)
    )
    return gc, results


def test_kserve_listeners_run_in_the_frontend_process(local):
    assert local.kserve_grpc_port and local.kserve_http_port
    assert local.kserve_grpc_port != local.kserve_http_port
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{local.kserve_grpc_port}")
    hc = httpclient.InferenceServerClient(f"127.0.0.1:{local.kserve_http_port}")
    try:
        assert gc.is_server_live() and gc.is_server_ready() and hc.is_server_ready()
        assert {m.name for m in gc.get_model_repository_index().models} == {MODEL, "xgb_scorer"}
        assert gc.is_model_ready(MODEL) and hc.is_model_ready("xgb_scorer")

        # The LLM over gRPC, as a Triton + vLLM client sends it.
        result = gc.infer(
            MODEL,
            llm_inputs(
                grpcclient,
                "The quick brown fox",
                params={"max_tokens": 8, "temperature": 0, "ignore_eos": True},
                exclude_input_in_output=True,
                return_num_output_tokens=True,
            ),
        )
        assert result.as_numpy("num_output_tokens").tolist() == [8]
        assert result.as_numpy("text_output")[0].decode()

        # The classic model over HTTP (binary tensors), bit-identical to xgboost.
        x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
        t = httpclient.InferInput("input__0", [5, 32], "FP32")
        t.set_data_from_numpy(x, binary_data=True)
        booster = xgboost.Booster(model_file=f"{xgb_model_dir()}/model.ubj")
        assert np.array_equal(hc.infer("xgb_scorer", [t]).as_numpy("output__0"), booster.inplace_predict(x))

        with pytest.raises(InferenceServerException) as e:
            gc.infer("nope", llm_inputs(grpcclient, "x", params={}))
        assert "NOT_FOUND" in str(e.value.status())
    finally:
        gc.close()
        hc.close()

    # The OpenAI API of the same process, over the same engine.
    models = openai_client(local).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_kserve_streaming_in_the_frontend_process(local):
    gc, results = start_llm_stream(
        local, "Once upon", {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    try:
        tokens = 0
        for _ in range(64):
            result, error = results.get(timeout=60)
            assert error is None, error
            tokens += int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert tokens == 6
    finally:
        gc.stop_stream()
        gc.close()


def test_remote_mode_returns_schema_valid_json(remote):
    """openai client -> frontend (remote mode) -> KServe v2 gRPC -> frontend (vLLM) -> JSON."""
    client = openai_client(remote)
    assert [m.id for m in client.models.list().data] == [MODEL]
    for seed in range(4):
        completion = client.completions.create(
            model=MODEL,
            prompt="A person as JSON:",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": RESPONSE_FORMAT},
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert completion.usage.completion_tokens > 0
        assert completion.usage.prompt_tokens > 0

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=200,
        temperature=1.0,
        response_format=RESPONSE_FORMAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in chat:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    assert usage is not None and usage.completion_tokens > 0


def test_remote_mode_errors_are_client_errors(remote):
    client = openai_client(remote)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    # Prompt scoring needs prompt logprobs, which the tensor interface cannot carry: refused.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, echo=True, logprobs=1)


def test_sigterm_drains_both_apis_then_closes_the_kserve_ports(local, remote):
    """SIGTERM: KServe's ServerReady turns false and new LLM calls are refused at once, while
    an OpenAI stream and a KServe stream already running both finish; then exit 0."""
    assert remote.terminate() == 0
    gc, results = start_llm_stream(local, "go", {"max_tokens": 300, "temperature": 0, "ignore_eos": True})
    try:
        first, error = results.get(timeout=60)
        assert error is None, error
        tokens = int(first.as_numpy("num_output_tokens")[0])

        body = {"model": MODEL, "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", local.url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)
            local.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: not gc.is_server_ready(), timeout=10)
            with pytest.raises(InferenceServerException) as refused:
                gc.infer(MODEL, llm_inputs(grpcclient, "x", params={"max_tokens": 2}))
            assert "UNAVAILABLE" in str(refused.value.status())
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"

        final = first.get_response().parameters["triton_final_response"].bool_param
        for _ in range(400):
            if final:
                break
            result, error = results.get(timeout=60)
            assert error is None, error
            tokens += int(result.as_numpy("num_output_tokens")[0])
            final = result.get_response().parameters["triton_final_response"].bool_param
        assert final and tokens == 300
    finally:
        gc.stop_stream()
        gc.close()
    assert local.proc.wait(120) == 0, local.tail()
    for port in (local.kserve_grpc_port, local.kserve_http_port):
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))
