"""The gateway in front of two real paved frontends running vLLM (the tiny model fixture; one
also serves all-MiniLM-L6-v2 embeddings and the XGBoost fixture on KServe): the official
`openai` client and `tritonclient` through the gateway with one key, structured outputs,
prompt tokens counted with the model's own tokenizer, prefix affinity, a disconnect that
returns vLLM's running count to 0, and a Files + Batches batch and /v1/responses (plain,
streamed, background) whose json_schema answers all validate. The module's gateway serves the
batch and Responses APIs with their defaults (state and files beside its SQLite file, events in
the database), so they share the module's two engines."""

from __future__ import annotations

import json
import secrets
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess, minilm_model_toml, tiny_model_toml, write_config
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import llm_inputs, xgb_model_dir
from paved.runfiles import tiny_model_dir

XGB = "xgb_scorer"


def _config(path: str, embed: bool) -> str:
    return write_config(path, tiny_model_toml(max_model_len=1024), *([minilm_model_toml()] if embed else []))


def _metric(url: str, name: str, label: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-gw")
    tiny = tiny_model_dir()
    kserve = ["--kserve-grpc-port", "0", "--kserve-http-port", "0"]
    a = ServerProcess(
        "--config", _config(str(tmp / "a.toml"), True), *kserve, "--kserve-model-dir", xgb_model_dir()
    )
    b = None
    gw = None
    try:
        b = ServerProcess("--config", _config(str(tmp / "b.toml"), False), *kserve)
        backends = [
            {
                "url": s.url,
                "version": "v1",
                "kserve_grpc": f"127.0.0.1:{s.kserve_grpc_port}",
                "kserve_http": f"http://127.0.0.1:{s.kserve_http_port}",
            }
            for s in (a, b)
        ]
        routes = write_routes(
            tmp / "routes.json",
            [
                {"alias": "tiny", "strategy": "prefix_affinity", "tokenizer": tiny, "backends": backends},
                {
                    "alias": "minilm",
                    "kind": "embed",
                    "backends": [{"id": "a-embed", "url": a.url, "version": "v1"}],
                },
                {"alias": XGB, "kind": "kserve", "backends": [backends[0]]},
            ],
        )
        gw = GatewayProcess(
            routes, "--kserve-grpc-port", "0", admin_key="adm-" + secrets.token_hex(16), state_dir=tmp
        )
        gw.tenant("team", models=["tiny", "minilm", XGB])
        gw.api_key = gw.key("team")  # type: ignore[attr-defined]
        yield a, b, gw
    finally:
        if gw is not None:
            gw.stop()
        for s in (a, b):
            if s is not None:
                s.terminate()


@pytest.fixture(scope="module")
def client(fleet):
    _, _, gw = fleet
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.api_key, max_retries=0, timeout=120)


def test_chat_streaming_and_structured_outputs(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [chat.usage.completion_tokens]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for stream in (False, True):
        kwargs = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "a person"}],
            "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        }
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices
            )
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_embeddings_are_served_through_the_gateway(client):
    out = client.embeddings.create(model="minilm", input=["a cat sat", "a kitten sat", "stock markets fell"])
    a, b, c = (np.array(d.embedding) for d in out.data)
    assert a.shape == (384,)
    assert a @ b > a @ c


def test_prompt_tokens_reserved_with_the_models_tokenizer(fleet):
    _, _, gw = fleet
    gw.tenant("exact", models=["tiny"], limits={"tokens_per_min": 100000})
    key = gw.key("exact")
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": messages, "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    # Reserved = the model's own count + max_tokens: the remaining budget right after admission
    # is what the headers report (before reconciling), so 100000 - (prompt + 4).
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert 100000 - remaining == prompt_tokens + 4, (remaining, prompt_tokens)


def test_prefix_affinity_keeps_a_system_prompt_on_one_backend(fleet):
    _, _, gw = fleet
    backends = set()
    for system in ("You answer about ships. " * 30, "You answer about trains. " * 30):
        seen = set()
        for i in range(6):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {gw.api_key}"},
                json={
                    "model": "tiny",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                    "max_tokens": 2,
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-paved-backend"])
        assert len(seen) == 1, seen
        backends |= seen
    assert backends


def test_tritonclient_scores_xgboost_and_the_llm_with_the_same_key(fleet):
    a, _, gw = fleet
    headers = {"authorization": f"Bearer {gw.api_key}"}
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
    h = httpclient.InferenceServerClient(gw.url.removeprefix("http://"), network_timeout=120)
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{a.kserve_grpc_port}")
    try:
        for module, c in ((grpcclient, g), (httpclient, h)):
            t = module.InferInput("input__0", [3, 32], "FP32")
            t.set_data_from_numpy(x)
            scores = c.infer(XGB, [t], headers=headers).as_numpy("output__0")
            td = grpcclient.InferInput("input__0", [3, 32], "FP32")
            td.set_data_from_numpy(x)
            assert np.array_equal(scores, direct.infer(XGB, [td]).as_numpy("output__0"))
            params = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
            text = c.infer(
                "tiny", llm_inputs(module, "once upon", params=params, exclude=True), headers=headers
            )
            assert text.as_numpy("text_output")[0]
        with pytest.raises(InferenceServerException, match=r"(?i)unauthenticated"):
            t = grpcclient.InferInput("input__0", [3, 32], "FP32")
            t.set_data_from_numpy(x)
            g.infer(XGB, [t], headers={"authorization": "Bearer pvd_aaaaaaaaaaaa_nope"})
    finally:
        g.close()
        h.close()
        direct.close()


def test_a_client_that_leaves_aborts_the_vllm_request(fleet):
    a, b, gw = fleet
    generated = {s.url: _metric(s.url, "vllm:generation_tokens_total", 'model_name="tiny"') for s in (a, b)}
    body = {"model": "tiny", "prompt": "count", "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 4}
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        headers={"Authorization": f"Bearer {gw.api_key}"},
        json=body,
        timeout=120,
    ) as r:
        assert r.status_code == 200
        backend = a if r.headers["x-paved-backend"] == a.url else b
        lines = r.iter_lines()
        # Decoding on the backend (vLLM's gauge is updated per engine step): keep reading.
        running = 0.0
        for _ in range(200):
            next(lines)
            running = _metric(backend.url, "vllm:num_requests_running", 'model_name="tiny"')
            if running == 4:
                break
        assert running == 4
    # The with-block closed the client's connection mid-stream.
    deadline = time.monotonic() + 30
    while _metric(backend.url, "vllm:num_requests_running", 'model_name="tiny"') or _metric(
        backend.url, "paved_queued_sequences", 'model="tiny"'
    ):
        assert time.monotonic() < deadline, "the engine kept the request whose client left"
        time.sleep(0.2)
    ran = _metric(backend.url, "vllm:generation_tokens_total", 'model_name="tiny"') - generated[backend.url]
    assert ran < 4 * 900 / 2, f"{ran} tokens: the request ran on after the client left"


def _schema(tag: str) -> dict:
    """A small, fully bounded schema (a digit, one of two labels, a boolean: about twenty
    tokens) whose labels are unique to `tag`: an answer validates only against its own line's
    schema, so a batch that paired an answer with another line's custom_id fails too."""
    return {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "label": {"enum": [f"{tag}-yes", f"{tag}-no"]},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "label", "ok"],
        "additionalProperties": False,
    }


def _validates(text: str | None, schema: dict) -> None:
    assert text, "no answer text"
    jsonschema.validate(json.loads(text), schema)


def test_a_batch_with_json_schema_answers_through_the_real_model(client):
    """Files + Batches with the official client: every line's answer comes from vLLM under its
    own line's `response_format` json_schema, and every custom_id is in the output once."""
    schemas = {f"line-{i}": _schema(f"t{i}") for i in range(6)}
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"describe item {custom_id}"}],
                "max_tokens": 48,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}},
            },
        }
        for custom_id, schema in schemas.items()
    ]
    uploaded = client.files.create(
        file=("items.jsonl", b"".join(json.dumps(x).encode() + b"\n" for x in lines)), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (6, 6, 0)
    assert batch.error_file_id is None and batch.output_file_id
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines() if x.strip()]
    assert sorted(x["custom_id"] for x in out) == sorted(schemas)
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", line
        _validates(choice["message"]["content"], schemas[line["custom_id"]])


def _json_format(schema: dict) -> dict:
    return {"format": {"type": "json_schema", "name": "item", "schema": schema, "strict": True}}


def test_responses_json_schema_answers_through_the_real_model(client):
    """`text.format` json_schema on /v1/responses reaches vLLM's structured outputs: the plain
    answer, the streamed one (typed events numbered without a gap, the deltas adding up to the
    final text) and a background one polled to completion all validate."""
    schema = _schema("plain")
    plain = client.responses.create(
        model="tiny", input="describe an item", text=_json_format(schema), max_output_tokens=48, temperature=0
    )
    assert plain.status == "completed", plain
    _validates(plain.output_text, schema)

    schema = _schema("streamed")
    events = list(
        client.responses.create(
            model="tiny",
            input="describe another item",
            text=_json_format(schema),
            max_output_tokens=48,
            temperature=0,
            stream=True,
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    _validates(final.output_text, schema)
    assert client.responses.retrieve(final.id).output_text == final.output_text

    schema = _schema("background")
    started = client.responses.create(
        model="tiny",
        input="describe a third item",
        text=_json_format(schema),
        max_output_tokens=48,
        temperature=0,
        background=True,
    )
    assert started.background and started.status in ("queued", "in_progress"), started
    deadline = time.monotonic() + 120
    got = started
    while got.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"background response still {got.status}"
        time.sleep(0.2)
        got = client.responses.retrieve(started.id)
    assert got.status == "completed", got
    _validates(got.output_text, schema)
