"""The gateway's caches: keys, answers, the exact caches (in-process and a real redis-server) and
the semantic cache with its ANN index.

Covers: canonical keys (key order, 1 vs 1.0, ignored fields, every field that changes an answer
changes the key; the scope drops only the last user message's text) and determinism; which
answers are cacheable; streams merged into answers (complete, truncated, error, unfinished,
tool calls, n > 1, completions) and answers replayed as streams (round trip as a property, every
chunk a valid `openai` chunk); the in-process exact cache against a reference LRU model (TTL,
byte bound, entry bound); RedisExactCache against a real server, including a server that is
down, stopped mid-life or hung (each a miss, never an error); the semantic cache's isolation
rules as properties (never a hit across tenants or scopes even for identical vectors, an entry
always finds itself, evict by another tenant fails), TTL, max_entries; and VectorIndex: exact vs
brute force, the switch to IVF, adds and removes made while a rebuild is held are not lost, a
failing rebuild leaves the index searchable, recall on clustered data. Entry ids
(x-paved-cache-entry): signed per tenant (a property over tenants and entries: never opened by
another tenant, never forged from a computable key), one secret for every replica on a store, and
POST /v1/cache/false_hit answering another tenant's or a forged id exactly like an unknown one.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import socket
import threading
from collections import OrderedDict

import httpx
import numpy as np
import openai.types
import openai.types.chat
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.limits import InProcessLimiter
from paved.gateway.access.state import TENANT_NAME_RE, GatewayStore
from paved.gateway.app import Gateway, create_app
from paved.gateway.caching import ann
from paved.gateway.caching.ann import VectorIndex
from paved.gateway.caching.cache import (
    IGNORED_FIELDS,
    CachedAnswer,
    EntryIds,
    InProcessExactCache,
    RedisExactCache,
    SemanticCache,
    answer_from_stream,
    cache_keys,
    is_cacheable_answer,
    is_deterministic,
    question_numbers,
    replay_sse,
)
from paved.gateway.forwarding.proxy import OpenAIProxy, ProxyConfig
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.orchestrate import InternalClient, Orchestrator
from paved.gateway.orchestration.tokens import TokenCounter
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import parse_routes
from paved.gateway.types import Limits, Principal, Tenant
from paved.testing.redis import redis_server


def run(coro):
    return asyncio.run(coro)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def chat_body(question: str = "What is the capital of France?", **extra) -> dict:
    return {
        "model": "chat",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": question},
        ],
        "temperature": 0,
        "max_tokens": 64,
        **extra,
    }


def keys_of(body: dict, *, tenant="t1", model="chat@v1", template=None, endpoint="chat"):
    return cache_keys(tenant=tenant, model=model, template=template, endpoint=endpoint, body=body)


# ---- keys ---------------------------------------------------------------------------------------
def test_key_ignores_order_number_spelling_and_ignored_fields():
    base = keys_of(chat_body(response_format={"type": "json_schema", "json_schema": {"a": 1, "b": [1, 2.5]}}))
    reordered = dict(reversed(list(chat_body().items())))
    reordered["response_format"] = {"json_schema": {"b": [1.0, 2.5], "a": 1.0}, "type": "json_schema"}
    reordered["temperature"] = 0.0
    reordered["max_tokens"] = 64.0
    reordered["messages"] = [dict(reversed(list(m.items()))) for m in reordered["messages"]]
    assert keys_of(reordered) == base
    noisy = {
        **reordered,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "end-user-7",
        "template": "faq@3",
        "variables": {"x": 1},
        "conversation_id": "c1",
        "cache": "no-cache",
        "model": "chat@v2",  # the resolved model argument stands for it
    }
    assert set(noisy) - set(chat_body()) - {"response_format"} == IGNORED_FIELDS
    assert keys_of(noisy) == base


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "t2"},
        {"model": "chat@v2"},
        {"template": "faq@1"},
        {"endpoint": "completions"},
        {"body": {"temperature": 0.5}},
        {"body": {"top_p": 0.9}},
        {"body": {"max_tokens": 65}},
        {"body": {"n": 2}},
        {"body": {"seed": 7}},
        {"body": {"stop": ["\n"]}},
        {"body": {"response_format": {"type": "json_object"}}},
        {"body": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}},
        {"body": {"logprobs": True}},
        {"body": {"temperature": False}},  # a boolean is not the number 0
    ],
)
def test_every_field_that_changes_the_answer_changes_both_keys(change):
    base = keys_of(chat_body())
    kwargs = {k: v for k, v in change.items() if k != "body"}
    changed = keys_of({**chat_body(), **change.get("body", {})}, **kwargs)
    assert changed.exact != base.exact
    assert changed.scope != base.scope


def test_scope_drops_only_the_last_user_text():
    a, b = keys_of(chat_body("What is the capital of France?")), keys_of(chat_body("Capital of France?"))
    assert a.exact != b.exact and a.scope == b.scope
    assert a.text == "What is the capital of France?" and b.text == "Capital of France?"
    assert a.scope != a.exact
    # Earlier turns and the system prompt are part of the scope.
    other_system = chat_body()
    other_system["messages"][0]["content"] = "You are verbose."
    assert keys_of(other_system).scope != a.scope
    other_turn = chat_body()
    other_turn["messages"][1]["content"] = "Hello"
    assert keys_of(other_turn).scope != a.scope
    one_turn_less = chat_body()
    del one_turn_less["messages"][1:3]
    assert keys_of(one_turn_less).scope != a.scope
    # The last user message's other fields stay.
    named = chat_body()
    named["messages"][-1]["name"] = "alice"
    assert keys_of(named).scope != a.scope


def test_numbers_of_the_question_are_in_the_scope():
    """A semantic hit needs the same numbers in the same order (MiniLM scores "15 percent of 80"
    vs "80 percent of 15" at 0.98); the wording around them is free."""
    scope = keys_of(chat_body("What is 15 percent of 80?")).scope
    assert keys_of(chat_body("Calculate 15% of 80.")).scope == scope
    assert keys_of(chat_body("What is 80 percent of 15?")).scope != scope
    assert keys_of(chat_body("What is 15 percent of 81?")).scope != scope
    assert keys_of(chat_body("What is 15 percent of eighty?")).scope != scope
    order = keys_of(chat_body("Where is my order #48213?")).scope
    assert keys_of(chat_body("Where is my order #48231?")).scope != order
    assert keys_of(chat_body("Status of order 48213, please")).scope == order
    loan = keys_of(chat_body("Payment on a $300,000 mortgage at 6.5%?")).scope
    assert keys_of(chat_body("Monthly cost of a 300000 dollar loan at 6.5 percent")).scope == loan
    assert question_numbers("$1,250.75 in 2 days, 3.0 times") == ["1250.75", "2", "3.0"]
    # Without the guard only the text's wording is free.
    off = {"numbers_in_scope": False}
    assert (
        cache_keys(
            tenant="t", model="m@1", template=None, endpoint="chat", body=chat_body("a 1"), **off
        ).scope
        == cache_keys(
            tenant="t", model="m@1", template=None, endpoint="chat", body=chat_body("b 2"), **off
        ).scope
    )


def test_semantic_text_forms():
    parts = chat_body()
    parts["messages"][-1]["content"] = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "text", "text": "this picture"},
    ]
    k = keys_of(parts)
    assert k.text == "Describe\nthis picture"
    other_image = copy.deepcopy(parts)
    other_image["messages"][-1]["content"][1]["image_url"]["url"] = "data:y"
    assert keys_of(other_image).scope != k.scope  # non-text parts stay in the scope
    # After the last user message come an assistant prefill: still that user message's text.
    prefill = chat_body()
    prefill["messages"].append({"role": "assistant", "content": "Paris"})
    assert keys_of(prefill).text == "What is the capital of France?"
    assert keys_of(prefill).scope != keys_of(chat_body()).scope
    assert keys_of({"messages": [{"role": "system", "content": "x"}]}).text is None
    assert keys_of(chat_body("   ")).text is None
    assert keys_of({"messages": "not a list"}).text is None
    completion = keys_of({"prompt": "Once upon a time", "max_tokens": 5}, endpoint="completions")
    assert completion.text == "Once upon a time"
    assert keys_of({"prompt": "Twice", "max_tokens": 5}, endpoint="completions").scope == completion.scope
    assert keys_of({"prompt": ["a", "b"], "max_tokens": 5}, endpoint="completions").text is None
    assert keys_of({"input": "x"}, endpoint="embeddings").text is None


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _respell(value, rnd):
    """The same JSON value with shuffled key order and integral numbers as floats or ints."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _respell(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_respell(v, rnd) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and abs(value) < 2**53:
        return float(value) if rnd.random() < 0.5 else value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value) if rnd.random() < 0.5 else value
    return value


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.text(max_size=6), json_value, max_size=5), rnd=st.randoms())
def test_keys_are_canonical_property(body, rnd):
    assert keys_of(_respell(body, rnd)) == keys_of(body)


def test_is_deterministic():
    assert is_deterministic({"temperature": 0}, opt_in=False)
    assert is_deterministic({"temperature": 0.0}, opt_in=False)
    assert not is_deterministic({}, opt_in=False)  # OpenAI's default is 1
    assert not is_deterministic({"temperature": 0.2}, opt_in=False)
    assert not is_deterministic({"temperature": False}, opt_in=False)
    assert not is_deterministic({"temperature": "0"}, opt_in=False)
    assert is_deterministic({"temperature": 1.0}, opt_in=True)


# ---- answers -----------------------------------------------------------------------------------
def chat_answer(*finish: str | None, content: str = "Paris.") -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "chat",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": f,
                }
                for i, f in enumerate(finish)
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        }
    ).encode()


def test_is_cacheable_answer():
    assert is_cacheable_answer(200, chat_answer("stop"))
    assert is_cacheable_answer(200, chat_answer("length", "stop"))
    for status in (201, 400, 401, 404, 422, 429, 499, 500, 502, 503, 504):
        assert not is_cacheable_answer(status, chat_answer("stop"))
    assert not is_cacheable_answer(200, chat_answer(None))
    assert not is_cacheable_answer(200, chat_answer("stop", None))
    assert not is_cacheable_answer(200, chat_answer("abort"))
    assert not is_cacheable_answer(200, chat_answer("tool_calls"))
    assert not is_cacheable_answer(200, chat_answer())  # no choices
    assert not is_cacheable_answer(200, b'{"error": {"message": "boom"}, "choices": []}')
    assert not is_cacheable_answer(
        200, b'{"error": {"message": "x"}, "choices": [{"finish_reason": "stop"}]}'
    )
    assert not is_cacheable_answer(200, b"not json")
    assert not is_cacheable_answer(200, b'["stop"]')
    assert not is_cacheable_answer(200, chat_answer("stop")[:-5])  # truncated body


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def chunk(choices, **extra) -> bytes:
    return sse(
        {
            "id": "chatcmpl-9",
            "object": "chat.completion.chunk",
            "created": 1700000001,
            "model": "chat",
            "choices": choices,
            **extra,
        }
    )


def delta(index=0, finish=None, **d) -> dict:
    return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def complete_stream() -> list[bytes]:
    return [
        chunk([delta(role="assistant", content="")]),
        chunk([delta(content="Par")]),
        chunk([delta(content="is")]),
        chunk([delta(content=".")]),
        chunk([delta(finish="stop")]),
        chunk([], usage=USAGE),
        b"data: [DONE]",
    ]


def test_answer_from_a_complete_stream():
    answer = json.loads(answer_from_stream("chat", complete_stream()))
    assert answer == {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "created": 1700000001,
        "model": "chat",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    openai.types.chat.ChatCompletion.model_validate(answer)
    assert is_cacheable_answer(200, answer_from_stream("chat", complete_stream()))
    # The gateway's framing (a trailing blank line, CRLF-free) and comments are fine too.
    framed = [e + b"\n\n" for e in complete_stream()]
    assert json.loads(answer_from_stream("chat", [b": keep-alive", *framed])) == answer


def test_incomplete_or_failed_streams_are_not_answers():
    events = complete_stream()
    assert answer_from_stream("chat", events[:-1]) is None  # no [DONE]: truncated
    assert answer_from_stream("chat", events[:3]) is None
    no_finish = [e for e in events if b'"finish_reason": "stop"' not in e]
    assert answer_from_stream("chat", no_finish) is None
    error = sse({"error": {"message": "the model's backend failed mid-stream", "code": "upstream_error"}})
    assert answer_from_stream("chat", [*events[:3], error, b"data: [DONE]"]) is None
    assert answer_from_stream("chat", [*events[:3], b"data: {not json", *events[3:]]) is None
    assert answer_from_stream("chat", [b"data: [DONE]"]) is None  # no choice at all
    # Choice 1 never finished.
    two = [
        chunk([delta(0, role="assistant", content="a"), delta(1, role="assistant", content="b")]),
        chunk([delta(0, finish="stop")]),
        b"data: [DONE]",
    ]
    assert answer_from_stream("chat", two) is None
    gap = [chunk([delta(1, role="assistant", content="b", finish="stop")]), b"data: [DONE]"]
    assert answer_from_stream("chat", gap) is None  # choice 0 missing
    legacy = [chunk([delta(function_call={"name": "f", "arguments": "{}"}, finish="stop")]), b"data: [DONE]"]
    assert answer_from_stream("chat", legacy) is None
    assert answer_from_stream("embeddings", events) is None


def test_stream_with_tool_calls_and_two_choices():
    events = [
        chunk([delta(0, role="assistant"), delta(1, role="assistant", content="")]),
        chunk(
            [
                delta(
                    0,
                    tool_calls=[
                        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get"}}
                    ],
                )
            ]
        ),
        chunk([delta(0, tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}])]),
        chunk([delta(1, content="No tools.")]),
        chunk([delta(0, tool_calls=[{"index": 0, "function": {"arguments": ' "Paris"}'}}])]),
        chunk(
            [
                delta(
                    0,
                    tool_calls=[
                        {"index": 1, "id": "call_2", "function": {"name": "time", "arguments": "{}"}}
                    ],
                )
            ]
        ),
        chunk([delta(0, finish="tool_calls"), delta(1, finish="length")]),
        b"data: [DONE]",
    ]
    answer = json.loads(answer_from_stream("chat", events))
    first, second = answer["choices"]
    assert first["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
        ],
    }
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "No tools."}
    assert second["finish_reason"] == "length"
    assert "usage" not in answer  # the client did not ask for it, the gateway stripped it
    openai.types.chat.ChatCompletion.model_validate(answer)
    # A tool call whose id never came, or whose index skips, cannot be merged reliably.
    no_id = [chunk([delta(tool_calls=[{"index": 0, "function": {"name": "f"}}], finish="tool_calls")])]
    assert answer_from_stream("chat", [*no_id, b"data: [DONE]"]) is None
    skip = [
        chunk([delta(tool_calls=[{"index": 1, "id": "c", "function": {"name": "f"}}], finish="tool_calls")])
    ]
    assert answer_from_stream("chat", [*skip, b"data: [DONE]"]) is None
    unindexed = [chunk([delta(tool_calls=[{"id": "c", "function": {"name": "f"}}], finish="tool_calls")])]
    assert answer_from_stream("chat", [*unindexed, b"data: [DONE]"]) is None


def test_completions_stream():
    def part(text, finish=None, **extra):
        return sse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "tiny",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}],
            }
        )

    events = [part("Once"), part(" upon"), part(" a time", "length", stop_reason=None), b"data: [DONE]"]
    answer = json.loads(answer_from_stream("completions", events))
    assert answer["object"] == "text_completion"
    assert answer["choices"] == [
        {"index": 0, "text": "Once upon a time", "logprobs": None, "finish_reason": "length"}
    ]
    openai.types.Completion.model_validate(answer)
    assert answer_from_stream("completions", events[:-1]) is None


words = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(alphabet="abcdef0123456789", min_size=1, max_size=8).map(lambda s: "call_" + s),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text(alphabet="abcxyz_", min_size=1, max_size=8), "arguments": words}
        ),
    }
)


@st.composite
def chat_answers(draw):
    choices = []
    for i in range(draw(st.integers(1, 3))):
        message = {"role": "assistant", "content": draw(st.one_of(st.none(), words))}
        calls = draw(st.lists(tool_call, max_size=2))
        if calls:
            message["tool_calls"] = calls
        if draw(st.booleans()):
            message["reasoning_content"] = draw(words)
        logprobs = draw(
            st.one_of(
                st.none(),
                st.just({"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}),
            )
        )
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
            }
        )
    answer = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 17,
        "model": "m",
        "choices": choices,
    }
    if draw(st.booleans()):
        answer["usage"] = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    if draw(st.booleans()):
        answer["system_fingerprint"] = "fp_1"
    return answer


def _normalised(answer: dict, usage: bool) -> dict:
    out = copy.deepcopy(answer)
    if not usage:
        out.pop("usage", None)
    return out


@settings(max_examples=200, deadline=None)
@given(answer=chat_answers(), include_usage=st.booleans())
def test_replay_round_trip_chat_property(answer, include_usage):
    cached = CachedAnswer(body=json.dumps(answer).encode(), created_at=0.0)
    events = replay_sse("chat", cached, include_usage=include_usage)
    assert events[-1] == b"data: [DONE]\n\n"
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") and b"\n\n" not in e[:-2] for e in events)
    for event in events[:-1]:
        parsed = json.loads(event[6:])
        openai.types.chat.ChatCompletionChunk.model_validate(parsed)
        assert parsed["object"] == "chat.completion.chunk"
        assert ("usage" in parsed) == include_usage
    # The usage-only chunk: last before [DONE], no choices.
    if include_usage and "usage" in answer:
        assert json.loads(events[-2][6:]) == {**_head(answer), "choices": [], "usage": answer["usage"]}
    back = answer_from_stream("chat", [e.rstrip(b"\n") for e in events])
    assert back is not None
    assert json.loads(back) == _normalised(answer, include_usage)


def _head(answer: dict) -> dict:
    head = {k: v for k, v in answer.items() if k not in ("choices", "usage")}
    head["object"] = "chat.completion.chunk"
    return head


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(words, min_size=1, max_size=3), include_usage=st.booleans())
def test_replay_round_trip_completions_property(texts, include_usage):
    answer = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 5,
        "model": "tiny",
        "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": "stop"} for i, t in enumerate(texts)
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    events = replay_sse(
        "completions", CachedAnswer(json.dumps(answer).encode(), 0.0), include_usage=include_usage
    )
    for event in events[:-1]:
        parsed = json.loads(event[6:])
        assert parsed["object"] == "text_completion"
        # The SDK's Completion type (streamed chunks too) types finish_reason without None.
        if parsed["choices"] and parsed["choices"][0]["finish_reason"] is not None:
            openai.types.Completion.model_validate(parsed)
    assert json.loads(answer_from_stream("completions", events)) == _normalised(answer, include_usage)


def test_replay_splits_content_into_a_few_deltas():
    text = "The capital of France is Paris, which is also its largest city by far."
    events = replay_sse("chat", CachedAnswer(chat_answer("stop", content=text), 0.0), include_usage=False)
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    pieces = [d["content"] for d in deltas[1:] if d.get("content")]
    assert 2 <= len(pieces) <= 4 and "".join(pieces) == text
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"


# ---- in-process exact cache --------------------------------------------------------------------
def answer(size: int, tag: str = "x") -> CachedAnswer:
    return CachedAnswer(body=(tag * size).encode()[:size], created_at=123.0)


def test_in_process_ttl_and_delete():
    clock = Clock()
    cache = InProcessExactCache(clock=clock)

    async def go():
        await cache.put(b"k", answer(10), ttl_s=5)
        assert (await cache.get(b"k")).body == b"x" * 10
        clock.now += 4.99
        assert await cache.get(b"k") is not None
        clock.now += 0.02
        assert await cache.get(b"k") is None and len(cache) == 0 and cache.bytes == 0
        await cache.put(b"k", answer(10), ttl_s=5)
        assert await cache.delete(b"k") and not await cache.delete(b"k")
        await cache.put(b"z", answer(10), ttl_s=0)  # no TTL: not stored
        assert await cache.get(b"z") is None

    run(go())


def test_in_process_byte_bound_is_lru():
    size = 1000
    per_entry = size + 1 + 160  # body + key + the documented overhead
    cache = InProcessExactCache(max_bytes=3 * per_entry, max_entry_bytes=size, clock=Clock())

    async def go():
        for k in (b"a", b"b", b"c"):
            await cache.put(k, answer(size, k.decode()), ttl_s=60)
        assert await cache.get(b"a") is not None  # a is now the most recent
        await cache.put(b"d", answer(size, "d"), ttl_s=60)
        assert await cache.get(b"b") is None  # the least recently used went
        assert all([await cache.get(k) is not None for k in (b"a", b"c", b"d")])
        assert cache.bytes <= cache.max_bytes
        await cache.put(b"e", answer(size + 1), ttl_s=60)  # over max_entry_bytes
        assert await cache.get(b"e") is None and len(cache) == 3

    run(go())


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "delete", "tick"]),
        st.sampled_from([b"k1", b"k2", b"k3", b"k4", b"k5"]),
        st.integers(0, 700),
        st.floats(0.5, 20),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_in_process_matches_a_reference_lru_property(ops):
    clock = Clock()
    max_bytes, max_entry = 2000, 600
    cache = InProcessExactCache(max_bytes=max_bytes, max_entry_bytes=max_entry, clock=clock)
    model: OrderedDict[bytes, tuple[bytes, float, int]] = OrderedDict()

    async def go():
        for op, key, size, t in ops:
            if op == "tick":
                clock.now += t
            elif op == "put":
                body = (key * size)[:size]
                await cache.put(key, CachedAnswer(body, 0.0), ttl_s=t)
                cost = size + len(key) + 160
                if size <= max_entry and cost <= max_bytes:
                    model.pop(key, None)
                    model[key] = (body, clock.now + t, cost)
                    while sum(c for _, _, c in model.values()) > max_bytes:
                        model.popitem(last=False)
            elif op == "get":
                got = await cache.get(key)
                expected = model.get(key)
                if expected is not None and expected[1] <= clock.now:
                    model.pop(key)
                    expected = None
                if expected is not None:
                    model.move_to_end(key)
                assert (got.body if got else None) == (expected[0] if expected else None)
            else:
                assert await cache.delete(key) == (model.pop(key, None) is not None)
            assert cache.bytes == sum(c for _, _, c in model.values()) <= max_bytes

    run(go())


# ---- Redis exact cache -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


def test_redis_round_trip_ttl_and_prefixes(redis_url):
    async def go():
        client = aioredis.Redis.from_url(redis_url)
        try:
            cache = RedisExactCache(client, prefix="t1:", timeout_s=5)
            other = RedisExactCache(client, prefix="t2:", timeout_s=5)
            stored = CachedAnswer(body=chat_answer("stop"), created_at=1700000123.25)
            key = b"\x00\x01key-bytes\xff"
            assert await cache.get(key) is None
            await cache.put(key, stored, ttl_s=30)
            assert await cache.get(key) == stored
            assert await other.get(key) is None  # another key space
            ttl_ms = await client.pttl(b"t1:" + key.hex().encode())
            assert 0 < ttl_ms <= 30_000
            await cache.put(b"short", stored, ttl_s=0.05)
            await asyncio.sleep(0.3)
            assert await cache.get(b"short") is None  # Redis expired it
            assert await cache.delete(key) and not await cache.delete(key)
            small = RedisExactCache(client, prefix="t3:", max_entry_bytes=10, timeout_s=5)
            await small.put(b"big", stored, ttl_s=30)
            assert await small.get(b"big") is None
            await client.set(b"t1:" + b"bad".hex().encode(), b"\x09garbage-format")
            assert await cache.get(b"bad") is None  # another format: a miss
            assert cache.failures == 0
            # After a failure Redis is skipped for retry_after_s, then used again.
            flaky = RedisExactCache(client, prefix="t1:", timeout_s=5, retry_after_s=0.1)
            await cache.put(key, stored, ttl_s=30)
            flaky._failed("GET", OSError("simulated"))
            assert await flaky.get(key) is None and flaky.skipped == 1
            await asyncio.sleep(0.15)
            assert await flaky.get(key) == stored
        finally:
            await client.aclose()

    run(go())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_is_a_miss():
    async def go():
        client = aioredis.Redis(host="127.0.0.1", port=_closed_port(), socket_connect_timeout=1)
        try:
            cache = RedisExactCache(client, timeout_s=1, retry_after_s=0)
            assert await cache.get(b"k") is None
            await cache.put(b"k", CachedAnswer(b"{}", 0.0), ttl_s=10)  # no exception
            assert await cache.delete(b"k") is False
            assert cache.failures == 3 and cache.skipped == 0
            # With the default back-off, one failure and Redis is left alone for a while.
            backing_off = RedisExactCache(client, timeout_s=1, retry_after_s=60)
            assert await backing_off.get(b"k") is None
            assert await backing_off.get(b"k") is None
            await backing_off.put(b"k", CachedAnswer(b"{}", 0.0), ttl_s=10)
            assert await backing_off.delete(b"k") is False
            assert backing_off.failures == 1 and backing_off.skipped == 3
        finally:
            await client.aclose()

    run(go())


def test_redis_stopped_mid_life_is_a_miss():
    async def go():
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(redis_server())
            client = aioredis.Redis.from_url(url, socket_connect_timeout=1)
            try:
                cache = RedisExactCache(client, timeout_s=1, retry_after_s=0)
                await cache.put(b"k", CachedAnswer(b"{}", 0.0), ttl_s=10)
                assert await cache.get(b"k") is not None
                stack.close()  # the server stops under a connected client
                assert await cache.get(b"k") is None
                await cache.put(b"k", CachedAnswer(b"{}", 0.0), ttl_s=10)
                assert cache.failures == 2
            finally:
                await client.aclose()

    run(go())


@contextlib.contextmanager
def silent_server():
    """A TCP server on loopback that accepts and never answers (a hung Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                conns.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for c in conns:
            c.close()
        server.close()


def test_redis_hung_is_a_miss_within_the_timeout():
    async def go(port):
        client = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            cache = RedisExactCache(client, timeout_s=0.2, retry_after_s=0)
            assert await cache.get(b"k") is None
            await cache.put(b"k", CachedAnswer(b"{}", 0.0), ttl_s=10)
            assert await cache.delete(b"k") is False
            assert cache.failures == 3
        finally:
            await client.aclose()

    with silent_server() as port:
        run(go(port))


# ---- semantic cache ----------------------------------------------------------------------------
def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v)


def basis(i: int, dim: int = 16) -> np.ndarray:
    v = np.zeros(dim, np.float32)
    v[i] = 1
    return v


def near(v: np.ndarray, cos: float, j: int) -> np.ndarray:
    """A unit vector at cosine `cos` from unit vector v (tilted towards basis j, orthogonal to v)."""
    w = basis(j, len(v))
    w = w - (w @ v) * v
    w /= np.linalg.norm(w)
    return unit(cos * v + np.sqrt(1 - cos * cos) * w)


def test_semantic_hit_miss_and_threshold():
    cache = SemanticCache(clock=Clock())
    a = CachedAnswer(chat_answer("stop"), 1.0)

    async def go():
        v = basis(0)
        entry = await cache.insert("t1", b"s", v, a)
        hit = await cache.lookup("t1", b"s", v, 0.92)
        assert hit is not None and hit.answer == a and hit.entry_id == entry and hit.score == pytest.approx(1)
        assert (await cache.lookup("t1", b"s", near(v, 0.95, 3), 0.92)).score == pytest.approx(0.95, abs=1e-5)
        assert await cache.lookup("t1", b"s", near(v, 0.90, 3), 0.92) is None
        assert await cache.lookup("t1", b"s", near(v, 0.90, 3), 0.89) is not None  # per-route threshold
        assert await cache.lookup("t1", b"s", basis(1), 0.5) is None
        assert await cache.lookup("t1", b"s", 3 * v, 0.99) is not None  # queries are normalised
        assert await cache.lookup("t1", b"s", np.zeros(16), 0.5) is None
        assert await cache.lookup("t1", b"s", basis(0, 8), 0.5) is None  # another dimension
        with pytest.raises(ValueError):
            await cache.insert("t1", b"s", basis(0, 8), a)
        with pytest.raises(ValueError):
            await cache.insert("t1", b"s", np.full(16, np.nan), a)
        with pytest.raises(ValueError):
            await cache.lookup("t1", b"s", v, 1.5)

    run(go())


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "t2"},
        {"model": "chat@v2"},
        {"template": "faq@2"},
        {"body": {"response_format": {"type": "json_object"}}},
        {"body": {"temperature": 0.7}},
        {"body": {"max_tokens": 10}},
        {"body": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}},
        {"earlier_turn": "Hello there"},
        {"system": "You are a pirate."},
    ],
)
def test_semantic_never_hits_another_scope(change):
    """The same question (same vector) under a different tenant, model version, template
    version, response_format, sampling parameter, tool list or conversation is a miss."""
    cache = SemanticCache(clock=Clock())
    v = unit(np.arange(1, 17))
    stored = keys_of(chat_body(), template="faq@1")
    body = {**chat_body(), **change.get("body", {})}
    if "earlier_turn" in change:
        body["messages"][1]["content"] = change["earlier_turn"]
    if "system" in change:
        body["messages"][0]["content"] = change["system"]
    kwargs = {"template": change.get("template", "faq@1")}
    for k in ("tenant", "model"):
        if k in change:
            kwargs[k] = change[k]
    asked = keys_of(body, **kwargs)
    assert asked.text == stored.text and asked.scope != stored.scope

    async def go():
        await cache.insert("t1", stored.scope, v, CachedAnswer(b"{}", 0.0))
        assert await cache.lookup("t1", stored.scope, v, 0.92) is not None
        assert await cache.lookup(kwargs.get("tenant", "t1"), asked.scope, v, 0.92) is None

    run(go())


def _property_cache(clock=None) -> SemanticCache:
    # A tiny IVF threshold, so the property runs over the IVF path and rebuilds too.
    return SemanticCache(clock=clock or Clock(), index_factory=lambda d: VectorIndex(d, ivf_threshold=16))


TENANTS = ["tenant-a", "tenant-b", "tenant-c"]
SCOPES = [b"s1", b"s2", b"s3"]
POOL = [unit(np.random.default_rng(i).standard_normal(8)) for i in range(6)]
semantic_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lookup", "evict"]),
        st.sampled_from(TENANTS),
        st.sampled_from(SCOPES),
        st.integers(0, len(POOL) - 1),
        st.sampled_from(TENANTS),
    ),
    min_size=1,
    max_size=80,
)


async def _check_isolation(cache: SemanticCache, ops, owner_of: dict[str, tuple[str, bytes, int]]) -> None:
    """Runs (op, tenant, scope, pool index, other tenant) tuples against `cache`, checking each
    answer against `owner_of` (entry id -> (tenant, scope, pool index)), the reference model."""
    for op, tenant, scope, vi, other in ops:
        v = POOL[vi]
        if op == "insert":
            entry_id = await cache.insert(
                tenant, scope, v, CachedAnswer(f"{tenant}|{scope!r}|{vi}".encode(), 0)
            )
            assert tenant not in entry_id and entry_id not in owner_of
            owner_of[entry_id] = (tenant, scope, vi)
        elif op == "lookup":
            hit = await cache.lookup(tenant, scope, v, -1.0)  # any neighbour of its own
            mine = [e for e, (t, s, _) in owner_of.items() if (t, s) == (tenant, scope)]
            if hit is None:
                assert not mine
                continue
            assert owner_of[hit.entry_id][:2] == (tenant, scope)
            assert hit.answer.body.startswith(f"{tenant}|{scope!r}|".encode())
            # The best neighbour: an identical vector when this owner stored one.
            if any(owner_of[e][2] == vi for e in mine):
                assert hit.score >= 0.999
        else:
            victims = [e for e, (t, s, _) in owner_of.items() if (t, s) == (tenant, scope)]
            if not victims:
                assert not await cache.evict(tenant, "sc-0000000000000001")
                continue
            victim = victims[0]
            if other != tenant:
                assert not await cache.evict(other, victim)
                assert victim in owner_of
            else:
                assert await cache.evict(tenant, victim)
                assert not await cache.evict(tenant, victim)
                del owner_of[victim]
    for t in TENANTS:
        assert cache.entries(t) == sum(1 for o in owner_of.values() if o[0] == t)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=semantic_ops)
def test_semantic_isolation_property(ops):
    """Never a hit across tenants or scopes, even for the identical vector and scope bytes; an
    entry always finds itself; evict by another tenant fails and leaves the entry."""
    run(_check_isolation(_property_cache(), ops, {}))


def _random_ops(rnd: np.random.Generator, n: int) -> list[tuple[str, str, bytes, int, str]]:
    kinds = ["insert", "insert", "lookup", "evict"]
    return [
        (
            kinds[rnd.integers(len(kinds))],
            TENANTS[rnd.integers(3)],
            SCOPES[rnd.integers(2)],  # two scopes: each owner outgrows the IVF threshold
            int(rnd.integers(len(POOL))),
            TENANTS[rnd.integers(3)],
        )
        for _ in range(n)
    ]


def test_semantic_isolation_through_ivf_rebuilds():
    """The same checks over long seeded runs whose indexes grow into IVF and rebuild while the
    checks go on (and once more after the rebuilds settled)."""
    builds = 0
    for seed in range(4):
        rnd = np.random.default_rng(seed)
        cache = _property_cache()
        owner_of: dict[str, tuple[str, bytes, int]] = {}

        async def go(cache, owner_of, rnd):
            for _ in range(6):
                await _check_isolation(cache, _random_ops(rnd, 150), owner_of)
            for t in TENANTS:
                for s in SCOPES:
                    index = cache.index(t, s)
                    if index is not None:
                        assert index.wait_idle(60)
            await _check_isolation(cache, _random_ops(rnd, 150), owner_of)

        run(go(cache, owner_of, rnd))
        indexes = [cache.index(t, s) for t in TENANTS for s in SCOPES]
        builds += sum(index.builds for index in indexes if index is not None)
    assert builds > 0  # the IVF path was exercised


def test_semantic_ttl_and_max_entries():
    clock = Clock()
    cache = SemanticCache(max_entries=3, ttl_s=10, clock=clock)

    async def go():
        ids = [await cache.insert("t1", b"s", basis(i), CachedAnswer(b"%d" % i, 0)) for i in range(3)]
        assert cache.entries() == 3
        clock.now += 5
        await cache.insert("t2", b"s", basis(3), CachedAnswer(b"3", 0))  # evicts the oldest
        assert cache.entries("t1") == 2 and cache.entries("t2") == 1
        assert await cache.lookup("t1", b"s", basis(0), 0.9) is None
        assert (await cache.lookup("t1", b"s", basis(1), 0.9)).entry_id == ids[1]
        clock.now += 5  # t1's entries are 10 s old: expired
        assert await cache.lookup("t1", b"s", basis(1), 0.9) is None
        assert cache.entries("t1") == 1  # the lookup dropped the one it met
        assert cache.expire() == 1 and cache.entries("t1") == 0
        assert cache.index("t1", b"s") is None  # an empty scope's index is dropped
        assert await cache.lookup("t2", b"s", basis(3), 0.9) is not None
        clock.now += 5
        assert cache.expire() == 1 and cache.entries() == 0

    run(go())


def test_semantic_evict_ids():
    cache = SemanticCache(clock=Clock())

    async def go():
        entry = await cache.insert("t1", b"s", basis(0), CachedAnswer(b"a", 0))
        assert not await cache.evict("t2", entry)  # another tenant's report
        assert await cache.lookup("t1", b"s", basis(0), 0.9) is not None
        for bad in ("", "sc-xyz", entry.upper(), entry + "0", "sc-" + "0" * 16):
            assert not await cache.evict("t1", bad)
        assert await cache.evict("t1", entry)
        assert await cache.lookup("t1", b"s", basis(0), 0.9) is None

    run(go())


def test_semantic_lookup_in_a_thread_after_a_bulk_load(monkeypatch):
    """A lookup whose index has many rows to scan exactly runs in a worker thread."""
    from paved.gateway.caching import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_INLINE_EXACT_ROWS", 2)
    seen: list[str] = []
    real = asyncio.to_thread

    async def spy(fn, *args):
        seen.append(fn.__name__)
        return await real(fn, *args)

    monkeypatch.setattr(cache_mod.asyncio, "to_thread", spy)
    cache = SemanticCache(clock=Clock())

    async def go():
        for i in range(4):
            await cache.insert("t1", b"s", basis(i), CachedAnswer(b"%d" % i, 0))
        assert (await cache.lookup("t1", b"s", basis(2), 0.9)).answer.body == b"2"

    run(go())
    assert seen == ["search"]


# ---- the ANN index ------------------------------------------------------------------------------
def clustered(n: int, dim: int, seed: int = 0, topics: int = 20) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(0, topics, n)] + 0.6 * rng.standard_normal((n, dim)).astype(
        np.float32
    ) / np.sqrt(dim)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 5), seed=st.integers(0, 1000), removals=st.integers(0, 50))
def test_exact_phase_matches_brute_force_property(n, k, seed, removals):
    x = clustered(n, 8, seed)
    index = VectorIndex(8, ivf_threshold=10_000)
    index.add(np.arange(n), x)
    gone = set(np.random.default_rng(seed).choice(n, min(removals, n), replace=False).tolist())
    assert index.remove(gone) == len(gone) and index.remove(gone) == 0
    live = np.array(sorted(set(range(n)) - gone), dtype=np.int64)
    q = x[seed % n]
    got = index.search(q, k)
    assert len(index) == len(live) and len(got) == min(k, len(live))
    if len(live):
        scores = x[live] @ q
        expected = np.sort(scores)[::-1][: len(got)]
        assert np.allclose([s for _, s in got], expected, atol=1e-5)
        assert all(i not in gone for i, _ in got)


def test_index_validation():
    index = VectorIndex(4)
    with pytest.raises(ValueError):
        index.add(np.arange(2), np.ones((3, 4)))
    with pytest.raises(ValueError):
        index.add(np.arange(1), np.full((1, 4), np.inf))
    with pytest.raises(ValueError):
        index.add(np.array([1, 1]), np.ones((2, 4)))
    index.add(np.array([1]), unit(np.ones(4)))
    with pytest.raises(ValueError):
        index.add(np.array([1]), unit(np.ones(4)))
    with pytest.raises(ValueError):
        index.search(np.ones(5))
    assert index.search(np.ones(4), 0) == []
    assert len(index) == 1


def test_grows_into_ivf_and_stays_exact_for_stored_vectors():
    x = clustered(6000, 32, seed=3)
    index = VectorIndex(32, ivf_threshold=1000)
    for start in range(0, 6000, 500):
        index.add(np.arange(start, start + 500), x[start : start + 500])
    assert index.wait_idle(120)
    assert index.kind == "ivf" and index.builds >= 2 and 1 <= index.nprobe <= index.nlist
    assert index.nlist == int(4 * np.sqrt(index._trained_n))
    assert index.last_recall >= index.target_recall
    index.remove(range(0, 6000, 3))
    for i in [i for i in range(1, 6000, 37) if i % 3]:
        best = index.search(x[i], 3)
        assert best[0][0] == i or best[0][1] >= 1 - 1e-5, i  # finds itself (or an identical twin)
        assert all(j % 3 != 0 for j, _ in best)
    assert len(index) == 4000


def test_adds_and_removes_during_a_rebuild_are_not_lost():
    """A rebuild held behind a blocking job: adds and removes meanwhile land in the delta and
    the removed set, searches keep working, and the swap keeps all of it."""
    x = clustered(3000, 16, seed=5)
    index = VectorIndex(16, ivf_threshold=500)
    gate = threading.Event()
    ann._REBUILDER.submit(lambda: gate.wait(60))  # occupies the rebuild thread
    try:
        index.add(np.arange(1000), x[:1000])  # triggers a rebuild, queued behind the gate
        assert index.rebuilding and index.kind == "flat"
        index.add(np.arange(1000, 1400), x[1000:1400])
        assert index.remove(range(0, 1400, 7)) == 200
        assert all(j != 700 for j, _ in index.search(x[700], 3))  # removed (a frozen row)
        assert index.search(x[1002], 1)[0][0] == 1002  # added meanwhile (the delta)
    finally:
        gate.set()
    alive = set(range(1400)) - set(range(0, 1400, 7))
    assert index.wait_idle(120) and index.kind == "ivf" and index.builds == 1
    assert len(index) == len(alive)
    # Second round: the IVF part frozen while a rebuild is held.
    gate2 = threading.Event()
    ann._REBUILDER.submit(lambda: gate2.wait(60))
    try:
        index.add(np.arange(1400, 3000), x[1400:3000])  # doubles: a rebuild is queued
        assert index.rebuilding
        assert index.remove(range(1, 3000, 7)) == len(range(1, 3000, 7))
        assert all(j != 1401 for j, _ in index.search(x[1401], 3))
    finally:
        gate2.set()
    alive = (alive | set(range(1400, 3000))) - set(range(1, 3000, 7))
    assert index.wait_idle(120) and index.builds == 2
    assert len(index) == len(alive)
    for i in sorted(alive)[::29]:
        assert index.search(x[i], 1)[0][0] == i
    gone = set(range(3000)) - alive
    for i in sorted(gone)[::5]:
        assert all(j in alive for j, _ in index.search(x[i], 5))


def test_a_failing_rebuild_leaves_the_index_searchable(monkeypatch):
    x = clustered(800, 16, seed=9)
    index = VectorIndex(16, ivf_threshold=200)

    def broken(self, ids, vecs):
        raise RuntimeError("training failed")

    monkeypatch.setattr(VectorIndex, "_build", broken)
    index.add(np.arange(400), x[:400])
    assert index.wait_idle(60) and index.kind == "flat" and not index.rebuilding
    index.add(np.arange(400, 800), x[400:800])  # within the backoff: no new attempt
    index.remove([5])
    assert len(index) == 799 and index.search(x[600], 1)[0][0] == 600
    assert all(j != 5 for j, _ in index.search(x[5], 3))
    monkeypatch.undo()
    index._retry_at = 0.0  # the backoff passed
    index.add(np.array([800]), unit(np.ones(16)).reshape(1, -1))
    assert index.wait_idle(60) and index.kind == "ivf"
    assert len(index) == 800 and all(j != 5 for j, _ in index.search(x[5], 3))
    assert index.search(x[600], 1)[0][0] == 600


def test_recall_on_clustered_data():
    x = clustered(20_000, 32, seed=11, topics=200)
    index = VectorIndex(32, ivf_threshold=4096)
    index.add(np.arange(len(x)), x)
    assert index.wait_idle(120) and index.kind == "ivf"
    rng = np.random.default_rng(12)
    queries = x[rng.integers(0, len(x), 300)] + 0.4 * rng.standard_normal((300, 32)).astype(
        np.float32
    ) / np.sqrt(32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = (queries @ x.T).max(axis=1)
    found = np.array([index.search(q, 1)[0][1] for q in queries])
    assert np.mean(found >= exact - 1e-5) >= 0.97


# -- the query embedding's tokens are the tenant's -------------------------------------------

EMBED_USAGE = {"prompt_tokens": 7, "total_tokens": 7}
BACKEND = {"url": "http://127.0.0.1:9", "version": "v1"}  # never connected to: see FakeEmbedder


class FakeEmbedder(InternalClient):
    """The embedding model's answers (a fixed unit vector, with usage); records each call. No
    HTTP: `_post` is the one method that would reach a backend."""

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        super().__init__(router, lambda: None, metrics)  # type: ignore[arg-type,return-value]
        self.calls: list[tuple[str, str, dict]] = []
        self.usage: dict = EMBED_USAGE

    async def _post(self, purpose: str, model: str, path: str, body: dict, timeout_s: float) -> object:
        self.calls.append((purpose, model, body))
        assert path == "/v1/embeddings"
        return {"data": [{"embedding": [0.6, 0.8, 0.0]}], "usage": self.usage}


def _semantic_gateway(tenant_limits: Limits):
    cache = {"exact": False, "semantic": True, "embedding_model": "emb"}
    router = Router(
        parse_routes(
            {
                "models": [
                    {"alias": "chat", "cache": cache, "backends": [{"id": "c", **BACKEND}]},
                    {"alias": "emb", "kind": "embed", "backends": [{"id": "e", **BACKEND}]},
                ]
            }
        )
    )  # fmt: skip
    metrics = GatewayMetrics()
    internal = FakeEmbedder(router, metrics)
    orchestrator = Orchestrator(
        router=router, tokens=TokenCounter(), metrics=metrics, internal=internal, semantic=SemanticCache()
    )
    principal = Principal("k1", "key", Tenant("t1", "acme", limits=tenant_limits))
    return orchestrator, internal, metrics, principal, InProcessLimiter(clock=lambda: 1000.0)


async def _semantic_lookup(orchestrator, principal, limiter):
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "where is my parcel?"}],
        "temperature": 0,
    }
    route = orchestrator.router.route("chat")
    plan = await orchestrator.prepare(principal, "chat", body, "chat", route, {}, "r1", limiter=limiter)
    assert plan.lookup
    return plan, await orchestrator.lookup(plan)


def _embed_tokens(metrics: GatewayMetrics) -> float | None:
    return metrics.registry.get_sample_value(
        "paved_gateway_tokens_total", {"tenant": "acme", "model": "emb", "kind": "prompt"}
    )


def test_a_semantic_lookup_charges_the_embedding_to_the_tenant():
    orchestrator, internal, metrics, principal, limiter = _semantic_gateway(
        Limits(requests_per_min=5, tokens_per_min=10_000)
    )

    async def go():
        plan, hit = await _semantic_lookup(orchestrator, principal, limiter)
        assert hit is None and plan.vector is not None
        assert [c[:2] for c in internal.calls] == [("embedding", "emb")]
        tenant = (await limiter.snapshot(principal))["tenant"]
        assert tenant["tokens_per_min"]["remaining"] == 10_000 - EMBED_USAGE["prompt_tokens"]
        assert tenant["requests_per_min"]["remaining"] == 5  # not a request of the tenant's
        assert _embed_tokens(metrics) == EMBED_USAGE["prompt_tokens"]

    run(go())


def test_a_tenant_without_tokens_left_gets_no_embedding():
    orchestrator, internal, metrics, principal, limiter = _semantic_gateway(Limits(tokens_per_min=500))

    async def go():
        await limiter.acquire(principal, 500)  # the tenant's minute is spent
        plan, hit = await _semantic_lookup(orchestrator, principal, limiter)
        # A miss without an embedding call (and so nothing to insert on the way back).
        assert hit is None and plan.vector is None and plan.headers["x-paved-cache"] == "miss"
        assert internal.calls == []
        assert (await limiter.snapshot(principal))["tenant"]["tokens_per_min"]["remaining"] == 0
        assert _embed_tokens(metrics) is None

    run(go())


def test_without_a_tokenizer_the_embedding_reserves_a_quarter_of_the_byte_bound():
    # The emb route has no tokenizer: the query's byte bound is 21 ("where is my parcel?" + 2),
    # 3x its 7 tokens. Reserved whole it would not fit in 10 tokens/min; a quarter (6) does, and
    # the settle charges the 7 the model reported.
    orchestrator, internal, _metrics, principal, limiter = _semantic_gateway(Limits(tokens_per_min=10))

    async def go():
        plan, hit = await _semantic_lookup(orchestrator, principal, limiter)
        assert hit is None and plan.vector is not None and len(internal.calls) == 1
        tenant = (await limiter.snapshot(principal))["tenant"]
        assert tenant["tokens_per_min"]["remaining"] == 10 - EMBED_USAGE["prompt_tokens"]

    run(go())


def test_a_negative_reported_usage_is_ignored_not_a_failure():
    orchestrator, internal, metrics, principal, limiter = _semantic_gateway(Limits(tokens_per_min=1000))
    internal.usage = {"prompt_tokens": -3, "total_tokens": -3}

    async def go():
        plan, hit = await _semantic_lookup(orchestrator, principal, limiter)
        # As if no usage was reported: the lookup goes on and the reservation (6) stays charged.
        assert hit is None and plan.vector is not None
        tenant = (await limiter.snapshot(principal))["tenant"]
        assert tenant["tokens_per_min"]["remaining"] == 1000 - 6
        assert _embed_tokens(metrics) is None

    run(go())


# -- entry ids: signed per tenant --------------------------------------------------------------

TENANT_NAMES = st.from_regex(TENANT_NAME_RE, fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    tenants=st.lists(TENANT_NAMES, min_size=2, max_size=4, unique=True),
    keys=st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=3),
    numbers=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=3),
    position=st.integers(0, 10**6),
)
def test_entry_ids_open_only_for_their_tenant_and_cannot_be_forged(tenants, keys, numbers, position):
    ids = EntryIds()
    for tenant in tenants:
        signed = [(ids.exact(tenant, k), "exact_key", k) for k in keys]
        signed += [(ids.semantic(tenant, f"sc-{n:016x}"), "semantic_id", f"sc-{n:016x}") for n in numbers]
        for entry, field, value in signed:
            assert EntryIds.well_formed(entry)
            opened = ids.open(tenant, entry)
            assert opened is not None and getattr(opened, field) == value
            for other in tenants:
                if other != tenant:
                    assert ids.open(other, entry) is None
            # Any one character changed (a flipped MAC or payload digit) opens nothing.
            i = entry.index(":") + 1 + position % (len(entry) - entry.index(":") - 1)
            if entry[i] != ".":
                changed = entry[:i] + ("0" if entry[i] != "0" else "1") + entry[i + 1 :]
                assert ids.open(tenant, changed) is None
        for k in keys:
            # What a tenant can compute (the key of a request it guesses another made) with any
            # MAC of its choosing, or the MAC of another secret, is not an id.
            assert ids.open(tenant, f"e:{k.hex()}.{hashlib.sha256(k).hexdigest()}") is None
            assert ids.open(tenant, EntryIds().exact(tenant, k)) is None
            assert ids.open(tenant, "e:" + k.hex()) is None and not EntryIds.well_formed("e:" + k.hex())


def test_replicas_on_one_store_share_the_entry_secret(tmp_path):
    async def go():
        stores = [GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}") for _ in range(2)]
        ids = [EntryIds(s) for s in stores]
        try:
            await asyncio.gather(*(i.start() for i in ids))
            entry = ids[0].exact("acme", b"k" * 32)
            assert ids[1].exact("acme", b"k" * 32) == entry
            assert ids[1].open("acme", entry).exact_key == b"k" * 32
            assert ids[1].open("other", entry) is None
            # A restart reads the same secret; a process without a store has its own.
            again = EntryIds(stores[0])
            await again.start()
            assert again.open("acme", entry) is not None and EntryIds().open("acme", entry) is None
            assert again._secret is not None and again._secret.hex() not in repr(again)
        finally:
            for s in stores:
                await s.close()

    run(go())


def _false_hit_gateway(tmp_path):
    """A gateway app (no backend: nothing here reaches one) with an in-process exact cache and
    tenants acme and rival, each with a key."""
    store = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    router = Router(parse_routes({"models": [{"alias": "chat", "backends": [{"id": "c", **BACKEND}]}]}))
    metrics = GatewayMetrics()
    authenticator = Authenticator(store, cache_s=0)
    limiter = InProcessLimiter()
    proxy = OpenAIProxy(
        authenticator=authenticator, limiter=limiter, router=router, metrics=metrics,
        tokens=TokenCounter(), config=ProxyConfig(),
    )  # fmt: skip
    orchestrator = Orchestrator(
        router=router, tokens=proxy.tokens, metrics=metrics,
        internal=InternalClient(router, lambda: proxy.session, metrics),
        exact=InProcessExactCache(), semantic=SemanticCache(), entry_ids=EntryIds(store),
    )  # fmt: skip
    proxy.orchestrator = orchestrator
    gateway = Gateway(
        store=store, authenticator=authenticator, admin=AdminAuth("adm-" + "x" * 32), limiter=limiter,
        router=router, proxy=proxy, metrics=metrics, orchestrator=orchestrator,
    )  # fmt: skip
    return gateway, create_app(gateway, manage_lifespan=False)


def test_false_hit_answers_another_tenants_entry_like_an_unknown_one(tmp_path):
    async def go():
        gateway, app = _false_hit_gateway(tmp_path)
        await gateway.start()
        try:
            keys = {}
            for name in ("acme", "rival"):
                await gateway.store.create_tenant(name)
                keys[name] = (await gateway.store.create_key(name))[1]
            orchestrator = gateway.orchestrator
            body = {"messages": [{"role": "user", "content": "my secret question"}], "temperature": 0}
            key = cache_keys(tenant="acme", model="chat@v1", template=None, endpoint="chat", body=body).exact
            await orchestrator.exact.put(key, CachedAnswer(b"{}", 0.0), 60)
            vector = np.array([1.0, 0.0, 0.0], dtype=np.float32)
            semantic = orchestrator.entry_ids.semantic(
                "acme", await orchestrator.semantic.insert("acme", b"scope", vector, CachedAnswer(b"{}", 0.0))
            )
            exact = orchestrator.entry_ids.exact("acme", key)  # what acme's hit carried
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:

                async def report(tenant, entry):
                    r = await client.post(
                        "/v1/cache/false_hit",
                        json={"entry": entry},
                        headers={"Authorization": f"Bearer {keys[tenant]}"},
                    )
                    return r.status_code, r.json()

                unknown = await report("rival", orchestrator.entry_ids.exact("rival", b"u" * 32))
                assert unknown[0] == 404
                assert "0x" not in json.dumps(unknown)
                # acme's own ids, the key rival can compute with any MAC: all exactly unknown.
                forged = f"e:{key.hex()}.{hashlib.sha256(key).hexdigest()}"
                for entry in (exact, semantic, forged):
                    assert await report("rival", entry) == unknown
                assert await orchestrator.exact.get(key) is not None
                assert orchestrator.semantic.entries("acme") == 1
                # The bare key (the old id format) is not an id at all: a 400, whoever sends it.
                assert (await report("rival", "e:" + key.hex()))[0] == 400
                # acme may evict its own, once.
                assert await report("acme", exact) == (200, {"entry": exact, "evicted": True})
                assert await orchestrator.exact.get(key) is None
                assert (await report("acme", exact))[1] == unknown[1]
                assert await report("acme", semantic) == (200, {"entry": semantic, "evicted": True})
                assert orchestrator.semantic.entries("acme") == 0
        finally:
            await gateway.stop()

    run(go())
