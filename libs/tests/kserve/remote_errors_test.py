"""A remote's refusal of a request reaches the OpenAI client as a 400, never a 500.

Triton's ModelStreamInfer carries a model's error as `error_message` alone (its code dropped,
measured on 2.51: vllm_triton_test has the real server). A server standing in for it here
answers every stream with such an error; the engine maps it to InvalidRequestError only when
the message starts with paved's documented marker (`wire.ERROR_CODE_MARKER`), never by reading
the text. Grammars xgrammar cannot parse are refused before they travel.
"""

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from libs.tests.kserve.kserve_fakes import EMBED, LLM, FakeEngine
from paved.engine.kserve_engine import KServeEngine
from paved.engine.protocol import (
    Constraint,
    EngineError,
    GenerateRequest,
    InvalidRequestError,
    SamplingOptions,
    TextPrompt,
)
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry
from paved.kserve.grpc_server import KServeServicer
from paved.kserve.repository import ModelRepository
from paved.kserve.wire import error_code_of, marked_error


class TritonLikeErrors(KServeServicer):
    """Metadata from a FakeEngine; every stream answered with one final error response, shaped
    as Triton 2.51 sends it (no status code, no parameters but the final flag)."""

    def __init__(self):
        super().__init__(ModelRepository([FakeEngine()]))
        self.error = "boom"
        self.received: list[service_pb2.ModelInferRequest] = []

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            self.received.append(request)
            response = service_pb2.ModelStreamInferResponse(error_message=self.error)
            response.infer_response.model_name = request.model_name
            response.infer_response.id = request.id
            response.infer_response.parameters["triton_final_response"].bool_param = True
            yield response


@pytest.fixture(scope="module")
def servicer():
    return TritonLikeErrors()


@pytest.fixture(scope="module")
def engine(loop, servicer):
    async def start():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    engine = KServeEngine(f"127.0.0.1:{port}", LLM, connect_timeout_s=10)
    loop.run(engine.start())
    yield engine
    loop.run(engine.stop())
    loop.run(server.stop(0))


def _generate(loop, engine, constraint=None):
    request = GenerateRequest(
        "r", LLM, TextPrompt("hi"), SamplingOptions(max_tokens=2, constraint=constraint)
    )

    async def run():
        stream = await engine.generate(request)
        return [out async for out in stream]

    return loop.run(run())


def test_the_marker_round_trips():
    assert error_code_of(marked_error("INVALID_ARGUMENT", "bad regex")) == ("INVALID_ARGUMENT", "bad regex")
    for unmarked in (
        "bad regex",
        "INVALID_ARGUMENT: bad",
        "[paved_error_code=invalid] x",
        " [paved_error_code=X] y",
    ):
        assert error_code_of(unmarked) == ("", unmarked)


def test_a_marked_stream_error_is_an_invalid_request(loop, engine, servicer):
    servicer.error = marked_error(
        "INVALID_ARGUMENT", "The provided JSON schema contains features not supported"
    )
    with pytest.raises(InvalidRequestError) as info:
        _generate(loop, engine)
    assert info.value.message == "The provided JSON schema contains features not supported"


def test_an_unmarked_stream_error_is_not_guessed_at(loop, engine, servicer):
    # Text that reads like a client error is still an engine failure without the marker.
    servicer.error = "Error generating stream: invalid argument: INVALID_ARGUMENT bad grammar"
    with pytest.raises(EngineError) as info:
        _generate(loop, engine)
    assert not isinstance(info.value, InvalidRequestError)
    assert "bad grammar" in str(info.value)


@pytest.mark.parametrize(
    "constraint, reason",
    [
        (Constraint("xgrammar", "regex", "(unclosed"), "Regex parsing error"),
        (Constraint("xgrammar", "regex", "a\x00b"), "NUL"),
        (Constraint("xgrammar", "grammar", "root ::= "), "EBNF parser error"),
        (Constraint("xgrammar", "grammar", "start: ::"), "Lark error"),
        (Constraint("xgrammar", "choice", []), "at least one"),
        (
            Constraint("xgrammar", "json_schema", {"properties": {"a": {"$ref": "#/$defs/missing"}}}),
            "$defs",
        ),
    ],
)
def test_a_grammar_xgrammar_cannot_parse_never_travels(loop, engine, servicer, constraint, reason):
    sent = len(servicer.received)
    with pytest.raises(InvalidRequestError) as info:
        _generate(loop, engine, constraint)
    assert f"the {constraint.kind} constraint cannot be compiled" in info.value.message
    assert reason in info.value.message
    assert "/project/cpp" not in info.value.message  # xgrammar's source location is stripped
    assert len(servicer.received) == sent


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("xgrammar", "regex", "[a-z]+"),
        Constraint("xgrammar", "grammar", 'root ::= "a" | "b"'),
        Constraint("xgrammar", "grammar", 'start: "a" | "b"'),
        Constraint("xgrammar", "choice", ["x", "y"]),
        Constraint("xgrammar", "json_schema", {"type": "object"}),
        Constraint("xgrammar", "json_object"),
    ],
)
def test_grammars_that_parse_travel(loop, engine, servicer, constraint):
    servicer.error = "boom"
    sent = len(servicer.received)
    with pytest.raises(EngineError, match="boom"):
        _generate(loop, engine, constraint)
    assert len(servicer.received) == sent + 1


@pytest.mark.parametrize("stream", [False, True])
def test_the_frontend_answers_400_with_an_openai_body(loop, engine, servicer, stream):
    registry = ModelRegistry([engine])
    loop.run(registry.start())
    app = create_app(registry)

    async def post(body):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://paved") as client:
            return await client.post(
                "/v1/completions", json={"model": LLM, "prompt": "hi", "stream": stream, **body}
            )

    servicer.error = marked_error("INVALID_ARGUMENT", "grammar refused by the remote")
    remote = loop.run(post({"max_tokens": 2}))
    assert remote.status_code == 400, remote.text
    assert remote.json()["error"]["message"] == "grammar refused by the remote"
    assert remote.json()["error"]["type"] == "invalid_request_error"

    local = loop.run(post({"max_tokens": 2, "structured_outputs": {"regex": "(unclosed"}}))
    assert local.status_code == 400, local.text
    assert "regex constraint cannot be compiled" in local.json()["error"]["message"]

    servicer.error = "Error generating stream: CUDA out of memory"
    failed = loop.run(post({"max_tokens": 2}))
    assert failed.status_code == 500


def test_a_remote_gone_since_start_is_a_503_with_retry_after(loop):
    """The remote stops after the engine started (before its health probe notices): calls then
    fail as they are written, and the client gets 503 + Retry-After, not a 500."""

    async def start():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeServicer(ModelRepository([FakeEngine()])), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        generator = KServeEngine(f"127.0.0.1:{port}", LLM, connect_timeout_s=10)
        embedder = KServeEngine(f"127.0.0.1:{port}", EMBED, connect_timeout_s=10)
        await generator.start()
        await embedder.start()
        await server.stop(0)
        return generator, embedder

    generator, embedder = loop.run(start())
    registry = ModelRegistry([generator, embedder])
    loop.run(registry.start())
    app = create_app(registry)

    async def post(path, body):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://paved") as client:
            return await client.post(path, json=body)

    try:
        for path, body in (
            ("/v1/completions", {"model": LLM, "prompt": "hi", "max_tokens": 2}),
            ("/v1/completions", {"model": LLM, "prompt": "hi", "max_tokens": 2, "stream": True}),
            ("/v1/embeddings", {"model": EMBED, "input": ["a", "b"]}),
        ):
            response = loop.run(post(path, body))
            assert response.status_code == 503, (path, response.text)
            assert response.headers["retry-after"]
            assert response.json()["error"]["code"] == "unavailable"
    finally:
        loop.run(registry.stop())


def test_a_remote_at_capacity_is_push_back_not_an_outage(loop):
    """paved's KServe server refusing a request for want of capacity (its admission bound, a
    full queue) answers in-band with the Retry-After it gave: the engine reads push-back
    (EngineOverloadedError, counted apart from errors by alerting) with that delay, where it
    read an outage unless the message happened to say "queue"."""
    from paved.engine.protocol import EngineOverloadedError
    from paved.kserve.server import KServeServer

    def full(model, sequences):
        raise EngineOverloadedError(f"model {model!r} is at capacity", retry_after_s=3)

    async def start():
        server = KServeServer(
            [FakeEngine()], [], host="127.0.0.1", grpc_port=0, http_port=None, admission=full
        )
        await server.start()
        engine = KServeEngine(f"127.0.0.1:{server.grpc_port}", LLM, connect_timeout_s=10)
        await engine.start()
        return server, engine

    server, engine = loop.run(start())
    try:
        with pytest.raises(EngineOverloadedError) as refused:
            _generate(loop, engine)
        assert refused.value.retry_after_s == 3 and "capacity" in str(refused.value)
    finally:
        loop.run(engine.stop())
        loop.run(server.stop(grace_s=1))
