"""Admission of bodies and constraints through the HTTP layer, over the simulated engine.

Unicode edge cases are refused with OpenAI errors (never a 500), and a constraint whose check
is slow runs off the event loop: other requests are served while it is being checked.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from fake_engine import FakeEngine
from servers import serve_in_thread

from paved.constraints import spec as specs
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url():
    registry = ModelRegistry([FakeEngine()], {"fake": 64})
    with serve_in_thread(create_app(registry)) as base:
        for _ in range(500):
            if httpx.get(base + "/health/ready").status_code == 200:
                break
            threading.Event().wait(0.02)
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
    for _ in range(3):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-paved-constraint-backend"] == "paved"
        assert r.json()["choices"][0]["message"]["content"].strip('"') in set(values)
    # The route is memoized by the schema's digest: validated at most once for three requests.
    assert len(calls) <= 1
