"""KServeEngine end to end: OpenAI request -> frontend -> KServeEngine -> paved KServe server ->
engine, with a scripted engine behind the server (the real-vLLM version is vllm_test.py).

Proves the remote path carries what it must (prompt, sampling options, the constraint
unchanged, cancellation) and refuses what the tensor interface cannot carry.
"""

import asyncio
import json

import httpx
import jsonschema
import pytest
from servers import serve_engines

from libs.tests.kserve.kserve_fakes import EMBED, LLM, SCHEMA, FakeEngine, loopback_server, serving, wait_for
from paved.engine.kserve_engine import KServeEngine
from paved.engine.protocol import (
    ChatPrompt,
    ChoiceDelta,
    Constraint,
    EmbedRequest,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingOptions,
    TextPrompt,
    TokenPrompt,
)
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry
from paved.testing.fixtures import tiny_model_dir


class Backend(FakeEngine):
    """FakeEngine, and the prompt "down": one token, then the engine fails (503-class)."""

    async def _stream(self, request, prompt):
        if prompt == "down":
            self.requests.append(request)
            yield GenerateOutput([ChoiceDelta(0, "x", [0])], prompt_tokens=1)
            raise EngineUnavailableError("the engine died")
        async for out in super()._stream(request, prompt):
            yield out


@pytest.fixture(scope="module")
def backend():
    return Backend()


@pytest.fixture(scope="module")
def server(loop, backend):
    with serving(loop, loopback_server([backend], xgb=False, http_port=None), ready=False) as server:
        yield server


@pytest.fixture(scope="module")
def engine(loop, server):
    engine = KServeEngine.from_uri(
        f"kserve://127.0.0.1:{server.grpc_port}?tokenizer={tiny_model_dir()}", LLM, connect_timeout_s=10
    )
    loop.run(engine.start())
    yield engine
    loop.run(engine.stop())


async def collect(engine, request):
    stream = await engine.generate(request)
    return [out async for out in stream]


def text_of(outputs, index=0):
    return "".join(c.text for out in outputs for c in out.choices if c.index == index)


def test_from_uri_parses_and_rejects():
    e = KServeEngine.from_uri("kserve://h:9?max_model_len=99&constraint_backends=xgrammar", "m")
    assert (e.target, e.model) == ("h:9", "m")
    for bad in ("http://h:1", "kserve://h", "kserve://h:1/x", "kserve://h:1?colour=red"):
        with pytest.raises(ValueError):
            KServeEngine.from_uri(bad, "m")


def test_card_is_discovered_from_the_model_config(engine):
    (card,) = engine.models()
    assert card.id == LLM and card.kind == "generate"
    assert card.max_model_len == 256 and card.max_logprobs == 5
    assert card.constraint_backends == ("paved", "xgrammar")
    assert engine.ready()


@pytest.mark.parametrize("stream", [True, False])
def test_generate_streams_deltas(loop, engine, backend, stream):
    request = GenerateRequest(
        "r-gen",
        LLM,
        TextPrompt("one two"),
        SamplingOptions(max_tokens=3, temperature=0.25, seed=5),
        stream=stream,
    )
    outputs = loop.run(collect(engine, request))
    assert text_of(outputs) == "w0 w1 w2 "
    assert outputs[0].prompt_tokens == 2 and outputs[-1].finished
    assert outputs[-1].choices[0].finish_reason == "length"
    assert len(outputs) == (3 if stream else 1)
    sent = backend.requests[-1]
    assert sent.sampling.temperature == 0.25 and sent.sampling.seed == 5 and sent.sampling.max_tokens == 3
    assert sent.prompt == TextPrompt("one two")


def test_n_logprobs_and_echo(loop, engine):
    request = GenerateRequest(
        "r-n", LLM, TextPrompt("a"), SamplingOptions(max_tokens=2, n=2, logprobs=2), echo=True
    )
    outputs = loop.run(collect(engine, request))
    assert text_of(outputs, 0) == text_of(outputs, 1) == "w0 w1 "
    assert outputs[0].prompt_text == "a" and outputs[0].prompt_token_ids
    logprobs = [lp for out in outputs for c in out.choices if c.index == 0 for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == [0, 1] and logprobs[0].logprob == -0.5
    assert [t.token_id for t in logprobs[0].top] == [100, 101]


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("xgrammar", "json_schema", SCHEMA),
        Constraint("xgrammar", "regex", "[a-z]+"),
        Constraint(
            "paved",
            "paved",
            {"type": "choice", "items": ["a", "b"], "k": 1, "separator": ", ", "distinct": False},
        ),
    ],
)
def test_constraints_travel_unchanged(loop, engine, backend, constraint):
    request = GenerateRequest(
        "r-c", LLM, TextPrompt("q"), SamplingOptions(max_tokens=32, constraint=constraint)
    )
    outputs = loop.run(collect(engine, request))
    received = backend.requests[-1].sampling.constraint
    if constraint.kind == "json_schema":
        # The server routes in-subset schemas to paved's engine, as the OpenAI frontend does.
        assert received == Constraint(
            "paved", "paved", {"type": "json_schema", "schema": SCHEMA, "whitespace": "compact"}
        )
    else:
        assert received == constraint
    jsonschema.validate(json.loads(text_of(outputs)), SCHEMA)


def test_admission_errors_raise_before_the_stream(loop, engine):
    request = GenerateRequest("r-long", LLM, TextPrompt("x"), SamplingOptions(max_tokens=1000))
    with pytest.raises(InvalidRequestError, match="context"):
        loop.run(engine.generate(request))
    bad = Constraint("paved", "paved", {"type": "regex", "pattern": "("})
    with pytest.raises(InvalidRequestError, match="paved_constraint"):
        loop.run(
            engine.generate(GenerateRequest("r-bad", LLM, TextPrompt("x"), SamplingOptions(constraint=bad)))
        )
    with pytest.raises(ModelNotFoundError):
        loop.run(engine.generate(GenerateRequest("r-nf", "other", TextPrompt("x"))))


def test_what_the_tensor_interface_cannot_carry_is_refused(loop, engine):
    for request in (
        GenerateRequest("r1", LLM, TokenPrompt([1, 2])),
        GenerateRequest("r2", LLM, TextPrompt("x"), SamplingOptions(prompt_logprobs=1)),
        GenerateRequest("r3", LLM, TextPrompt("x"), SamplingOptions(max_tokens=0)),
    ):
        with pytest.raises(InvalidRequestError):
            loop.run(engine.generate(request))


def test_closing_the_stream_aborts_the_remote_request(loop, engine, backend):
    async def run():
        stream = await engine.generate(GenerateRequest("r-hang", LLM, TextPrompt("hang"), stream=True))
        await anext(stream)
        await anext(stream)
        await stream.aclose()

    loop.run(run())
    admitted = backend.requests[-1].request_id
    assert wait_for(lambda: admitted in backend.aborted)


def test_closing_a_never_iterated_stream_aborts_the_remote_request(loop, engine, backend):
    """A client that disconnects before the first byte: the frontend closes the stream unread."""

    async def run():
        stream = await engine.generate(GenerateRequest("r-unread", LLM, TextPrompt("hang"), stream=True))
        await stream.aclose()

    loop.run(run())
    admitted = backend.requests[-1].request_id
    assert wait_for(lambda: admitted in backend.aborted)


def test_a_non_streaming_request_is_admitted_at_its_first_token_and_closes_like_a_stream(
    loop, engine, backend
):
    """stream=False still returns from `generate` once the remote has started the request (not
    when it has finished), so a caller that gives up can abort it: the prompt "hang" never ends."""

    async def run():
        stream = await asyncio.wait_for(
            engine.generate(GenerateRequest("r-unary-hang", LLM, TextPrompt("hang"), stream=False)), 30
        )
        await stream.aclose()

    loop.run(run())
    admitted = backend.requests[-1].request_id
    assert wait_for(lambda: admitted in backend.aborted)
    assert not engine._calls


def test_a_disconnected_non_streaming_client_aborts_every_remote_prompt(server, backend):
    """A non-streaming completion of two prompts whose client goes away: both remote requests
    are aborted (they never end by themselves) and the admission is given back."""
    before = set(backend.aborted)
    # Its own engine: the frontend's server loop starts it and owns its channel.
    remote = KServeEngine.from_uri(f"kserve://127.0.0.1:{server.grpc_port}", LLM, connect_timeout_s=10)
    with serve_engines(remote) as url:
        body = {"model": LLM, "prompt": ["hang", "hang"], "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1)
        assert wait_for(lambda: len(set(backend.aborted) - before) == 2)
        assert wait_for(
            lambda: 'paved_queued_sequences{model="fake-llm"} 0.0' in httpx.get(url + "/metrics").text
        )
        assert not remote._calls


def test_one_prompt_failing_mid_generation_fails_the_completion_with_its_status(server, backend):
    """Two prompts, not streamed: the remote fails one after its first token while the other
    runs on. The client gets that failure's 503 (not a 500 from closing a stream another task
    was still reading), and the other remote request is aborted."""
    before = set(backend.aborted)
    remote = KServeEngine.from_uri(f"kserve://127.0.0.1:{server.grpc_port}", LLM, connect_timeout_s=10)
    with serve_engines(remote) as url:
        body = {"model": LLM, "prompt": ["down", "hang"], "max_tokens": 200}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"] == "the engine died"
        assert wait_for(lambda: len(set(backend.aborted) - before) == 1)
        assert wait_for(lambda: not remote._calls)


def test_abort_by_request_id(loop, engine, backend):
    async def run():
        stream = await engine.generate(GenerateRequest("r-abort", LLM, TextPrompt("hang"), stream=True))
        await anext(stream)
        await engine.abort("r-abort")
        return [out async for out in stream]

    rest = loop.run(run())
    assert rest[-1].finished and rest[-1].choices[0].finish_reason == "abort"
    admitted = backend.requests[-1].request_id
    assert wait_for(lambda: admitted in backend.aborted)


def test_chat_prompts_use_the_local_tokenizer(loop, engine, backend):
    prompt = ChatPrompt([{"role": "user", "content": "hello"}])
    loop.run(collect(engine, GenerateRequest("r-chat", LLM, prompt, SamplingOptions(max_tokens=1))))
    sent = backend.requests[-1].prompt
    assert isinstance(sent, TextPrompt) and "hello" in sent.text and sent.text != "hello"
    assert loop.run(engine.tokenize(LLM, "hello", add_special_tokens=False))


def test_embeddings_over_kserve(loop, server):
    embedder = KServeEngine.from_uri(f"kserve://127.0.0.1:{server.grpc_port}", EMBED)
    loop.run(embedder.start())
    try:
        assert embedder.models()[0].kind == "embed"
        result = loop.run(
            embedder.embed(EmbedRequest("e", EMBED, [TextPrompt("a b"), TextPrompt("c")], dimensions=2))
        )
        assert result.embeddings == [[3.0, 0.5], [1.0, 0.5]] and result.prompt_tokens == 3
    finally:
        loop.run(embedder.stop())


def test_unreachable_server_fails_start(loop):
    dead = KServeEngine.from_uri("kserve://127.0.0.1:1", LLM, connect_timeout_s=1)
    with pytest.raises(EngineUnavailableError, match="not ready"):
        loop.run(dead.start())
    loop.run(dead.stop())


def test_openai_frontend_over_the_remote_engine(loop, engine, backend):
    """An OpenAI request with response_format -> the frontend -> KServeEngine -> KServe server."""
    registry = ModelRegistry([engine])
    loop.run(registry.start())
    app = create_app(registry)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://paved") as client:
            completion = await client.post(
                "/v1/completions",
                json={
                    "model": LLM,
                    "prompt": "Answer in JSON:",
                    "max_tokens": 40,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": SCHEMA},
                    },
                },
            )
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            return completion, chat

    completion, chat = loop.run(run())
    assert completion.status_code == 200, completion.text
    jsonschema.validate(json.loads(completion.json()["choices"][0]["text"]), SCHEMA)
    assert backend.requests[-2].sampling.constraint.backend == "paved"
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "w0 w1 "
    # Token ids do not cross the tensor interface; the server's num_output_tokens do.
    assert chat.json()["usage"]["completion_tokens"] == 2
