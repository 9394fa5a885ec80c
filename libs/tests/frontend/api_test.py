"""The frontend over a scripted fake engine: routing, validation, errors, streaming, load.

Fast (no model): everything the HTTP layer decides is checked here; the real-engine target
(vllm_server_test) checks what only a real engine can show.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
import time

import httpx
import openai
import pytest
from fake_engine import TEXT_SCHEMA, FakeEngine, line_break_json, line_break_reply, line_break_text
from servers import serve_engines, serve_in_thread, sse_data

from paved.frontend import schemas
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# Stand-in for the native subset check: schemas using patternProperties are "outside paved".
OUTSIDE_PAVED = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}


@pytest.fixture(autouse=True)
def paved_subset(monkeypatch):
    from paved.constraints import spec

    monkeypatch.setattr(
        spec,
        "json_schema_unsupported_reason",
        lambda schema: "patternProperties" if "patternProperties" in json.dumps(schema) else None,
    )


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "fake server never became ready"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine):
    registry = ModelRegistry([engine], {"fake": 8})
    with serve_in_thread(create_app(registry, max_body_bytes=64 * 1024)) as url:
        _wait_ready(url)
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def post(server: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server + path, json=body, timeout=10, **kwargs)
    return httpx.post(
        server + path, content=body, timeout=10, headers={"content-type": "application/json"}, **kwargs
    )


def assert_error(response: httpx.Response, status: int, fragment: str = "", param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param, error
    return error


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


# ---- models, health, metrics ------------------------------------------------------------------
def test_models(client, server):
    ids = {m.id for m in client.models.list().data}
    assert ids == {"fake", "fake-embed"}
    assert client.models.retrieve("fake").id == "fake"
    assert_error(httpx.get(server + "/v1/models/nope"), 404, "does not exist", "model")


def test_health_and_metrics(server, client):
    assert httpx.get(server + "/health/live").status_code == 200
    assert httpx.get(server + "/health/ready").json()["status"] == "ready"
    client.chat.completions.create(**CHAT)
    text = httpx.get(server + "/metrics").text
    assert 'paved_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert 'fake_engine_active_requests{model_name="fake"}' in text
    assert 'paved_queued_sequences{model="fake"} 0.0' in text
    httpx.get(server + "/no/such/path/" + "x" * 50)
    assert 'route="other"' in httpx.get(server + "/metrics").text  # unknown paths share one label


def test_not_ready_while_loading():
    gate = threading.Event()

    class Slow(FakeEngine):
        async def start(self):
            import asyncio

            while not gate.is_set():
                await asyncio.sleep(0.01)
            await super().start()

    with serve_in_thread(create_app(ModelRegistry([Slow()]))) as url:
        assert httpx.get(url + "/health/live").status_code == 200
        assert httpx.get(url + "/health/ready").status_code == 503
        response = post(url, "/v1/chat/completions", CHAT)
        assert_error(response, 503, "loading")
        assert response.headers["retry-after"]
        gate.set()
        _wait_ready(url)


# ---- chat -------------------------------------------------------------------------------------
def test_chat(client, engine):
    out = client.chat.completions.create(
        **CHAT, max_completion_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop=["x"], user="u1"
    )
    assert out.choices[0].message.content == "w0 w1"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    sent = engine.requests[-1].sampling
    assert (sent.max_tokens, sent.temperature, sent.top_p, sent.seed, list(sent.stop)) == (
        5,
        0.5,
        0.9,
        7,
        ["x"],
    )
    assert engine.requests[-1].prompt.messages == [{"role": "user", "content": "hi"}]


def test_continue_final_message_reaches_the_engine(client, engine):
    """vLLM's extension: the final assistant message is continued, not followed by a new turn."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    client.chat.completions.create(
        model="fake",
        messages=messages,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    prompt = engine.requests[-1].prompt
    assert prompt.messages == messages
    assert (prompt.continue_final_message, prompt.add_generation_prompt) == (True, False)
    client.chat.completions.create(model="fake", messages=messages, max_tokens=2)
    prompt = engine.requests[-1].prompt
    assert (prompt.continue_final_message, prompt.add_generation_prompt) == (False, True)


def test_chat_stream_chunks_match_schema(server):
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [schemas.ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    assert text == {0: "w0 w1 w2 w3 w4 w5 w6 w7", 1: "w0 w1 w2 w3 w4 w5 w6 w7"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * 23


def test_every_sse_event_is_one_line_whatever_the_text_holds():
    """Structured answers with U+2028, U+2029 and U+0085 inside their strings, and plain text
    with every other line break: each `data:` line parses, and the text comes back whole."""
    count = 40
    with serve_engines(FakeEngine(reply=line_break_reply)) as url:

        async def one(client, i: int) -> None:
            structured = {
                "model": "fake",
                "messages": [{"role": "user", "content": f"json {i}"}],
                "max_tokens": 120,
                "stream": True,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": TEXT_SCHEMA},
                },
            }
            _, events = await sse_data(client, "/v1/chat/completions", structured)
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            assert json.loads(text) == json.loads(line_break_json(i))
            assert any(ch in text for ch in "\x85\u2028\u2029")
            plain = {"model": "fake", "prompt": f"text {i}", "max_tokens": 60, "stream": True}
            _, events = await sse_data(client, "/v1/completions", plain)
            assert "".join(c["text"] for e in events for c in e["choices"]) == line_break_text(i)

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                await asyncio.gather(*(one(client, i) for i in range(count)))

        asyncio.run(main())


def test_chat_openai_streaming(client):
    stream = client.chat.completions.create(**CHAT, stream=True, max_tokens=4)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == "w0 w"


def test_developer_role_and_text_parts(client, engine):
    client.chat.completions.create(
        model="fake",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    )
    assert engine.requests[-1].prompt.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


# ---- validation: every bad input is a 400 with an OpenAI error body -----------------------------
@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (b"[1, 2]", "JSON object", None),
        ({"model": "fake"}, "messages", "messages"),
        ({**CHAT, "messages": []}, "messages", "messages"),
        ({**CHAT, "temperature": 3}, "temperature", "temperature"),
        ({**CHAT, "n": 0}, "n", "n"),
        ({**CHAT, "top_logprobs": 3}, "requires logprobs", "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({**CHAT, "frobnicate": 1}, "unrecognized request argument supplied: frobnicate", "frobnicate"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "only allowed when stream", "stream_options"),
        ({**CHAT, "stream": "yes"}, "valid boolean", "stream"),
        ({**CHAT, "stream": 1}, "valid boolean", "stream"),
        ({**CHAT, "logprobs": "true"}, "valid boolean", "logprobs"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "valid boolean", None),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "",
            None,
        ),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "role", None),
        ({**CHAT, "logit_bias": {"abc": 1}}, "token ids", "logit_bias"),
        ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "disagree", "max_completion_tokens"),
        ({**CHAT, "store": True}, "store", "store"),
        ({**CHAT, "seed": 2**64}, "seed", "seed"),
        ({**CHAT, "stop": ["a"] * 17}, "stop", "stop"),
        ({**CHAT, "response_format": {"type": "yaml"}}, "response_format", None),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "json_schema", None),
        ({**CHAT, "continue_final_message": True}, "add_generation_prompt: false", "add_generation_prompt"),
        (
            {**CHAT, "continue_final_message": True, "add_generation_prompt": False},
            "last message to be the assistant's",
            "messages",
        ),
        # Union members' labels (`stop.str`, `messages.0.content.str`, a tagged union's tag)
        # are not the client's field paths.
        ({**CHAT, "stop": 5}, "stop", "stop"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "content", "messages.0.content"),
        (
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "name",
            "response_format.json_schema.name",
        ),
        (
            {**CHAT, "tool_choice": {"type": "function", "function": {}}},
            "",
            "tool_choice",
        ),
        ({**CHAT, "continue_final_message": "yes"}, "valid boolean", "continue_final_message"),
    ],
)
def test_invalid_chat_requests(server, body, fragment, param):
    error = assert_error(post(server, "/v1/chat/completions", body), 400, fragment)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_unknown_model(server):
    assert_error(
        post(server, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404, "does not exist", "model"
    )
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404)
    assert_error(post(server, "/v1/embeddings", {"model": "nope", "input": "x"}), 404)


def test_wrong_kind_of_model(server):
    assert_error(
        post(server, "/v1/chat/completions", {**CHAT, "model": "fake-embed"}), 400, "embedding model"
    )
    assert_error(
        post(server, "/v1/embeddings", {"model": "fake", "input": "x"}), 400, "not an embedding model"
    )


def test_engine_errors_map_to_status(server, engine):
    from paved.engine.protocol import EngineUnavailableError, InvalidRequestError

    try:
        engine.admission_error = InvalidRequestError("bad thing", param="prompt")
        assert_error(post(server, "/v1/chat/completions", CHAT), 400, "bad thing", "prompt")
        engine.admission_error = EngineUnavailableError("engine has stopped")
        response = post(server, "/v1/chat/completions", CHAT)
        assert_error(response, 503, "stopped")
        assert "retry-after" in response.headers
    finally:
        engine.admission_error = None


def test_prompt_too_long_reports_token_counts(server):
    response = post(server, "/v1/completions", {"model": "fake", "prompt": "x" * 250, "max_tokens": 10})
    error = assert_error(response, 400, "maximum context length is 256 tokens", "prompt")
    assert "260 tokens were requested (250 in the prompt, 10 for the completion)" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_method_not_allowed_is_openai_shaped(server):
    assert_error(httpx.get(server + "/v1/chat/completions"), 405)


# ---- structured outputs -------------------------------------------------------------------------
def _sent_constraint(engine):
    return engine.requests[-1].sampling.constraint


def test_json_schema_in_subset_goes_to_paved(server, engine):
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers["x-paved-constraint-backend"] == "paved"
    constraint = _sent_constraint(engine)
    assert (constraint.backend, constraint.kind) == ("paved", "paved")
    assert constraint.value == {"type": "json_schema", "schema": SCHEMA, "whitespace": "compact"}


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_with_a_schema_is_constrained_by_it(server, engine, stream):
    """Together's convention (instructor's Mode.JSON_SCHEMA): the schema inside json_object
    is enforced, neither refused nor dropped for a generic object."""
    body = {**CHAT, "stream": stream, "response_format": {"type": "json_object", "schema": SCHEMA}}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=10) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200, lines
    assert response.headers["x-paved-constraint-backend"] == "paved"
    spec = _sent_constraint(engine).value
    assert spec == {"type": "json_schema", "schema": SCHEMA, "whitespace": "compact"}
    if stream:
        chunks = [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]
        text = "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])
    else:
        text = json.loads(lines[0])["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    ("schema", "fragment", "param"),
    [
        ({"properties": {"a": {"type": 3}}}, "invalid JSON schema", "response_format.schema"),
        ("not an object", "valid dictionary", "response_format.schema"),
    ],
)
def test_json_object_with_an_invalid_schema_is_400_naming_it(server, schema, fragment, param):
    body = {**CHAT, "response_format": {"type": "json_object", "schema": schema}}
    assert_error(post(server, "/v1/chat/completions", body), 400, fragment, param=param)


def test_json_schema_outside_subset_goes_to_xgrammar(server, engine):
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OUTSIDE_PAVED}},
    }
    response = post(server, "/v1/chat/completions", body)
    assert response.headers["x-paved-constraint-backend"] == "xgrammar"
    assert _sent_constraint(engine).kind == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_on_completions_too(server, engine, stream):
    body = {"model": "fake", "prompt": "p", "stream": stream, "response_format": {"type": "json_object"}}
    with httpx.stream("POST", server + "/v1/completions", json=body) as response:
        response.read()
    assert response.status_code == 200
    assert response.headers["x-paved-constraint-backend"] == "paved"
    assert _sent_constraint(engine).value["schema"] == {"type": "object"}


def test_structured_outputs_extension(server, engine):
    for field, value, kind in (
        ("regex", "[a-z]+", "regex"),
        ("choice", ["yes", "no"], "choice"),
        ("grammar", 'root ::= "a"', "grammar"),
    ):
        response = post(
            server, "/v1/completions", {"model": "fake", "prompt": "p", "structured_outputs": {field: value}}
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-paved-constraint-backend"] == "xgrammar"
        assert (_sent_constraint(engine).kind, _sent_constraint(engine).value) == (kind, value)
    response = post(
        server, "/v1/completions", {"model": "fake", "prompt": "p", "structured_outputs": {"json": SCHEMA}}
    )
    assert response.headers["x-paved-constraint-backend"] == "paved"


def test_paved_constraint_via_vllm_xargs(server, engine):
    spec = {"type": "choice", "items": ["red", "green"], "k": 2, "separator": "|", "distinct": True}
    for value in (spec, json.dumps(spec)):
        body = {"model": "fake", "prompt": "p", "vllm_xargs": {"paved_constraint": value}}
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        assert _sent_constraint(engine).value == spec


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "invalid JSON schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"minLength": -1}},
                }
            },
            "invalid JSON schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad name!", "schema": SCHEMA},
                }
            },
            "name",
        ),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "send only one"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"structural_tag": "x"}}, "unrecognized"),
        ({"vllm_xargs": {"other_plugin": 1}}, "not supported"),
        ({"vllm_xargs": {"paved_constraint": {"type": "nope"}}}, "invalid paved_constraint"),
        ({"vllm_xargs": {"paved_constraint": "{"}}, "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_constraints_that_cannot_be_honoured_are_400(server, engine, extra, fragment):
    before = len(engine.requests)
    assert_error(post(server, "/v1/chat/completions", {**CHAT, **extra}), 400, fragment)
    assert len(engine.requests) == before  # nothing reached the engine


def test_no_backend_no_constraint():
    engine = FakeEngine(backends=("xgrammar",))
    with serve_in_thread(create_app(ModelRegistry([engine]))) as url:
        _wait_ready(url)
        body = {
            "model": "fake",
            "prompt": "p",
            "vllm_xargs": {"paved_constraint": {"type": "regex", "pattern": "a"}},
        }
        assert_error(post(url, "/v1/completions", body), 400, "not enabled")
        body = {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        }
        assert post(url, "/v1/chat/completions", body).headers["x-paved-constraint-backend"] == "xgrammar"


# ---- tools ------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _tool_server(reply: str):
    engine = FakeEngine(reply=lambda _: reply)
    return engine, serve_in_thread(create_app(ModelRegistry([engine])))


def test_named_tool_choice():
    engine, ctx = _tool_server('{"city":"Oslo"}')
    with ctx as url:
        _wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            **CHAT,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        (call,) = out.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert call.id.startswith("call_") and out.choices[0].finish_reason == "stop"
        assert engine.requests[-1].sampling.constraint.value["schema"] == WEATHER["function"]["parameters"]
        assert engine.requests[-1].prompt.tools[0]["function"]["name"] == "get_weather"
        stream = client.chat.completions.create(
            **CHAT,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
        arguments, names = "", set()
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or []:
                arguments += delta.function.arguments or ""
                names.add(delta.function.name)
        assert json.loads(arguments) == {"city": "Oslo"} and "get_weather" in names


def test_required_tool_choice():
    engine, ctx = _tool_server(
        '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome"}}]'
    )
    with ctx as url:
        _wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            **CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150
        )
        calls = out.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time", "get_weather"]
        assert json.loads(calls[1].function.arguments) == {"city": "Rome"}
        assert out.choices[0].finish_reason == "tool_calls"
        schema = engine.requests[-1].sampling.constraint.value["schema"]
        assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
        client.chat.completions.create(
            **CHAT, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=150
        )
        assert engine.requests[-1].sampling.constraint.value["schema"]["maxItems"] == 1
        stream = client.chat.completions.create(
            **CHAT, tools=[WEATHER, TIME], tool_choice="required", stream=True, max_tokens=150
        )
        deltas = [d for chunk in stream if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas] == ["get_time", "get_weather"]
        # Logprobs asked for with a stream of required calls come with the one delta (they
        # were dropped: null), as without a stream.
        streamed = client.chat.completions.create(
            **CHAT, tools=[WEATHER, TIME], tool_choice="required", stream=True, max_tokens=150, logprobs=True
        )
        chunks = [c for c in streamed if c.choices and c.choices[0].finish_reason]
        whole = client.chat.completions.create(
            **CHAT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, logprobs=True
        )
        assert chunks[0].choices[0].logprobs is not None
        assert [t.token for t in chunks[0].choices[0].logprobs.content] == [
            t.token for t in whole.choices[0].logprobs.content
        ]


def test_required_tool_choice_resolves_each_tools_local_refs():
    """Tools whose parameters use `definitions` (pydantic v1, zod-to-json-schema), `$defs`
    (the same name meaning different things) or a root `#` ref: each ref still points into its
    own tool once the tools are combined into one array schema."""
    import jsonschema

    move = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "definitions": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}},
                "properties": {"to": {"$ref": "#/definitions/Loc"}},
                "required": ["to"],
            },
        },
    }
    wait = {
        "type": "function",
        "function": {
            "name": "wait",
            "parameters": {
                "type": "object",
                "$defs": {"Loc": {"type": "integer"}},
                "properties": {"default": {"$ref": "#/$defs/Loc"}},
                "required": ["default"],
            },
        },
    }
    engine, ctx = _tool_server('[{"name":"move","parameters":{"to":{"city":"Oslo"}}}]')
    with ctx as url:
        _wait_ready(url)
        body = {**CHAT, "tools": [move, wait], "tool_choice": "required", "max_tokens": 150}
        response = post(url, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        (call,) = response.json()["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"to": {"city": "Oslo"}}
        schema = engine.requests[-1].sampling.constraint.value["schema"]
        named = {"type": "function", "function": {"name": "move"}}
        response = post(url, "/v1/chat/completions", {**body, "tools": [move], "tool_choice": named})
        assert response.status_code == 200, response.text
        (call,) = response.json()["choices"][0]["message"]["tool_calls"]
        assert isinstance(json.loads(call["function"]["arguments"])["to"], dict)
    jsonschema.validate(
        [
            {"name": "move", "parameters": {"to": {"city": "Oslo"}}},
            {"name": "wait", "parameters": {"default": 3}},
        ],
        schema,
    )
    for bad in (
        [{"name": "move", "parameters": {"to": 3}}],
        [{"name": "wait", "parameters": {"default": "x"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tools": [WEATHER]}, "tool_choice 'auto'"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice 'auto'"),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                "tool_choice": "required",
            },
            "invalid JSON schema",
        ),
    ],
)
def test_tool_requests_that_cannot_be_honoured(server, extra, fragment):
    assert_error(post(server, "/v1/chat/completions", {**CHAT, **extra}), 400, fragment)


def test_tool_choice_none_generates_text(client):
    out = client.chat.completions.create(**CHAT, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert out.choices[0].message.content == "w0" and not out.choices[0].message.tool_calls


# ---- completions ------------------------------------------------------------------------------
def test_completion_prompt_shapes(client, engine):
    out = client.completions.create(model="fake", prompt=["ab", "cd"], n=2, max_tokens=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.text == "w0" for c in out.choices)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 8
    client.completions.create(model="fake", prompt=[1, 2, 3], max_tokens=1)
    assert list(engine.requests[-1].prompt.token_ids) == [1, 2, 3]
    client.completions.create(model="fake", prompt=[[1], [2, 3]], max_tokens=1)


def test_completion_stream_multi_prompt(server):
    body = {
        "model": "fake",
        "prompt": ["ab", "cd"],
        "n": 2,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server + "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-2]:
        for choice in schemas.Completion.model_validate_json(event).choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: "w0 " for i in range(4)}
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 12


def test_echo_prefill_only_scores_prompt(client, engine):
    out = client.completions.create(model="fake", prompt="abc", max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == "abc"
    assert choice.logprobs.tokens == ["a", "b", "c"]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1] == -(ord("b") % 7)
    assert choice.logprobs.text_offset == [0, 1, 2]
    assert out.usage.completion_tokens == 0
    assert engine.requests[-1].sampling.max_tokens == 0 and engine.requests[-1].sampling.prompt_logprobs == 1


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"max_tokens": 0}, "only meaningful with echo"),
        ({"max_tokens": 0, "echo": True, "stream": True}, "cannot be streamed"),
        ({"suffix": "x"}, "suffix is not supported"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_completion_requests(server, extra, fragment):
    assert_error(post(server, "/v1/completions", {"model": "fake", "prompt": "x", **extra}), 400, fragment)


def test_every_body_is_held_to_one_nesting_bound(server):
    """A small body nested deeper than 128 levels is the 400 a large one gets (FastAPI's own
    parse, used below 1 MiB, took about 980 levels)."""
    schema = '{"a":' * 200 + "1" + "}" * 200
    body = (
        '{"model":"fake","messages":[{"role":"user","content":"x"}],'
        '"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":' + schema + "}}}"
    )
    r = httpx.post(
        server + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert_error(r, 400, "nested more than 128 levels")


def test_many_bad_items_are_one_error_at_the_first():
    """Validated in-process (the server's body bound is small): 300,000 bad prompt items, or
    messages, are one error naming the first bad index (pydantic alone built one error per item
    and union branch: seconds of CPU with the GIL held for a 1 MB body); a logit_bias naming
    more tokens than the bound is refused before its entries are checked."""
    import pydantic

    from paved.frontend import schemas

    cases = [
        (schemas.CompletionRequest, {"prompt": [1, *(["x"] * 300_000)]}, "prompt[1] must be a token id"),
        (
            schemas.CompletionRequest,
            {"prompt": ["a", *([""] * 300_000)]},
            "prompt[1] must be a non-empty string",
        ),
        (
            schemas.CompletionRequest,
            {"prompt": [[1], [2, -3]]},
            "prompt[1] must be a non-empty list of token ids",
        ),
        (schemas.CompletionRequest, {"prompt": [-1] * 300_000}, "prompt[0] must be"),
        (schemas.EmbeddingRequest, {"input": [0.5] * 300_000}, "input[0] must be"),
        (schemas.ChatCompletionRequest, {"messages": [1] * 100_000}, "messages[0] must be a JSON object"),
        (
            schemas.CompletionRequest,
            {"prompt": "x", "logit_bias": {str(i): 1 for i in range(schemas.MAX_LOGIT_BIAS + 1)}},
            f"at most {schemas.MAX_LOGIT_BIAS} tokens",
        ),
        (
            schemas.CompletionRequest,
            {"prompt": "x", "logit_bias": {str(i): 999 for i in range(200_000)}},
            "logit_bias['0'] must be a number from -100 to 100",
        ),
        (schemas.CompletionRequest, {"prompt": "x", "logit_bias": {"5": True}}, "must be a number"),
        (schemas.CompletionRequest, {"prompt": [True, 2]}, "prompt[0] must be"),
    ]
    for model, body, needle in cases:
        with pytest.raises(pydantic.ValidationError) as info:
            model.model_validate({"model": "fake", **body})
        assert info.value.error_count() == 1 and needle in str(info.value), (
            body.keys(),
            str(info.value)[:300],
        )
    ok = schemas.CompletionRequest.model_validate({"model": "fake", "prompt": [[1, 2], [3]]})
    assert ok.prompt == [[1, 2], [3]]
    # Integral floats are token ids, as pydantic's lax ints take them (Python clients send 1.0).
    floats = schemas.CompletionRequest.model_validate({"model": "fake", "prompt": [1.0, 2e0]})
    assert floats.prompt == [1, 2]
    nested = schemas.CompletionRequest.model_validate({"model": "fake", "prompt": [[1], [2.0]]})
    assert nested.prompt == [[1], [2]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", 5]}, "prompt"),
    ],
)
def test_completion_400s_name_the_field(server, extra, param):
    """Checks across fields name the one to change; union labels never reach `param`."""
    assert_error(post(server, "/v1/completions", {"model": "fake", "prompt": "x", **extra}), 400, param=param)


# ---- embeddings and rank ----------------------------------------------------------------------
def test_embeddings(client):
    out = client.embeddings.create(model="fake-embed", input=["ab", "abcd"], encoding_format="float")
    assert [d.embedding[0] for d in out.data] == [2.0, 4.0] and out.usage.prompt_tokens == 6
    raw = httpx.post(
        str(client.base_url) + "embeddings",
        json={"model": "fake-embed", "input": "abc", "encoding_format": "base64"},
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack("<3f", packed)) == [3.0, 0.5, -0.25]


def test_rank_orders_by_loglikelihood(server, engine):
    response = post(server, "/v1/rank", {"model": "fake", "context": "ctx", "candidates": ["a", "bb", "g"]})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert data == sorted(data, key=lambda d: d["logprob"], reverse=True)
    assert sorted(d["text"] for d in data) == ["a", "bb", "g"]
    sent = engine.requests[-3:]
    assert all(r.sampling.max_tokens == 0 and r.sampling.prompt_logprobs == 0 for r in sent)
    assert_error(
        post(server, "/v1/rank", {"model": "fake", "context": "c", "candidates": []}), 400, "candidates"
    )


def test_rank_refuses_what_cannot_fit_before_building_prompts(server, engine):
    """A context (or context + candidate) past max_model_len is a 400 naming the field, refused
    before any engine request: each candidate's prompt would copy the whole context."""
    before = len(engine.requests)
    body = {"model": "fake", "context": "x" * 300, "candidates": ["a"] * 256}
    error = assert_error(post(server, "/v1/rank", body), 400, "maximum context length is 256", "context")
    assert error["code"] == "context_length_exceeded"
    body = {"model": "fake", "context": "x" * 200, "candidates": ["a", "b" * 100]}
    error = assert_error(post(server, "/v1/rank", body), 400, "maximum context length is 256", "candidates")
    assert error["code"] == "context_length_exceeded"
    assert len(engine.requests) == before
    too_long = {"model": "fake", "context": "x" * (schemas.MAX_RANK_CONTEXT_CHARS + 1), "candidates": ["a"]}
    with pytest.raises(ValueError, match="at most"):
        schemas.RankRequest.model_validate(too_long)


# ---- load: body limit, admission, disconnects -----------------------------------------------------
def test_oversized_body_is_413(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    error = assert_error(post(server, "/v1/chat/completions", big), 413, "larger than")
    assert error["code"] == "request_too_large"

    def chunked():
        for _ in range(100):
            yield b" " * 1024

    assert_error(httpx.post(server + "/v1/chat/completions", content=chunked(), timeout=10), 413)


def test_queue_full_is_503_with_retry_after(server, engine):
    engine.step_delay_s = 0.05
    try:
        with httpx.stream(
            "POST", server + "/v1/chat/completions", json={**CHAT, "n": 8, "stream": True}
        ) as hog:
            lines = hog.iter_lines()  # kept referenced: dropping the iterator closes the stream
            next(lines)
            response = post(server, "/v1/chat/completions", CHAT)
            assert_error(response, 503, "capacity")
            assert response.headers["retry-after"] == "1"
            assert (
                'paved_requests_rejected_total{model="fake",reason="queue_full"}'
                in httpx.get(server + "/metrics").text
            )
        assert_error(post(server, "/v1/chat/completions", {**CHAT, "n": 9}), 400, "more than model")
    finally:
        engine.step_delay_s = 0.0
    deadline = time.monotonic() + 5
    while 'paved_queued_sequences{model="fake"} 0.0' not in httpx.get(server + "/metrics").text:
        assert time.monotonic() < deadline, "admission was not released"
        time.sleep(0.02)


def test_every_overloaded_503_is_counted_as_push_back(server, engine):
    """The engine's own full queue (not only the frontend's admission) is a 503 overloaded
    counted by reason: alerting subtracts these from a version's errors; a 503 unavailable
    (a stopped engine) is an error and is not counted."""
    from paved.engine.protocol import EngineOverloadedError, EngineUnavailableError

    def count(reason: str) -> float:
        for line in httpx.get(server + "/metrics").text.splitlines():
            if line.startswith(f'paved_requests_rejected_total{{model="fake",reason="{reason}"}}'):
                return float(line.split()[-1])
        return 0.0

    before = count("engine_queue_full")
    try:
        engine.admission_error = EngineOverloadedError("the waiting queue is full")
        for _ in range(2):
            response = post(server, "/v1/chat/completions", CHAT)
            assert_error(response, 503, "waiting queue")
            assert response.json()["error"]["code"] == "overloaded" and response.headers["retry-after"] == "1"
        assert count("engine_queue_full") == before + 2
        engine.admission_error = EngineUnavailableError("engine has stopped")
        assert_error(post(server, "/v1/chat/completions", CHAT), 503, "stopped")
        assert count("engine_queue_full") == before + 2
    finally:
        engine.admission_error = None


@pytest.mark.parametrize(
    ("route", "stream"),
    [
        ("/v1/chat/completions", True),
        ("/v1/chat/completions", False),
        # Its prompts are gathered: a cancelled gather ends with a CancelledError exception
        # rather than cancelled, which once escaped as "Exception in ASGI application".
        ("/v1/completions", False),
        # Drains its internal chat stream: watched for the disconnect like chat itself.
        ("/v1/responses", False),
        ("/v1/responses", True),
    ],
)
def test_client_disconnect_aborts_engine_request(server, engine, route, stream):
    engine.step_delay_s = 0.05
    try:
        request_body = {
            "/v1/chat/completions": {**CHAT, "max_tokens": 40},
            "/v1/completions": {"model": "fake", "prompt": ["a", "b"], "max_tokens": 40},
            "/v1/responses": {"model": "fake", "input": "hi", "max_output_tokens": 40},
        }[route]
        body = {**request_body, "stream": stream}
        before = set(engine.aborted)

        def request():
            try:
                with httpx.stream("POST", server + route, json=body, timeout=0.3) as response:
                    for _ in response.iter_lines():
                        break
            except httpx.ReadTimeout:
                pass  # the non-streaming client gives up before the answer

        thread = threading.Thread(target=request)
        thread.start()
        thread.join()
        deadline = time.monotonic() + 5
        while set(engine.aborted) == before:
            assert time.monotonic() < deadline, "engine request was not aborted"
            time.sleep(0.02)
        assert not engine.active
        metrics = httpx.get(server + "/metrics").text
        assert 'status="500"' not in metrics  # a disconnect is not a server error
        if not stream:
            assert f'route="{route}",status="499"' in metrics
    finally:
        engine.step_delay_s = 0.0


def test_draining_refuses_new_work(engine):
    registry = ModelRegistry([FakeEngine()])
    with serve_in_thread(create_app(registry)) as url:
        _wait_ready(url)
        registry.draining = True
        assert httpx.get(url + "/health/ready").json()["status"] == "draining"
        assert_error(post(url, "/v1/chat/completions", CHAT), 503, "shutting down")


# ---- schemathesis: whatever the OpenAPI document allows, never a 5xx ------------------------------
def test_schemathesis_no_server_errors(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    failures = []
    for operation in operations:

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=server, timeout=10)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}")
            elif response.status_code >= 400 and case.path != "/metrics":
                assert "error" in response.json(), response.text

        check()
    assert not failures, "\n".join(failures[:5])
