"""The semantic cache on the request path: a misbehaving embedding backend is a miss, never a
failed request; the route's `ttl_s` is what a semantic entry lives; and the entries' bodies are
bounded in bytes, not only in number.

The gateway runs in-process (ASGI) in front of a real loopback HTTP server that plays the chat
model and the embedding model, so the embedding answers reach the gateway through aiohttp as a
backend's would: a 200 whose body is not JSON, a JSON body that is not an object, and a body cut
off before its Content-Length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web

from paved.gateway.access.auth import AdminAuth, Authenticator
from paved.gateway.access.limits import InProcessLimiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.app import Gateway, create_app
from paved.gateway.caching.ann import FIRST_BLOCK_ROWS, VectorIndex
from paved.gateway.caching.cache import CachedAnswer, SemanticCache
from paved.gateway.forwarding.proxy import OpenAIProxy, ProxyConfig
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.orchestrate import InternalClient, Orchestrator
from paved.gateway.orchestration.tokens import TokenCounter
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import parse_routes

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "chat",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "in transit"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}
GOOD_EMBEDDING = {"data": [{"embedding": [0.6, 0.8, 0.0]}], "usage": {"prompt_tokens": 3, "total_tokens": 3}}


class Backend:
    """The chat model and the embedding model on one loopback server; `mode` picks how the
    embedding endpoint answers."""

    def __init__(self) -> None:
        self.mode = "good"
        self.chat_calls = 0
        self.embed_calls = 0
        self.release = asyncio.Event()  # ends the "hang" mode's answers (set at teardown)

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.chat_calls += 1
        return web.json_response(ANSWER)

    async def embed(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.embed_calls += 1
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "not_json":
            return web.Response(body=b"<html>bad gateway</html>", content_type="application/json")
        if self.mode == "not_an_object":
            return web.json_response([1, 2, 3])
        if self.mode == "truncated":
            resp = web.StreamResponse(headers={"Content-Length": "1000", "Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"data": [')
            assert request.transport is not None
            request.transport.close()
            return resp
        return web.json_response(GOOD_EMBEDDING)


@contextlib.asynccontextmanager
async def _gateway(
    tmp_path, *, ttl_s: float = 3600.0, semantic: SemanticCache | None = None, embed_timeout_s: float = 5.0
) -> AsyncIterator[Any]:
    backend = Backend()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", backend.chat)
    app.router.add_post("/v1/embeddings", backend.embed)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    cache = {"exact": False, "semantic": True, "embedding_model": "emb", "ttl_s": ttl_s}
    router = Router(
        parse_routes(
            {
                "models": [
                    {"alias": "chat", "cache": cache, "backends": [{"id": "c", "url": url, "version": "v1"}]},
                    {"alias": "emb", "kind": "embed", "backends": [
                        {"id": "e1", "url": url, "version": "v1"},
                        {"id": "e2", "url": url, "version": "v1"},
                    ]},
                ]
            }
        )
    )  # fmt: skip
    store = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
    metrics = GatewayMetrics()
    authenticator = Authenticator(store, cache_s=0)
    limiter = InProcessLimiter()
    proxy = OpenAIProxy(
        authenticator=authenticator, limiter=limiter, router=router, metrics=metrics,
        tokens=TokenCounter(), config=ProxyConfig(),
    )  # fmt: skip
    orchestrator = Orchestrator(
        router=router, tokens=proxy.tokens, metrics=metrics,
        internal=InternalClient(router, lambda: proxy.session, metrics, embed_timeout_s=embed_timeout_s),
        semantic=semantic if semantic is not None else SemanticCache(),
    )  # fmt: skip
    proxy.orchestrator = orchestrator
    gateway = Gateway(
        store=store, authenticator=authenticator, admin=AdminAuth("adm-" + "x" * 32), limiter=limiter,
        router=router, proxy=proxy, metrics=metrics, orchestrator=orchestrator,
    )  # fmt: skip
    await gateway.start()
    try:
        await store.create_tenant("acme")
        key = (await store.create_key("acme"))[1]
        transport = httpx.ASGITransport(
            app=create_app(gateway, manage_lifespan=False), raise_app_exceptions=False
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:

            async def ask(question: str = "where is my parcel?") -> httpx.Response:
                return await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "chat",
                        "messages": [{"role": "user", "content": question}],
                        "temperature": 0,
                    },
                    headers={"Authorization": f"Bearer {key}"},
                )

            yield backend, orchestrator, ask
    finally:
        backend.release.set()
        await gateway.stop()
        await runner.cleanup()


@pytest.mark.parametrize("mode", ["not_json", "not_an_object", "truncated"])
def test_a_broken_embedding_answer_is_a_miss_not_a_500(tmp_path, mode):
    async def go():
        async with _gateway(tmp_path) as (backend, _, ask):
            backend.mode = mode
            r = await ask()
            assert r.status_code == 200, r.text
            assert r.headers["x-paved-cache"] == "miss"
            assert r.json()["choices"][0]["message"]["content"] == "in transit"
            assert backend.embed_calls >= 1 and backend.chat_calls == 1

    asyncio.run(go())


def test_an_embedding_past_its_deadline_is_not_tried_again_on_another_backend(tmp_path):
    """The embedding deadline bounds the lookup: a call that ran out of time is a miss, not a
    second call (and a second deadline) on the alias's other backend. TimeoutError is an
    OSError, so the connection-error branch used to take it and retry."""

    async def go():
        async with _gateway(tmp_path, embed_timeout_s=0.3) as (backend, _, ask):
            backend.mode = "hang"
            r = await ask()
            assert r.status_code == 200, r.text
            assert r.headers["x-paved-cache"] == "miss"
            assert backend.embed_calls == 1

    asyncio.run(go())


def test_the_routes_ttl_bounds_a_semantic_entry(tmp_path):
    """A route's cache ttl_s of 60 s: a semantic entry stored under it is not served after 60 s,
    although the cache's own default TTL (an hour) has not run out."""
    now = [1000.0]
    semantic = SemanticCache(clock=lambda: now[0])

    async def go():
        async with _gateway(tmp_path, ttl_s=60.0, semantic=semantic) as (backend, _, ask):
            assert (await ask()).headers["x-paved-cache"] == "miss"
            assert semantic.entries("acme") == 1
            now[0] += 30
            hit = await ask()
            assert hit.headers["x-paved-cache"].startswith("semantic;"), hit.headers
            assert backend.chat_calls == 1
            now[0] += 31  # 61 s after it was stored
            late = await ask()
            assert late.headers["x-paved-cache"] == "miss"
            assert backend.chat_calls == 2

    asyncio.run(go())


def _answer(size: int) -> CachedAnswer:
    return CachedAnswer(b"x" * size, 0.0)


def _vector(i: int) -> np.ndarray:
    """One of many near-orthogonal questions (64 dimensions, seeded by `i`)."""
    return np.random.default_rng(i).standard_normal(64).astype(np.float32)


def test_semantic_entries_are_bounded_in_bytes():
    """Entries are dropped oldest first once their bodies pass max_bytes, and an answer larger
    than max_entry_bytes is not kept: the entry count alone left memory to the answers' sizes
    (a million entries of a 64 KiB answer each is 64 GiB)."""
    cache = SemanticCache(max_entries=1000, max_bytes=100_000, max_entry_bytes=30_000)

    async def go():
        ids = [await cache.insert("t", b"scope", _vector(i), _answer(20_000)) for i in range(10)]
        assert cache.bytes <= 100_000
        assert cache.entries() < 10
        # The newest is always kept and findable; the oldest went first.
        hit = await cache.lookup("t", b"scope", _vector(9), 0.999)
        assert hit is not None and hit.entry_id == ids[-1]
        assert await cache.lookup("t", b"scope", _vector(0), 0.999) is None
        before = cache.entries()
        assert await cache.insert("t", b"scope", _vector(11), _answer(30_001)) is None
        assert cache.entries() == before
        for entry_id in ids:
            assert entry_id is not None
            await cache.evict("t", entry_id)
        assert cache.entries() == 0 and cache.bytes == 0

    asyncio.run(go())


def test_semantic_memory_counts_vectors_and_indexes_not_only_answers():
    """Small answers in many scopes, or under wide embeddings, are bounded by max_bytes too:
    the bound once counted bodies alone, so a million 384-dimension vectors (1.5 GiB) or a
    million one-entry scopes (each index's first block) sat outside the 1 GiB it promised."""
    max_bytes = 400_000
    cache = SemanticCache(max_entries=1_000_000, max_bytes=max_bytes)
    wide = 1024  # 4 KiB a vector

    async def go():
        for i in range(200):  # a scope each: its index and first block are paid for
            assert await cache.insert("t", b"scope-%d" % i, _vector(i), _answer(10)) is not None
            assert cache.bytes <= max_bytes
        scopes = cache.entries()
        assert 0 < scopes < 200  # the oldest scopes went to keep the bound
        assert cache.index("t", b"scope-0") is None and cache.index("t", b"scope-199") is not None
        for i in range(400):
            v = np.random.default_rng(i).standard_normal(wide).astype(np.float32)
            assert await cache.insert("u", b"wide", v, _answer(10)) is not None
            assert cache.bytes <= max_bytes
        # Each wide vector counts at least its own 4 KiB.
        assert cache.entries("u") * 4 * wide <= max_bytes
        hit = await cache.lookup("u", b"wide", v, 0.999)
        assert hit is not None  # the newest is kept
        while cache.entries():
            cache._drop(next(iter(cache._entries)))
        assert cache.bytes == 0  # every index's cost went with its last entry

    asyncio.run(go())


def test_a_scope_filled_then_emptied_gives_its_memory_back():
    """Evicting (false-hit reports) or expiring most of a scope frees the index's rows: an exact
    part once kept its peak first block (4,096 rows) for one live entry, which the byte count
    could not see, so fill-and-evict over many scopes grew memory past max_bytes."""
    cache = SemanticCache(max_bytes=1 << 30)

    async def go():
        ids = [await cache.insert("t", b"s", _vector(i), _answer(10)) for i in range(5000)]
        for entry_id in ids[:-1]:
            assert await cache.evict("t", entry_id)
        index = cache.index("t", b"s")
        assert index is not None and len(index) == 1
        assert index.rows_held <= 3 * len(index) + FIRST_BLOCK_ROWS, index.rows_held
        assert await cache.lookup("t", b"s", _vector(4999), 0.999) is not None

    asyncio.run(go())


def test_an_ivf_index_that_shrank_is_rebuilt_compact():
    index = VectorIndex(16, ivf_threshold=16)
    try:
        vectors = np.random.default_rng(7).standard_normal((300, 16)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        index.add(np.arange(300), vectors)
        assert index.wait_idle(60) and index.kind == "ivf"
        builds = index.builds
        index.remove(range(250))
        assert index.wait_idle(60)
        assert index.builds > builds  # below two thirds of its build: rebuilt
        assert index.rows_held <= 3 * len(index), index.rows_held
        for i in (250, 299):
            assert index.search(vectors[i], 1)[0][0] == i
        index.remove(range(250, 300))
        assert index.wait_idle(60) and index.kind == "flat" and index.rows_held == 0
    finally:
        index.close()


def test_semantic_ttl_per_entry_expires_in_time_order():
    """Entries with different TTLs (two routes) expire by their own deadline, whatever their
    insertion order, and expire() frees them without a lookup meeting them."""
    now = [0.0]
    cache = SemanticCache(ttl_s=3600.0, clock=lambda: now[0])

    async def go():
        long = await cache.insert("t", b"a", _vector(1), _answer(10), ttl_s=600.0)
        short = await cache.insert("t", b"b", _vector(2), _answer(10), ttl_s=60.0)
        default = await cache.insert("t", b"c", _vector(3), _answer(10))
        assert None not in (long, short, default)
        now[0] = 61.0
        assert cache.expire() == 1
        assert cache.entries() == 2
        assert await cache.lookup("t", b"b", _vector(2), 0.999) is None
        assert (await cache.lookup("t", b"a", _vector(1), 0.999)) is not None
        now[0] = 601.0
        assert cache.expire() == 1
        assert (await cache.lookup("t", b"c", _vector(3), 0.999)) is not None
        now[0] = 3601.0
        assert cache.expire() == 1
        assert cache.entries() == 0 and cache.bytes == 0
        with pytest.raises(ValueError):
            await cache.insert("t", b"a", _vector(1), _answer(10), ttl_s=0.0)

    asyncio.run(go())


def test_the_expiry_heap_stays_bounded_under_evictions():
    """Entries dropped by the entry bound or evicted leave no deadline behind for long: the
    expiry bookkeeping stays proportional to the live entries."""
    cache = SemanticCache(max_entries=10, ttl_s=3600.0, clock=lambda: 0.0)

    async def go():
        for i in range(5000):
            await cache.insert("t", bytes([i % 7]), _vector(i), _answer(10))
        assert cache.entries() == 10
        assert len(cache._expiry) <= 4 * cache.entries() + 64

    asyncio.run(go())


def test_answers_stored_through_the_gateway_count_their_bytes(tmp_path):
    semantic = SemanticCache(max_bytes=1 << 20)

    async def go():
        async with _gateway(tmp_path, semantic=semantic) as (_, _orchestrator, ask):
            r = await ask()
            assert r.status_code == 200
            assert semantic.entries("acme") == 1
            assert semantic.bytes >= len(json.dumps(ANSWER).encode())

    asyncio.run(go())
