"""Admission of bodies and constraints through the HTTP layer, over the simulated engine.

Unicode edge cases are refused with OpenAI errors (never a 500), a constraint whose check
is slow runs off the event loop (other requests are served while it is being checked), and a
burst of one spec is served whole, its check run once; only many distinct specs at once are
refused.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import pytest
from fake_engine import MAX_MODEL_LEN, FakeEngine
from servers import serve_engines

from paved.constraints import spec as specs
from paved.frontend import schemas, structured

JSON = {"content-type": "application/json"}
BURST = 300


@pytest.fixture(scope="module")
def url():
    with serve_engines(FakeEngine(), max_queued_sequences={"fake": 64}) as base:
        yield base


@pytest.fixture(scope="module")
def burst_url():
    """The default admission bound (1024 sequences), and an engine that queues 1024."""
    with serve_engines(FakeEngine()) as base:
        yield base


@pytest.mark.parametrize(
    ("path", "raw", "where"),
    [
        (
            "/v1/chat/completions",
            r'{"model":"fake","messages":[{"role":"user","content":"\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            r'{"model":"fake","messages":[{"role":"user","content":"ok"}],"user":"a\udc00"}',
            "user",
        ),
        (
            "/v1/chat/completions",
            r'{"model":"fake","messages":[{"role":"user","content":[{"type":"text","text":"\udbff"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", r'{"model":"fake","prompt":["fine","\ud83d"]}', "prompt.1"),
        ("/v1/completions", r'{"model":"fake","prompt":"x","stop":["\udfff"]}', "stop.0"),
        ("/v1/embeddings", r'{"model":"fake-embed","input":"\ud800x"}', "input"),
        ("/v1/rank", r'{"model":"fake","context":"c","candidates":["\ud800"]}', "candidates.0"),
        (
            "/v1/chat/completions",
            r'{"model":"fake","messages":[{"role":"user","content":"x"}],'
            r'"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"enum":["\ud800"]}}}}',
            "response_format.json_schema.schema.enum.0",
        ),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(url, path, raw, where):
    r = httpx.post(url + path, content=raw.encode(), headers=JSON)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert where in error["message"] and "surrogate" in error["message"]


def test_surrogate_in_a_key_is_400_without_echoing_it(url):
    raw = r'{"model":"fake","messages":[{"role":"user","content":"x"}],"logit_bias":{"\ud800":1}}'
    r = httpx.post(url + "/v1/chat/completions", content=raw.encode(), headers=JSON)
    assert r.status_code == 400
    assert "logit_bias (a key)" in r.json()["error"]["message"]


def test_a_valid_surrogate_pair_nul_and_invalid_utf8(url):
    # An escaped pair is one valid character; NUL is a valid character: both are served.
    for content in (r"\ud83d\ude00", r"a\u0000b"):
        raw = '{"model":"fake","messages":[{"role":"user","content":"' + content + '"}]}'
        r = httpx.post(url + "/v1/chat/completions", content=raw.encode(), headers=JSON)
        assert r.status_code == 200, r.text
    # Bytes that are not UTF-8 at all: the body is not JSON text.
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b'{"model":"fake","messages":[{"role":"user","content":"\xc3\x28"}]}',
        headers=JSON,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError, not a ValueError
ASSISTANT_CALL = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}],
}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "fake", "messages": [{"role": "user", "content": "x"}, ASSISTANT_CALL]},
            "messages.1.tool_calls.0.function.arguments",
        ),
        (
            "/v1/responses",
            {
                "model": "fake",
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
            },
            "input",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "fake",
                "messages": [{"role": "user", "content": "x"}],
                "structured_outputs": {"json": DEEP},
            },
            "structured_outputs.json",
        ),
        (
            "/v1/completions",
            {"model": "fake", "prompt": "x", "vllm_xargs": {"paved_constraint": DEEP}},
            "vllm_xargs.paved_constraint",
        ),
        (
            "/v1/completions",
            {
                "model": "fake",
                "prompt": "x",
                "vllm_xargs": {"paved_constraint": json.dumps({"type": "json_schema", "schema": DEEP})},
            },
            "vllm_xargs.paved_constraint",
        ),
    ],
)
def test_json_text_nested_too_deep_in_a_field_is_400_naming_it(url, path, body, param):
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "nested" in error["message"], error


def test_tool_call_arguments_that_are_not_json_pass_through(url):
    """Text that is not JSON reaches the chat template as text; nesting within the bound is
    parsed into a mapping (what Hugging Face templates index)."""
    for arguments in ("not json {", "[" * 100 + "]" * 100):
        call = {**ASSISTANT_CALL, "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0]}]}
        call["tool_calls"][0]["function"] = {"name": "f", "arguments": arguments}
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}, call], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text


@pytest.fixture
def unicode_walks(monkeypatch):
    """The thread names the request bodies' Unicode walk (part of their validation) ran on."""
    text = schemas.text  # the module the schemas call
    threads: list[str] = []
    real = text.unencodable_path

    def recording(value, path=""):
        threads.append(threading.current_thread().name)
        return real(value, path)

    monkeypatch.setattr(text, "unencodable_path", recording)
    return threads


def test_large_bodies_are_decoded_off_the_event_loop(url, unicode_walks):
    from paved.http.off_loop import OFF_LOOP_BYTES

    big = "x" * (OFF_LOOP_BYTES + 1)
    for path, body in (
        ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": big}]}),
        ("/v1/completions", {"model": "fake", "prompt": big}),
        ("/v1/responses", {"model": "fake", "input": big}),
    ):
        unicode_walks.clear()
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text  # decoded, then refused
        assert unicode_walks and all(name.startswith("paved-body") for name in unicode_walks), unicode_walks
    # Decoded there, a body's errors are the same 400s naming the field.
    body = {"model": "fake", "messages": [{"role": "user", "content": big}], "temperature": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.post(url + "/v1/chat/completions", content=b"[" + b" " * OFF_LOOP_BYTES, headers=JSON)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    unicode_walks.clear()  # small bodies: inline, no thread hop
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200 and unicode_walks and not unicode_walks[0].startswith("paved-body")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "fake", "messages": [{"role": "user", "content": "a"}] * (schemas.MAX_MESSAGES + 1)},
            "messages",
        ),
        ("/v1/completions", {"model": "fake", "prompt": [1] * (schemas.MAX_TOKEN_IDS + 1)}, "prompt"),
        (
            "/v1/completions",
            {"model": "fake", "prompt": [[1], [1] * (schemas.MAX_TOKEN_IDS + 1)]},
            "prompt.1",
        ),
        ("/v1/embeddings", {"model": "fake-embed", "input": [1] * (schemas.MAX_TOKEN_IDS + 1)}, "input"),
    ],
)
def test_lists_past_their_bound_are_refused_before_the_body_is_walked(url, unicode_walks, path, body, param):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "at most" in error["message"], error
    assert unicode_walks == []  # refused on its length, before the O(body) walk


def test_what_cannot_fit_the_context_is_refused_before_the_engine(url):
    """More messages, or more prompt token ids, than max_model_len tokens: a 400 at once."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "a"}] * (MAX_MODEL_LEN + 1)}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert f"{MAX_MODEL_LEN + 1} messages cannot fit" in error["message"]
    r = httpx.post(
        url + "/v1/completions", json={"model": "fake", "prompt": [[1], [1] * (MAX_MODEL_LEN + 1)]}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_a_slow_constraint_check_does_not_hold_the_event_loop(url, monkeypatch):
    """The check of a heavy spec runs on the admission pool: a small request sent while it is
    still being checked is answered, and the heavy one completes after."""
    entered, release = threading.Event(), threading.Event()
    real_admit = specs.admit

    def slow_admit(raw):
        if isinstance(raw, dict) and raw.get("pattern") == "slow|check":
            entered.set()
            assert release.wait(30)
        return real_admit(raw)

    monkeypatch.setattr(specs, "admit", slow_admit)
    heavy = {
        "model": "fake",
        "messages": [{"role": "user", "content": "x"}],
        "vllm_xargs": {"paved_constraint": {"type": "regex", "pattern": "slow|check"}},
    }
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(r=httpx.post(url + "/v1/chat/completions", json=heavy, timeout=60))
    )
    thread.start()
    try:
        assert entered.wait(30), "the heavy request never reached its check"
        # Bounded: were the check on the loop, this request could not be answered at all.
        small = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert small.status_code == 200
        assert "r" not in result  # the heavy one is still being checked
    finally:
        release.set()
        thread.join(60)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["message"]["content"] in ("slow", "check")


def test_big_enum_schema_is_a_catalogue_and_checked_once(url, monkeypatch):
    values = [f"item-{i}" for i in range(20_000)]
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": values}}},
    }
    calls = []
    real = specs.validate_spec
    monkeypatch.setattr(specs, "validate_spec", lambda raw, **kw: calls.append(1) or real(raw, **kw))
    planned_on = []
    real_plan = structured._plan

    def plan(request, card):
        planned_on.append(threading.current_thread().name)
        return real_plan(request, card)

    monkeypatch.setattr(structured, "_plan", plan)
    for _ in range(3):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-paved-constraint-backend"] == "paved"
        assert r.json()["choices"][0]["message"]["content"].strip('"') in set(values)
    # The route is memoized by the schema's digest: validated at most once for three requests.
    assert len(calls) <= 1
    # Its digest is O(size): taken on the admission pool, never on the event loop.
    assert len(planned_on) == 3 and all(name.startswith("paved-admit") for name in planned_on), planned_on


def _schema_body(tag: str) -> dict:
    schema = {
        "title": tag,  # a spec no other test sent: its first check happens here
        "type": "object",
        "properties": {"score": {"type": "integer"}},
        "required": ["score"],
        "additionalProperties": False,
    }
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "rate it"}],
        "max_tokens": 24,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


async def _post_all(url: str, bodies: list[dict]) -> list[asyncio.Task]:
    """One connection per body, all sent at once; the tasks of their responses."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    client = httpx.AsyncClient(base_url=url, limits=limits, timeout=120)
    tasks = [asyncio.ensure_future(client.post("/v1/chat/completions", json=b)) for b in bodies]
    asyncio.gather(*tasks, return_exceptions=True).add_done_callback(
        lambda _: asyncio.ensure_future(client.aclose())
    )
    return tasks


def _burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def main():
        return await asyncio.gather(*await _post_all(url, bodies))

    return asyncio.run(main())


def _assert_served(responses: list[httpx.Response]) -> None:
    refused = [(r.status_code, r.text) for r in responses if r.status_code != 200]
    assert not refused, f"{len(refused)} of {len(responses)} refused, e.g. {refused[0]}"
    for r in responses:
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["score"], int)


def test_a_burst_of_one_schema_is_served_and_checked_once(burst_url, monkeypatch):
    """300 concurrent requests with one new schema: the first one's check is held until all
    300 have arrived, so the other 299 wait for it; all are served and it ran once. A second
    burst finds it memoized."""
    arrived, everyone_in = 0, threading.Event()
    real_resolve = structured.resolve_async

    async def counting(request, card):
        nonlocal arrived
        arrived += 1  # on the event loop: no lock needed
        if arrived == BURST:
            everyone_in.set()
        return await real_resolve(request, card)

    checks = []
    real_route = structured._route_json

    def held(*args):
        checks.append(args)
        everyone_in.wait(60)  # bounded: the assertions below say what happened
        return real_route(*args)

    monkeypatch.setattr(structured, "resolve_async", counting)
    monkeypatch.setattr(structured, "_route_json", held)
    body = _schema_body(f"burst-{uuid.uuid4()}")

    _assert_served(_burst(burst_url, [body] * BURST))
    assert everyone_in.is_set(), f"only {arrived} requests arrived"
    assert len(checks) == 1

    _assert_served(_burst(burst_url, [body] * BURST))  # warm: one digest each
    assert len(checks) == 1


def test_distinct_specs_past_the_bound_are_refused_with_retry_after(burst_url, monkeypatch):
    """MAX_CHECKS distinct specs being checked at once hold the bound: a further new spec is
    a 503 with Retry-After naming the limit; the ones admitted are served once released."""
    bound, extra = 4, 3
    monkeypatch.setattr(structured, "MAX_CHECKS", bound)
    release = threading.Event()
    real_route = structured._route_json

    def held(*args):
        release.wait(60)
        return real_route(*args)

    monkeypatch.setattr(structured, "_route_json", held)
    bodies = [_schema_body(f"distinct-{uuid.uuid4()}") for _ in range(bound + extra)]

    async def main():
        tasks = await _post_all(burst_url, bodies)
        try:
            pending, first = set(tasks), []
            while len(first) < extra and pending:
                done, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
                first.extend(t.result() for t in done)
        finally:
            release.set()
        return first, await asyncio.gather(*tasks)

    def refused() -> float:  # push-back the alerting subtracts from a version's errors
        text = httpx.get(burst_url + "/metrics", timeout=10).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("paved_requests_rejected_total{") and 'reason="constraint_checks"' in line
        )

    before = refused()
    first, responses = asyncio.run(main())
    assert refused() == before + extra
    assert len(first) == extra, "the requests past the bound were not answered while the others waited"
    for r in first:
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "overloaded"
        assert f"{bound} distinct output constraints are already being checked" in error["message"]
    assert sorted(r.status_code for r in responses) == [200] * bound + [503] * extra


def test_a_request_larger_than_admission_names_the_field_that_sizes_it(url):
    """More sequences in one request than the model admits at once (64 here): a 400 naming
    what the client would lower (`n`, or the prompt list), not always `n`."""
    prompts = httpx.post(
        url + "/v1/completions", json={"model": "fake", "prompt": ["x"] * 65, "max_tokens": 1}, timeout=30
    )
    assert prompts.status_code == 400 and prompts.json()["error"]["param"] == "prompt", prompts.text
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "n": 65},
        timeout=30,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "n", chat.text
    assert "admits at once (64)" in chat.json()["error"]["message"]
