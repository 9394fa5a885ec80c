"""The orchestration layer's request path over a paved frontend on the simulated engine (which
counts prompts with the tiny model's real tokenizer and reports max_model_len like vLLM):
extension-field validation, conversations fitted to a context learnt from the backend, the
exact cache's keys, opt-in and bypass rules, streaming capture and replay, and experiment arms.
The same capabilities against real vLLM and MiniLM: orchestration_vllm_test."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading

import httpx
import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.gateway.forwarding import proxy
from paved.runfiles import tiny_model_dir

MAX_MODEL_LEN = 320


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orch-sim")
    sim = f"sim://tiny?tokens_per_s=2000&max_num_seqs=64&max_model_len={MAX_MODEL_LEN}&tokenizer={tiny_model_dir()}"
    server = ServerProcess("--engine", sim, ready_timeout_s=120)
    gateway = None
    try:
        one = [{"url": server.url, "version": "v1"}]
        routes = write_routes(
            tmp / "routes.json",
            [
                {"alias": "tiny", "tokenizer": tiny_model_dir(), "cache": {"exact": True}, "backends": one},
                # No max_model_len on the route: learnt from the backend's /v1/models.
                {"alias": "conv", "tokenizer": tiny_model_dir(), "summarizer": "tiny", "backends": [
                    {"id": "conv", "url": server.url, "version": "v1", "upstream_model": "tiny"}]},
                # Two versions and nothing choosing one: the cache cannot know the version.
                {"alias": "multi", "cache": {"exact": True}, "backends": [
                    {"id": "m1", "url": server.url, "version": "v1", "upstream_model": "tiny"},
                    {"id": "m2", "url": server.url, "version": "v2", "upstream_model": "tiny"}]},
            ],
        )  # fmt: skip
        gateway = GatewayProcess(routes, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp)
        gateway.tenant("acme")
        gateway.api_key = gateway.key("acme")  # type: ignore[attr-defined]
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        server.terminate()


@pytest.fixture(scope="module")
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.api_key, max_retries=0, timeout=60)


def _chat(client, **kwargs):
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    return raw.parse(), raw.headers


def _post(gw, body: dict) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        content=body if isinstance(body, bytes) else None,
        json=None if isinstance(body, bytes) else body,
        headers={"Authorization": f"Bearer {gw.api_key}", "content-type": "application/json"},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"template": 3}, "template"),
        ({"variables": {"a": 1}}, "variables"),
        ({"cache": "yes"}, "cache"),
        ({"conversation_id": "has space"}, "conversation_id"),
        ({"conversation_id": "x" * 129}, "conversation_id"),
        ({"template": "no_such_template"}, None),
    ],
)
def test_bad_extension_fields_are_4xx(gw, body, param):
    r = _post(gw, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    if param is not None:
        assert r.status_code == 400 and error["param"] == param, error
    else:
        assert r.status_code == 404 and error["code"] == "template_not_found", error


def test_extension_fields_only_on_chat_and_never_forwarded(gw):
    r = httpx.post(
        gw.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "conversation_id": "c"},
        headers={"Authorization": f"Bearer {gw.api_key}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation_id"
    # The frontend forbids unknown fields: a 200 here means the gateway removed `cache`.
    r = _post(
        gw,
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache": False},
    )
    assert r.status_code == 200, r.text
    assert "x-paved-cache" not in r.headers


def test_lone_surrogate_is_400_not_500(gw):
    r = _post(gw, b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]}')
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    ok = _post(gw, b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"\\ud83d\\ude00"}]}')
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("depth", [129, 10000])
def test_bodies_nested_too_deep_are_400_not_500(gw, depth):
    # 1000+ levels made json.loads raise RecursionError, which escaped as a plain-text 500.
    deep = b"[" * depth + b"]" * depth
    r = _post(gw, b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"y":' + deep + b"}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "the request body is nested more than 128 levels deep"
    ok = b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"hi"}],"metadata":{}}'
    assert _post(gw, ok).status_code == 200


def test_bodies_over_a_mebibyte_are_decoded_off_the_loop_with_the_same_answers(gw):
    # Over paved.http.off_loop's 1 MiB the gateway decodes on its body pool (a 32 MiB body is
    # the better part of a second of parse): the errors are those of a small body.
    pad = b" " * (1 << 20)
    r = _post(gw, b"[" + pad + b"]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text
    r = _post(gw, b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]' + pad + b"}")
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    for stream in (False, True):  # the resumable-chat check decodes it too, once for both
        body = b'{"model":"tiny","max_tokens":2,"stream":%s,' % (b"true" if stream else b"false")
        ok = _post(gw, body + b'"messages":[{"role":"user","content":"hi"}]' + pad + b"}")
        assert ok.status_code == 200, ok.text


def test_a_large_body_is_decoded_on_the_body_pool(monkeypatch):
    threads: list[str] = []
    parse = proxy._parse_body

    def recording(raw: bytes) -> dict:
        threads.append(threading.current_thread().name)
        return parse(raw)

    monkeypatch.setattr(proxy, "_parse_body", recording)
    assert asyncio.run(proxy.decode_body(b'{"a": 1}')) == {"a": 1}
    assert asyncio.run(proxy.decode_body(b'{"a": 1}' + b" " * (1 << 20))) == {"a": 1}
    assert threads[0] == threading.current_thread().name  # small: inline, cheaper than a hop
    assert threads[1].startswith("paved-body"), threads


def test_exact_cache_rules(gw, client):
    messages = [{"role": "user", "content": f"q {secrets.token_hex(4)}"}]
    first, h = _chat(client, model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert h["x-paved-cache"] == "miss"
    hit, h = _chat(client, model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert h["x-paved-cache"] == "exact" and h["x-paved-cache-entry"].startswith("e:")
    assert hit.choices[0].message.content == first.choices[0].message.content
    # A pin of the version the alias resolves to is the same key.
    _, h = _chat(client, model="tiny@v1", messages=messages, max_tokens=6, temperature=0)
    assert h["x-paved-cache"] == "exact"
    # Sampling is cached only when asked for.
    sampled = [{"role": "user", "content": f"s {secrets.token_hex(4)}"}]
    _, h = _chat(client, model="tiny", messages=sampled, max_tokens=6, temperature=0.8)
    assert h["x-paved-cache"] == "bypass"
    _, h = _chat(
        client, model="tiny", messages=sampled, max_tokens=6, temperature=0.8, extra_body={"cache": True}
    )
    assert h["x-paved-cache"] == "miss"
    _, h = _chat(
        client, model="tiny", messages=sampled, max_tokens=6, temperature=0.8, extra_body={"cache": True}
    )
    assert h["x-paved-cache"] == "exact"
    # no-store: neither looked up nor stored.
    fresh = [{"role": "user", "content": f"n {secrets.token_hex(4)}"}]
    _, h = _chat(client, model="tiny", messages=fresh, max_tokens=6, temperature=0,
                 extra_headers={"Cache-Control": "no-store"})  # fmt: skip
    assert h["x-paved-cache"] == "bypass"
    _, h = _chat(client, model="tiny", messages=fresh, max_tokens=6, temperature=0)
    assert h["x-paved-cache"] == "miss"
    # No version is fixed for "multi": never cached (a hit could be another version's answer).
    for _ in range(2):
        _, h = _chat(client, model="multi", messages=messages, max_tokens=6, temperature=0)
        assert h["x-paved-cache"] == "bypass"
    _, h = _chat(client, model="multi@v2", messages=messages, max_tokens=6, temperature=0)
    assert h["x-paved-cache"] == "miss"


def test_false_hit_report_evicts_an_exact_entry(gw, client):
    messages = [{"role": "user", "content": f"fh {secrets.token_hex(4)}"}]
    _chat(client, model="tiny", messages=messages, max_tokens=4, temperature=0)
    _, h = _chat(client, model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert h["x-paved-cache"] == "exact"
    auth = {"Authorization": f"Bearer {gw.api_key}"}
    for bad in ({}, {"entry": 3}, {"entry": "e:zz"}):
        r = httpx.post(gw.url + "/v1/cache/false_hit", json=bad, headers=auth, timeout=10)
        assert r.status_code == 400, (bad, r.text)
    r = httpx.post(gw.url + "/v1/cache/false_hit", json={"entry": h["x-paved-cache-entry"]}, timeout=10)
    assert r.status_code == 401
    r = httpx.post(
        gw.url + "/v1/cache/false_hit", json={"entry": h["x-paved-cache-entry"]}, headers=auth, timeout=10
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        gw.url + "/v1/cache/false_hit", json={"entry": h["x-paved-cache-entry"]}, headers=auth, timeout=10
    )
    assert r.status_code == 404
    _, h = _chat(client, model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert h["x-paved-cache"] == "miss"
    assert (
        'paved_gateway_cache_false_hit_reports_total{tenant="acme"} 1.0'
        in httpx.get(gw.url + "/metrics").text
    )


def test_streams_are_captured_and_replayed(gw, client):
    messages = [{"role": "user", "content": f"stream {secrets.token_hex(4)}"}]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert raw.headers["x-paved-cache"] == "exact"
    replayed = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in replayed if c.choices) == text
    assert not [c for c in replayed if c.usage]  # not asked for this time
    whole, h = _chat(client, model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert h["x-paved-cache"] == "exact"
    assert whole.choices[0].message.content == text
    assert whole.usage.completion_tokens == usage[0].completion_tokens


def test_conversation_fits_the_context_the_backend_reports(gw, client):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    conversation = f"c-{secrets.token_hex(4)}"
    max_tokens = 20
    summarized = []
    for turn in range(15):
        chat, h = _chat(
            client,
            model="conv",
            messages=[{"role": "user", "content": f"turn {turn}: " + "tell me more about rivers " * 4}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"conversation_id": conversation},
        )
        assert chat.usage.prompt_tokens <= MAX_MODEL_LEN - max_tokens
        assert int(h["x-paved-context-tokens"]) == chat.usage.prompt_tokens
        summarized.append(int(h["x-paved-context-summarized-turns"]))
    assert summarized[0] == 0 and summarized[-1] > 0, summarized
    # The turn's prompt was counted with the model's tokenizer: one turn alone, recounted here.
    chat, h = _chat(
        client, model="conv", messages=[{"role": "user", "content": "alone"}], max_tokens=2, temperature=0,
        extra_body={"conversation_id": f"solo-{secrets.token_hex(4)}"},
    )  # fmt: skip
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "alone"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    # A turn that cannot fit even alone.
    huge = [{"role": "user", "content": "word " * 400}]
    r = _post(gw, {"model": "conv", "messages": huge, "max_tokens": 10, "conversation_id": conversation})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_experiment_arms_apply_and_stick(gw, client):
    r = gw.admin(
        "POST",
        "/admin/v1/experiments",
        {
            "name": f"len-{secrets.token_hex(3)}",
            "model": "conv",
            "arms": [
                {"name": "one", "weight": 3, "params": {"max_tokens": 1}},
                {"name": "three", "weight": 1, "params": {"max_tokens": 3}},
            ],
        },
    )
    assert r.status_code in (200, 201), r.text
    name = r.json()["name"]

    def ask(user: str) -> str:
        chat, h = _chat(
            client, model="conv", messages=[{"role": "user", "content": "go"}], user=user, temperature=0
        )
        arm = h["x-paved-experiment"].removeprefix(f"{name};arm=")
        assert chat.usage.completion_tokens == {"one": 1, "three": 3}[arm]
        return arm

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            arms = list(pool.map(ask, [f"u{i}" for i in range(300)]))
            assert list(pool.map(ask, [f"u{i}" for i in range(50)])) == arms[:50]
        # 3:1 split over 300 users, within 4 sigma.
        assert abs(arms.count("one") - 225) <= 4 * (300 * 0.75 * 0.25) ** 0.5, arms.count("one")
        # A pinned version is outside the experiment.
        _, h = _chat(client, model="conv@v1", messages=[{"role": "user", "content": "go"}], max_tokens=2)
        assert "x-paved-experiment" not in h
        results = gw.admin("GET", f"/admin/v1/experiments/{name}/results").json()
        counts = {a["name"]: a["requests"] for a in results["arms"]}
        assert counts == {"one": arms.count("one") + arms[:50].count("one"),
                          "three": arms.count("three") + arms[:50].count("three")}  # fmt: skip
    finally:
        gw.admin("POST", f"/admin/v1/experiments/{name}/stop")
