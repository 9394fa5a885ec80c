"""The orchestration and cache layers end to end: the official `openai` client through the
gateway to a real paved frontend running vLLM (//models/tiny for chat and summaries,
all-MiniLM-L6-v2 for the semantic cache's embeddings).

Prompt tokens are checked against the model's own tokenizer (the engine's usage and the
gateway's `x-paved-context-tokens` agree with it), so a template that did not render, a system
prompt that was not injected or a conversation that overflowed its budget all fail here.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import secrets
import sqlite3
import time

import httpx
import numpy as np
import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess, minilm_model_toml, tiny_model_toml, write_config

from paved.runfiles import tiny_model_dir

MAX_MODEL_LEN = 512


def _config(path: str) -> str:
    return write_config(path, tiny_model_toml(max_model_len=MAX_MODEL_LEN), minilm_model_toml())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _prompt_tokens(tok, messages) -> int:
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(rendered, add_special_tokens=False))


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orch")
    server = ServerProcess("--config", _config(str(tmp / "frontend.toml")))
    gw = None
    try:
        backend = [{"url": server.url, "version": "v1"}]
        routes = write_routes(
            tmp / "routes.json",
            [
                {
                    "alias": "tiny",
                    "tokenizer": tiny_model_dir(),
                    "summarizer": "tiny",
                    "cache": {"exact": True, "semantic": True, "embedding_model": "minilm", "ttl_s": 600},
                    "backends": backend,
                },
                # The same model without caches: conversations and experiments run on it.
                {"alias": "plain", "tokenizer": tiny_model_dir(), "summarizer": "tiny",
                 # Greedy, the toy model answers only newlines: a summary needs sampling.
                 "summarizer_temperature": 0.8, "backends": [
                    {"id": "plain", "url": server.url, "version": "v1", "upstream_model": "tiny"}
                ]},
                {"alias": "minilm", "kind": "embed",
                 "backends": [{"id": "embed", "url": server.url, "version": "v1"}]},
            ],
        )  # fmt: skip
        # A chat stream whose client left is aborted after half a second without a reader
        # (resumable streams' grace; 30 s by default).
        gw = GatewayProcess(
            routes, "--stream-grace", "0.5", admin_key="adm-" + secrets.token_hex(16), state_dir=tmp
        )
        for tenant in ("team", "other"):
            gw.tenant(tenant, models=["tiny", "plain", "minilm"])
        gw.keys = {t: gw.key(t) for t in ("team", "other")}  # type: ignore[attr-defined]
        gw.state_path = tmp / "gw.sqlite"  # type: ignore[attr-defined]
        yield gw
    finally:
        if gw is not None:
            gw.stop()
        server.terminate()


def _client(gw, tenant: str = "team") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys[tenant], max_retries=0, timeout=120)


def _disconnects(gw) -> float:
    """The gateway's count of the tiny model's answers aborted for want of a client."""
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    prefix = 'paved_gateway_client_disconnects_total{model="tiny"} '
    return sum(float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix))


def _chat(client, **kwargs):
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    return raw.parse(), raw.headers


def _ask(client, messages, **kwargs):
    """A deterministic request to the cached route."""
    return _chat(
        client, **{"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0, **kwargs}
    )


# -- templates -----------------------------------------------------------------------------------


def test_template_renders_and_injection_is_refused(platform, tokenizer):
    gw = platform
    r = gw.admin(
        "POST",
        "/admin/v1/templates",
        {
            "name": "support",
            "messages": [
                {"role": "system", "content": "You help customers of {{ company }}."},
                {"role": "user", "content": "{{ question | trim }} (order {{ order }})"},
            ],
        },
    )
    assert r.status_code in (200, 201), r.text
    assert r.json()["version"] == 1
    variables = {"company": "Acme", "question": "  where is my parcel? ", "order": "{{ 7*7 }}"}
    chat, headers = _chat(
        _client(gw),
        model="plain",
        messages=[],
        max_tokens=4,
        temperature=0,
        extra_body={"template": "support", "variables": variables},
    )
    assert headers["x-paved-template"] == "support@1"
    expected = [
        {"role": "system", "content": "You help customers of Acme."},
        # A variable is data: its braces are not evaluated.
        {"role": "user", "content": "where is my parcel? (order {{ 7*7 }})"},
    ]
    assert chat.usage.prompt_tokens == _prompt_tokens(tokenizer, expected)

    # A second version; the bare name follows it, a pin keeps the first.
    r = gw.admin(
        "POST",
        "/admin/v1/templates",
        {"name": "support", "messages": [{"role": "user", "content": "v2: {{ question }}"}]},
    )
    assert r.json()["version"] == 2
    _, headers = _chat(
        _client(gw), model="plain", messages=[], max_tokens=2, temperature=0,
        extra_body={"template": "support", "variables": {"question": "x"}},
    )  # fmt: skip
    assert headers["x-paved-template"] == "support@2"
    _, headers = _chat(
        _client(gw), model="plain", messages=[], max_tokens=2, temperature=0,
        extra_body={"template": "support@1", "variables": variables},
    )  # fmt: skip
    assert headers["x-paved-template"] == "support@1"

    for source in (
        "{{ ''.__class__.__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ x['__class__'] }}",
        "{{ x|attr('__class__') }}",
        "{% include 'secret' %}",
    ):
        r = gw.admin(
            "POST", "/admin/v1/templates", {"name": "evil", "messages": [{"role": "user", "content": source}]}
        )
        assert r.status_code == 400, (source, r.text)
        assert r.json()["error"]["code"] == "template_refused", r.text

    # Valid but unbounded: refused at render time, quickly, with a 400.
    r = gw.admin(
        "POST",
        "/admin/v1/templates",
        {"name": "spin", "messages": [{"role": "user", "content": (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        )}]},
    )  # fmt: skip
    assert r.status_code in (200, 201), r.text
    with pytest.raises(openai.BadRequestError) as e:
        _client(gw).chat.completions.create(
            model="plain", messages=[], max_tokens=2, extra_body={"template": "spin"}
        )
    assert e.value.status_code == 400
    # A missing variable names itself.
    with pytest.raises(openai.BadRequestError, match="question"):
        _client(gw).chat.completions.create(
            model="plain", messages=[], max_tokens=2, extra_body={"template": "support@2"}
        )
    with pytest.raises(openai.NotFoundError):
        _client(gw).chat.completions.create(
            model="plain", messages=[], max_tokens=2, extra_body={"template": "missing"}
        )


def test_tenant_system_prompt_is_injected(platform, tokenizer):
    gw = platform
    r = gw.admin("PUT", "/admin/v1/tenants/other/prompting", {"system_prompt": "Answer in French."})
    assert r.status_code == 200, r.text
    try:
        messages = [{"role": "user", "content": "hello there"}]
        chat, _ = _chat(_client(gw, "other"), model="plain", messages=messages, max_tokens=2, temperature=0)
        assert chat.usage.prompt_tokens == _prompt_tokens(
            tokenizer, [{"role": "system", "content": "Answer in French."}, *messages]
        )
        # Only that tenant's requests.
        chat, _ = _chat(_client(gw, "team"), model="plain", messages=messages, max_tokens=2, temperature=0)
        assert chat.usage.prompt_tokens == _prompt_tokens(tokenizer, messages)
    finally:
        gw.admin("PUT", "/admin/v1/tenants/other/prompting", {"system_prompt": None})


# -- conversations -------------------------------------------------------------------------------


def test_forty_turn_conversation_stays_within_budget(platform, tokenizer):
    gw = platform
    client = _client(gw)
    system = {"role": "system", "content": "You are a terse assistant."}
    max_tokens = 16
    budget = MAX_MODEL_LEN - max_tokens
    summarized = []
    for turn in range(40):
        question = f"Turn {turn}: remember that item {turn} costs {turn * 7} euros. What is {turn} plus 3?"
        chat, headers = _chat(
            client,
            model="plain",
            messages=[system, {"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"conversation_id": "conv-40"},
        )
        # The engine's count, the gateway's count and the model's tokenizer agree, under budget.
        assert chat.usage.prompt_tokens <= budget, (turn, chat.usage.prompt_tokens)
        assert int(headers["x-paved-context-tokens"]) == chat.usage.prompt_tokens
        summarized.append(int(headers["x-paved-context-summarized-turns"]))
    assert summarized[0] == 0
    assert summarized[-1] > 0, summarized
    # Older turns were folded into a summary written by the summarizer model, kept in the store.
    db = sqlite3.connect(gw.state_path)
    try:
        rows = db.execute(
            "SELECT summary, summary_upto FROM gateway_conversations WHERE conversation_id = 'conv-40'"
        ).fetchall()
    finally:
        db.close()
    assert len(rows) == 1 and rows[0][0] and rows[0][1] > 0, (rows, gw.tail(40))
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'paved_gateway_internal_call_duration_seconds_count{outcome="ok",purpose="summary"}' in metrics

    # The same id under another tenant is another conversation.
    chat, headers = _chat(
        _client(gw, "other"), model="plain", messages=[{"role": "user", "content": "hi"}],
        max_tokens=2, temperature=0, extra_body={"conversation_id": "conv-40"},
    )  # fmt: skip
    assert headers["x-paved-context-summarized-turns"] == "0"
    assert chat.usage.prompt_tokens == _prompt_tokens(tokenizer, [{"role": "user", "content": "hi"}])


# -- caches --------------------------------------------------------------------------------------


def _embed(gw, texts):
    client = _client(gw)
    out = client.embeddings.create(model="minilm", input=texts)
    vectors = np.array([d.embedding for d in out.data], dtype=np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_exact_cache(platform):
    gw = platform
    client = _client(gw)
    messages = [{"role": "user", "content": f"exact {secrets.token_hex(4)}: name a colour"}]
    first, h1 = _chat(client, model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert h1["x-paved-cache"] == "miss"
    second, h2 = _chat(client, model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert h2["x-paved-cache"] == "exact"
    assert second.choices[0].message.content == first.choices[0].message.content
    # Streaming hits are replayed as SSE.
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert raw.headers["x-paved-cache"] == "exact"
    chunks = list(raw.parse())
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == first.choices[0].message.content
    )
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [first.usage.completion_tokens]
    # Anything that changes the answer is another key; sampling is never cached unless asked.
    _, h = _chat(client, model="tiny", messages=messages, max_tokens=13, temperature=0)
    assert h["x-paved-cache"] == "miss"
    _, h = _chat(client, model="tiny", messages=messages, max_tokens=12, temperature=1.0)
    assert h["x-paved-cache"] == "bypass"
    _, h = _chat(client, model="tiny", messages=messages, max_tokens=12, temperature=0,
                 extra_headers={"Cache-Control": "no-cache"})  # fmt: skip
    assert h["x-paved-cache"] == "bypass"
    # A streamed miss is cached too, once complete.
    fresh = [{"role": "user", "content": f"stream {secrets.token_hex(4)}"}]
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=fresh, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    again, h = _chat(client, model="tiny", messages=fresh, max_tokens=8, temperature=0)
    assert h["x-paved-cache"] == "exact" and again.choices[0].message.content == text
    # Another tenant never sees it.
    _, h = _chat(_client(gw, "other"), model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert h["x-paved-cache"] == "miss"


def test_semantic_cache_with_minilm(platform):
    gw = platform
    client = _client(gw)
    tag = secrets.token_hex(3)
    # A shared prefix in the system prompt scopes this test's entries away from the others'.
    system = {"role": "system", "content": f"session {tag}"}
    asked = "How do I reset my password?"
    pairs = [
        ("How can I reset my password?", True),
        ("What is the weather in Paris tomorrow?", False),
    ]
    vectors = _embed(gw, [asked] + [p for p, _ in pairs])
    _, h = _chat(
        client,
        model="tiny",
        messages=[system, {"role": "user", "content": asked}],
        max_tokens=10,
        temperature=0,
    )
    assert h["x-paved-cache"] == "miss"
    for i, (text, paraphrase) in enumerate(pairs, start=1):
        score = float(vectors[0] @ vectors[i])
        assert (score >= 0.92) == paraphrase, (text, score)  # the fixture pairs are what they claim
        _, h = _chat(
            client,
            model="tiny",
            messages=[system, {"role": "user", "content": text}],
            max_tokens=10,
            temperature=0,
        )
        if paraphrase:
            kind, _, value = h["x-paved-cache"].partition(";score=")
            assert kind == "semantic", h["x-paved-cache"]
            assert math.isclose(float(value), score, abs_tol=2e-3)
            entry = h["x-paved-cache-entry"]
        else:
            assert h["x-paved-cache"] == "miss"
    paraphrase = pairs[0][0]
    # Never across a different response_format, template, model version or tenant.
    asked_again = [system, {"role": "user", "content": paraphrase}]
    _, h = _ask(client, asked_again, response_format={"type": "json_object"})
    assert h["x-paved-cache"] == "miss"
    _, h = _ask(_client(gw, "other"), asked_again)
    assert h["x-paved-cache"] == "miss"
    # A false-hit report evicts the entry and is counted.
    other_key = _client(gw, "other")
    r = httpx.post(gw.url + "/v1/cache/false_hit", json={"entry": entry},
                   headers={"Authorization": f"Bearer {other_key.api_key}"}, timeout=10)  # fmt: skip
    assert r.status_code == 404  # not that tenant's entry
    r = httpx.post(gw.url + "/v1/cache/false_hit", json={"entry": entry},
                   headers={"Authorization": f"Bearer {gw.keys['team']}"}, timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text
    # Gone: the paraphrase is a miss now (a semantic hit was never stored as an entry itself).
    _, h = _ask(client, [system, {"role": "user", "content": paraphrase}])
    assert h["x-paved-cache"] == "miss", h["x-paved-cache"]
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'paved_gateway_cache_false_hit_reports_total{tenant="team"} 1.0' in metrics
    assert 'result="semantic",tenant="team"' in metrics


def test_error_answers_are_never_cached(platform):
    gw = platform
    client = _client(gw)
    too_long = [{"role": "user", "content": "x " * 2000}]
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=too_long, max_tokens=4, temperature=0)
        # The engine answered (its 400), not the cache.
        assert e.value.response.headers["x-paved-cache"] == "miss"
        assert "x-paved-backend" in e.value.response.headers
    # An aborted stream is not cached: the same request afterwards is a miss. Chat streams are
    # resumable, so a client leaving aborts the generation only once no reader came back for
    # the stream's grace (0.5 s here); a generation that finished within it is a whole answer,
    # and caching it is right. So an abort counts once the gateway has counted the disconnect,
    # and a race lost to the model is tried again with a new prompt.
    for _attempt in range(4):
        messages = [{"role": "user", "content": f"abort {secrets.token_hex(4)}"}]
        before = _disconnects(gw)
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 400, "temperature": 0, "stream": True,
                  "ignore_eos": True},
            headers={"Authorization": f"Bearer {gw.keys['team']}"}, timeout=60,
        ) as r:  # fmt: skip
            for _ in r.iter_lines():
                break
        deadline = time.monotonic() + 10
        while _disconnects(gw) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        if _disconnects(gw) > before:
            break
    else:
        raise AssertionError("the model finished every answer within the stream's grace")
    _, h = _chat(
        client,
        model="tiny",
        messages=messages,
        max_tokens=400,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert h["x-paved-cache"] == "miss"


# -- experiments ---------------------------------------------------------------------------------


def test_ab_experiment_sticky_over_1000_users(platform):
    gw = platform
    r = gw.admin(
        "POST",
        "/admin/v1/experiments",
        {
            "name": "short-vs-long",
            "model": "plain",
            "arms": [
                {"name": "short", "weight": 1, "params": {"max_tokens": 1}},
                {"name": "long", "weight": 1, "params": {"max_tokens": 2}},
            ],
        },
    )
    assert r.status_code in (200, 201), r.text
    client = _client(gw)

    def ask(user: str):
        chat, headers = _chat(
            client, model="plain", messages=[{"role": "user", "content": "hi"}], temperature=0, user=user
        )
        arm = headers["x-paved-experiment"].split("arm=")[1]
        # The arm's parameters were applied.
        assert chat.usage.completion_tokens <= {"short": 1, "long": 2}[arm]
        return arm, headers["x-request-id"]

    users = [f"user-{i}" for i in range(1000)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = list(pool.map(ask, users))
        again = list(pool.map(ask, users[:100]))
    arms = [a for a, _ in first]
    assert [a for a, _ in again] == arms[:100]  # sticky
    short = arms.count("short")
    assert abs(short - 500) <= 4 * math.sqrt(1000 * 0.25), short
    # Feedback on a few answers, then results with counts and intervals.
    for arm, request_id in first[:20]:
        r = httpx.post(
            gw.url + "/v1/feedback",
            json={"request_id": request_id, "rating": 1 if arm == "long" else 0},
            headers={"Authorization": f"Bearer {gw.keys['team']}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
    results = gw.admin("GET", "/admin/v1/experiments/short-vs-long/results").json()
    by_arm = {a["name"]: a for a in results["arms"]}
    assert by_arm["short"]["requests"] == short + arms[:100].count("short")
    assert by_arm["long"]["requests"] == 1000 - short + arms[:100].count("long")
    assert by_arm["long"]["completion_tokens"]["mean"] > by_arm["short"]["completion_tokens"]["mean"]
    rated = {a: sum(1 for arm, _ in first[:20] if arm == a) for a in ("short", "long")}
    for name in ("short", "long"):
        assert by_arm[name]["rating"]["n"] == rated[name]
        lo, hi = by_arm[name]["latency_ms"]["ci95"]
        assert lo <= by_arm[name]["latency_ms"]["mean"] <= hi
    print(json.dumps(results)[:2000])
    gw.admin("POST", "/admin/v1/experiments/short-vs-long/stop")
