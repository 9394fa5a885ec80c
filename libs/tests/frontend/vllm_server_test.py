"""The real server (`python -m paved.frontend.server`) over two real vLLM engines in one process:
//models/tiny (chat, completions, structured outputs) and all-MiniLM-L6-v2 (embeddings).

One server for the whole target (booting both engines costs ~1 min of a core); tests talk to it
with the official `openai` client (sync, async, streaming) and plain HTTP. The last test stops
it with SIGTERM to prove a graceful drain, so it must stay last in this file.
"""

from paved.engine import vllm_env

# Before vllm is imported anywhere (and at module top: vLLM's engine core uses spawn).
vllm_env.apply_defaults()

import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from servers import ServerProcess, minilm_model_toml, tiny_model_toml, write_config  # noqa: E402

MAX_MODEL_LEN = 1024
MAX_QUEUED = 24


def _obj(properties: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


# Schemas inside paved's subset: each must come back complete and valid at temperature 1.0
# with max_tokens 200 on a random model (paved's budget-aware engine closes the JSON in time).
PAVED_SCHEMAS = {
    "boolean": _obj({"ok": {"type": "boolean"}}),
    "enum": _obj({"level": {"enum": ["low", "mid", "high"]}}),
    "short_string": _obj({"name": {"type": "string", "maxLength": 12}}),
    "bounded_string": _obj({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "unbounded_string": _obj({"text": {"type": "string"}}),
    "integer_range": _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "integer": _obj({"n": {"type": "integer"}}),
    "number": _obj({"x": {"type": "number"}}),
    "string_array": _obj(
        {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1}}
    ),
    "nested": _obj({"user": _obj({"id": {"type": "integer"}, "admin": {"type": "boolean"}})}),
    "nullable": _obj({"note": {"type": ["string", "null"], "maxLength": 10}}),
    "const": _obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}}),
    "any_of": _obj({"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}),
    "optional_field": _obj({"a": {"type": "boolean"}, "b": {"type": "integer"}}, required=["a"]),
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 4,
    },
    "top_level_enum": {"enum": ["red", "green", "blue"]},
    "top_level_string": {"type": "string", "maxLength": 20},
    "pattern": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "refs": {
        **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        "$defs": {"point": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
    },
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": _obj(
                    {"sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1}}
                ),
            }
        }
    ),
    "many_fields": _obj(
        {
            "a": {"type": "boolean"},
            "b": {"enum": ["x", "y"]},
            "c": {"type": "integer", "minimum": -5, "maximum": 5},
            "d": {"type": "string", "maxLength": 4},
            "e": {"type": "null"},
        }
    ),
    "deep": _obj({"l1": _obj({"l2": _obj({"l3": _obj({"leaf": {"type": "string", "maxLength": 30}})})})}),
    "long_strings": _obj({f"s{i}": {"type": "string", "maxLength": 40} for i in range(4)}),
    "number_array": _obj(
        {"values": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 6}}
    ),
}
# Outside paved's subset: enforced by xgrammar instead (the header says so).
XGRAMMAR_SCHEMAS = {
    "one_of": {
        "oneOf": [_obj({"kind": {"const": "a"}}), _obj({"kind": {"const": "b"}, "n": {"type": "boolean"}})]
    },
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^k[0-9]$": {"type": "boolean"}},
        "additionalProperties": False,
    },
}
# Enforceable by neither backend: a 400, never an unconstrained answer.
UNENFORCEABLE_SCHEMA = {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}


@pytest.fixture(scope="module")
def server():
    config = write_config(
        os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "frontend.toml"),
        "[server]\nmax_body_bytes = 1048576\ndrain_timeout_s = 60\n",
        tiny_model_toml(max_model_len=MAX_MODEL_LEN, max_queued_sequences=MAX_QUEUED),
        minilm_model_toml(),
    )
    proc = ServerProcess("--config", config)
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if not line.startswith(name + "{"):
            continue
        sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.index("}")]))
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- basics -----------------------------------------------------------------------------------
def test_models_and_health(client, url):
    assert {m.id for m in client.models.list().data} == {"tiny", "minilm"}
    assert httpx.get(url + "/health/live").status_code == 200
    assert httpx.get(url + "/health/ready").json() == {"status": "ready", "models": ["tiny", "minilm"]}


def test_chat_sync_and_streaming(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, n=2, user="test"
    )
    assert len(out.choices) == 2 and all(c.message.content for c in out.choices)
    assert out.usage.completion_tokens <= 24 and out.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.0,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 10 and text
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0.0
    )
    assert again.choices[0].message.content == text  # greedy is deterministic across paths


def test_continue_final_message_leaves_the_answer_open(client):
    """vLLM's extension on the real template: the final assistant message is rendered open (no
    end-of-turn, no new assistant header), so the prompt is shorter than the same messages
    closed, and generation goes on from it."""
    messages = [{"role": "user", "content": "Count to ten"}, {"role": "assistant", "content": "1, 2, 3,"}]
    closed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.0)
    opened = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0.0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert opened.usage.prompt_tokens < closed.usage.prompt_tokens
    assert opened.choices[0].message.content


def test_sampling_parameters(client):
    kwargs = {"model": "tiny", "prompt": "The river", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9}
    a = client.completions.create(**kwargs, seed=1234, presence_penalty=0.5, frequency_penalty=0.5)
    b = client.completions.create(**kwargs, seed=1234, presence_penalty=0.5, frequency_penalty=0.5)
    assert a.choices[0].text == b.choices[0].text  # seeded sampling is reproducible
    stopped = client.completions.create(model="tiny", prompt="The river", max_tokens=64, stop=[" "], seed=3)
    assert " " not in stopped.choices[0].text
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_async_client_concurrency(url):
    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        calls = [
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8
            )
            for i in range(8)
        ]
        stream = await client.completions.create(model="tiny", prompt="x", max_tokens=6, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        return await asyncio.gather(*calls), streamed

    results, streamed = asyncio.run(run())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results) and streamed


def test_embeddings_are_a_real_model(client):
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Quarterly tax filing deadlines."]
    out = client.embeddings.create(model="minilm", input=texts)
    vectors = [d.embedding for d in out.data]
    assert all(len(v) == 384 for v in vectors)
    assert all(abs(math.fsum(x * x for x in v) - 1.0) < 1e-3 for v in vectors)  # normalized

    def cos(a, b):
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2]) + 0.2
    assert out.usage.prompt_tokens > 0


def test_prefill_only_scoring_and_rank(client, url):
    out = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=0, echo=True, logprobs=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == "the cat sat" and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:])
    response = httpx.post(
        url + "/v1/rank",
        json={
            "model": "tiny",
            "context": "the cat sat on the",
            "candidates": [" mat", " moon landing", " x y z w"],
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["logprob"] for d in data] == sorted((d["logprob"] for d in data), reverse=True)
    assert {d["text"] for d in data} == {" mat", " moon landing", " x y z w"}
    assert all(d["logprob"] < 0 and d["tokens"] >= 1 for d in data)


# ---- structured outputs ------------------------------------------------------------------------
def _constrained(url: str, schema: dict, path: str, stream: bool) -> tuple[str, str, str]:
    """(backend header, text, finish_reason) for one json_schema request at temperature 1.0."""
    body: dict = {
        "model": "tiny",
        "max_tokens": 200,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
        "stream": stream,
    }
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Reply in JSON."}]
    else:
        body["prompt"] = "JSON:"
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        backend = response.headers["x-paved-constraint-backend"]
        if not stream:
            choice = json.loads(response.read())["choices"][0]
            return (
                backend,
                choice.get("message", choice).get("content", choice.get("text")),
                choice["finish_reason"],
            )
        text, finish = "", None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                finish = choice["finish_reason"] or finish
        return backend, text, finish


PATHS = [
    ("/v1/chat/completions", False),
    ("/v1/chat/completions", True),
    ("/v1/completions", False),
    ("/v1/completions", True),
]


def test_json_schemas_complete_and_validate_with_paved(url):
    """Every path (chat/completions x streaming or not) enforces every schema in paved's subset."""
    assert len(PAVED_SCHEMAS) >= 20
    jobs = [(name, schema, *PATHS[i % len(PATHS)]) for i, (name, schema) in enumerate(PAVED_SCHEMAS.items())]
    results: dict[str, tuple] = {}

    def run(job):
        name, schema, path, stream = job
        results[name] = (_constrained(url, schema, path, stream), schema, path, stream)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == set(PAVED_SCHEMAS), "a request failed; see the log above"
    problems = []
    for name, ((backend, text, finish), schema, path, stream) in sorted(results.items()):
        where = f"{name} via {path} stream={stream}"
        if backend != "paved":
            problems.append(f"{where}: enforced by {backend}")
        elif finish != "stop":
            problems.append(f"{where}: finish_reason {finish}: {text!r}")
        else:
            try:
                jsonschema.validate(json.loads(text), schema)  # strict json.loads: no NaN, no trailing junk
            except (ValueError, jsonschema.ValidationError) as e:
                problems.append(f"{where}: {e}: {text!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(XGRAMMAR_SCHEMAS))
def test_schemas_outside_paved_use_xgrammar(url, name):
    schema = XGRAMMAR_SCHEMAS[name]
    backend, text, finish = _constrained(url, schema, "/v1/chat/completions", False)
    assert backend == "xgrammar"
    if finish == "stop":  # xgrammar is not budget-aware; when it does finish, it is valid
        jsonschema.validate(json.loads(text), schema)


def test_schema_no_backend_can_enforce_is_400(url):
    body = {
        "model": "tiny",
        "prompt": "JSON:",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": UNENFORCEABLE_SCHEMA},
        },
    }
    assert "not supported" in _error(httpx.post(url + "/v1/completions", json=body), 400)["message"]


def test_json_object_and_structured_outputs(client, url):
    out = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "{"}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert out.headers["x-paved-constraint-backend"] == "paved"
    completion = out.parse()
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)
    out = client.completions.create(
        model="tiny",
        prompt="pick:",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )
    assert out.choices[0].text in ("alpha", "beta")
    out = client.completions.create(
        model="tiny",
        prompt="code:",
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text)


def test_paved_constraint_reaches_the_cpp_processor(client):
    spec = {"type": "choice", "items": ["red", "green", "blue"], "k": 2, "separator": "|", "distinct": True}
    for _ in range(3):
        out = client.completions.create(
            model="tiny",
            prompt="colours:",
            max_tokens=20,
            extra_body={"vllm_xargs": {"paved_constraint": spec}},
        )
        first, second = out.choices[0].text.split("|")
        assert {first, second} <= {"red", "green", "blue"} and first != second
    out = client.completions.create(
        model="tiny",
        prompt="id:",
        max_tokens=20,
        extra_body={
            "vllm_xargs": {"paved_constraint": json.dumps({"type": "regex", "pattern": "[a-f0-9]{6}"})}
        },
    )
    assert re.fullmatch("[a-f0-9]{6}", out.choices[0].text)


def test_tool_calls(client):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": _obj(
                {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1}}
            ),
        },
    }
    clock = {
        "type": "function",
        "function": {"name": "get_time", "parameters": _obj({"tz": {"enum": ["UTC", "CET"]}})},
    }
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[weather, clock],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=1.0,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    out = client.chat.completions.create(
        model="tiny", messages=messages, tools=[weather, clock], tool_choice="required", max_tokens=200
    )
    assert out.choices[0].finish_reason == "tool_calls"
    for call in out.choices[0].message.tool_calls:
        tool = {"get_weather": weather, "get_time": clock}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


# ---- errors -----------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_error_statuses(url):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert _error(httpx.post(url + "/v1/chat/completions", json={**chat, "model": "gpt-9"}), 404)["code"] == (
        "model_not_found"
    )
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}},
    }
    assert (
        "invalid JSON schema"
        in _error(
            httpx.post(url + "/v1/chat/completions", json={**chat, "response_format": bad_schema}), 400
        )["message"]
    )
    too_long = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": "lorem ipsum " * 800}, timeout=30
    )
    error = _error(too_long, 400)
    assert error["code"] == "context_length_exceeded" and f"is {MAX_MODEL_LEN} tokens" in error["message"]
    assert re.search(r"prompt has \d+ tokens|\d+ in the prompt", error["message"])
    big = {**chat, "messages": [{"role": "user", "content": "x" * 2_000_000}]}
    assert (
        _error(httpx.post(url + "/v1/chat/completions", json=big, timeout=30), 413)["code"]
        == "request_too_large"
    )
    assert (
        "not valid JSON"
        in _error(
            httpx.post(
                url + "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
            ),
            400,
        )["message"]
    )
    # The engine rejects what only it can check (a token id outside the vocabulary) as a 400.
    assert (
        "vocabulary"
        in _error(httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [10**9]}), 400)[
            "message"
        ]
    )


def test_queue_full_and_disconnect_free_the_engine(url):
    """A client that hangs up mid-stream frees its engine request (vLLM's own gauges go back
    to 0 long before max_tokens could have been generated); a full queue answers 503."""
    generated_before = metric(url, "vllm:generation_tokens_total", model_name="tiny")
    body = {
        "model": "tiny",
        "prompt": "go",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
        "n": MAX_QUEUED,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as hog:
        lines = hog.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(url, "paved_queued_sequences", model="tiny") == MAX_QUEUED
        full = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert _error(full, 503)["code"] == "overloaded" and full.headers["retry-after"]
    # The with-block closed the connection mid-stream.
    deadline = time.monotonic() + 30
    while metric(url, "vllm:num_requests_running", model_name="tiny") or metric(
        url, "paved_queued_sequences", model="tiny"
    ):
        assert time.monotonic() < deadline, "the engine kept the disconnected request"
        time.sleep(0.2)
    generated = metric(url, "vllm:generation_tokens_total", model_name="tiny") - generated_before
    assert generated < MAX_QUEUED * 900 / 2, f"{generated} tokens: the request ran on after the disconnect"
    assert metric(url, "vllm:num_requests_waiting", model_name="tiny") == 0
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_metrics_merge_frontend_and_every_engine(url):
    text = httpx.get(url + "/metrics").text
    for model in ("tiny", "minilm"):
        assert f'vllm:num_requests_running{{engine="0",model_name="{model}"}}' in text
    assert 'paved_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert 'paved_constrained_requests_total{backend="paved",model="tiny"}' in text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, two label sets


def test_schemathesis_no_server_errors(url):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r:.300} -> {response.text[:300]}")

        check()
    assert not failures, "\n".join(failures[:5])


# ---- last: shutdown ----------------------------------------------------------------------------
def test_sigterm_drains_in_flight_requests(server, url):
    body = {"model": "tiny", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(lines)
        server.proc.send_signal(signal.SIGTERM)
        events = [line for line in lines if line]
    finish = [
        c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]
    ]
    assert finish == ["length"] and events[-1] == "data: [DONE]"
    assert server.proc.wait(120) == 0, server.tail()
