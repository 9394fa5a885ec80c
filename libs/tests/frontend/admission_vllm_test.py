"""Admission under heavy constraints, against the real frontend over a real vLLM engine.

The frontend app and its VllmEngine run on one event loop in a background thread (so the test
can reach the engine's RPCs); requests go over HTTP on loopback. What is shown here as states,
never as timings of the machine:
  * a lone UTF-16 surrogate anywhere in a body is a 400 naming the field (was a 500);
  * a 50k-value enum is served by paved's catalogue engine (was: over the DFA cap, then an
    xgrammar compile of ~20-50 s);
  * while a request's constraint is still compiling, other requests are admitted, run and
    complete, and a request that is already decoding keeps producing tokens: the compile
    runs before the request joins the batch, not on the engine's step thread.
"""

from paved.engine import vllm_env

# Before vllm is imported anywhere (and at module top: vLLM's engine core uses spawn).
vllm_env.apply_defaults()

import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402

from paved.constraints import spec as specs  # noqa: E402
from paved.engine.vllm_config import VllmModelConfig  # noqa: E402
from paved.engine.vllm_engine import VllmEngine  # noqa: E402
from paved.frontend.app import create_app  # noqa: E402
from paved.frontend.registry import ModelRegistry  # noqa: E402
from paved.testing.fixtures import tiny_model_dir  # noqa: E402

TIMEOUT_S = 240


class Loop:
    """An event loop in a thread; `run` submits a coroutine and waits (bounded) for it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served():
    engine = VllmEngine(
        VllmModelConfig(
            name="tiny",
            path=tiny_model_dir(),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=8,
            enforce_eager=True,
        )
    )
    app = create_app(ModelRegistry([engine]))
    loop = Loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)

    async def wait_ready():
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(TIMEOUT_S * 10):
                if serving.done():
                    serving.result()  # raises what stopped it
                try:
                    if (await client.get("/health/ready")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("the engine never became ready")

    try:
        loop.run(wait_ready())
        yield engine, url, loop
    finally:
        server.should_exit = True
        try:
            serving.result(timeout=120)
        finally:
            sock.close()
            loop.close()


def _chat(content: str = "hello", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def test_lone_surrogate_is_a_400_not_a_500(served):
    _, url, _ = served
    # Valid JSON, invalid Unicode: the exact reproduction (httpx would refuse to encode it).
    raw = b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}]}'
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages.0.content" in error["message"] and "surrogate" in error["message"]

    raw = b'{"model":"tiny","prompt":"ok","stop":["\\udfff"]}'
    r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "stop.0" in r.json()["error"]["message"]

    # Invalid UTF-8 bytes in the body itself.
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b'{"model":"tiny","messages":[{"role":"user","content":"\xff\xfe"}]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    # NUL is a valid character: it reaches the model and tokenizes.
    r = httpx.post(url + "/v1/chat/completions", json=_chat("a\u0000b"))
    assert r.status_code == 200, r.text


def _enum(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) for _ in range(n)})


def test_big_enum_is_served_by_the_catalogue_engine(served):
    _, url, _ = served
    values = _enum(50_000, seed=1)
    body = _chat(
        max_tokens=64,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": values}}},
    )
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.headers["x-paved-constraint-backend"] == "paved"
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) in set(values)


def test_other_requests_run_while_a_constraint_compiles(served):
    engine, url, loop = served
    llm = engine._llm
    heavy = {"type": "regex", "pattern": "(a|b)*a(a|b){12}"}
    _, key = specs.admit(heavy)  # the digest the frontend will compute for this spec

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
            # A request that is already decoding when the heavy one arrives.
            running = _chat(max_tokens=200, temperature=1.0, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=running) as stream:
                lines = stream.aiter_lines()
                await _next_chunk(lines)
                assert await llm.collective_rpc("paved_hold_compiles", args=(True,)) == [True]
                try:
                    big = asyncio.create_task(
                        client.post(
                            "/v1/chat/completions",
                            json=_chat(max_tokens=40, vllm_xargs={"paved_constraint": heavy}),
                        )
                    )
                    # The heavy request is waiting for its automaton, outside the batch.
                    for _ in range(1000):
                        (status,) = await llm.collective_rpc("paved_precompile", args=(key, None))
                        if status == "pending":
                            break
                        assert status == "unknown", status
                        await asyncio.sleep(0.01)
                    assert status == "pending"
                    # Meanwhile: the running request keeps decoding, a new one completes.
                    for _ in range(5):
                        await _next_chunk(lines)
                    small = await client.post("/v1/chat/completions", json=_chat())
                    assert small.status_code == 200, small.text
                    assert not big.done()
                    assert await llm.collective_rpc("paved_precompile", args=(key, None)) == ["pending"]
                finally:
                    await llm.collective_rpc("paved_hold_compiles", args=(False,))
            r = await big
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            assert re.fullmatch(heavy["pattern"], text), text

    loop.run(scenario())


async def _next_chunk(lines) -> None:
    # Bounded: if the engine's steps were stalled (a compile on the step thread), no chunk
    # would come at all; a generous bound turns that hang into a failure.
    async def one():
        async for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                return
        raise AssertionError("the stream ended early")

    await asyncio.wait_for(one(), 60)
