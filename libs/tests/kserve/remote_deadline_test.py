"""Every KServeEngine remote call has a deadline, and its expiry is an error naming the limit:
rpc_timeout_s for ModelReady / ModelConfig, request_timeout_s for each ModelStreamInfer call
(generation and embeddings). Servers that never answer stand in for a hung remote."""

import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from libs.tests.kserve.kserve_fakes import EMBED, LLM, FakeEngine, wait_for
from paved.engine.kserve_engine import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, KServeEngine
from paved.engine.protocol import (
    EmbedRequest,
    EngineUnavailableError,
    GenerateRequest,
    SamplingOptions,
    TextPrompt,
)
from paved.frontend.server import main as frontend_main
from paved.kserve.grpc_server import KServeServicer
from paved.kserve.repository import ModelRepository


class StuckEmbeddings(FakeEngine):
    async def embed(self, request):
        self.embed_requests.append(request)
        await asyncio.Event().wait()  # never answers


class StuckConfig(KServeServicer):
    async def ModelConfig(self, request, context):
        await asyncio.Event().wait()  # a hung server: ModelReady answers, ModelConfig never


async def _grpc_server(servicer):
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(scope="module")
def backend():
    return StuckEmbeddings()


@pytest.fixture(scope="module")
def port(loop, backend):
    server, port = loop.run(_grpc_server(KServeServicer(ModelRepository([backend]))))
    yield port
    loop.run(server.stop(0))


def _engine(loop, port, model, **kwargs):
    engine = KServeEngine(f"127.0.0.1:{port}", model, connect_timeout_s=10, **kwargs)
    loop.run(engine.start())
    return engine


def test_a_generation_past_request_timeout_fails_naming_it_and_aborts(loop, port, backend):
    engine = _engine(loop, port, LLM, request_timeout_s=0.5)

    async def run(prompt):
        request = GenerateRequest(f"r-{prompt}", LLM, TextPrompt(prompt), SamplingOptions(max_tokens=2))
        stream = await engine.generate(request)
        return [out async for out in stream]

    try:
        (out,) = loop.run(run("quick"))  # within the deadline: served
        assert out.choices[0].text == "w0 w1 " and out.finished
        with pytest.raises(EngineUnavailableError) as info:
            loop.run(run("hang"))  # streams for ever: the deadline ends it
        assert "request_timeout_s=0.5 s" in str(info.value) and "DEADLINE_EXCEEDED" in str(info.value)
        assert wait_for(lambda: any(r.startswith("kserve-") for r in backend.aborted))
    finally:
        loop.run(engine.stop())


def test_an_embedding_past_request_timeout_fails_naming_it(loop, port):
    engine = _engine(loop, port, EMBED, request_timeout_s=0.5)
    try:
        with pytest.raises(EngineUnavailableError) as info:
            loop.run(engine.embed(EmbedRequest("e", EMBED, [TextPrompt("a")])))
        assert "request_timeout_s=0.5 s" in str(info.value)
    finally:
        loop.run(engine.stop())


def test_metadata_past_rpc_timeout_fails_the_start_naming_it(loop):
    server, port = loop.run(_grpc_server(StuckConfig(ModelRepository([FakeEngine()]))))
    engine = KServeEngine(f"127.0.0.1:{port}", LLM, connect_timeout_s=10, rpc_timeout_s=0.3)
    try:
        with pytest.raises(EngineUnavailableError) as info:
            loop.run(engine.start())
        assert "rpc_timeout_s=0.3 s (ModelConfig)" in str(info.value)
    finally:
        loop.run(engine.stop())
        loop.run(server.stop(0))


def test_deadline_options_defaults_and_validation(capsys):
    e = KServeEngine.from_uri("kserve://h:9?rpc_timeout_s=2&request_timeout_s=0", "m")
    assert (e.rpc_timeout_s, e.request_timeout_s) == (2.0, 0.0)  # 0: no request deadline
    d = KServeEngine.from_uri("kserve://h:9", "m")
    assert (d.rpc_timeout_s, d.request_timeout_s) == (DEFAULT_RPC_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S)
    assert (DEFAULT_RPC_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S) == (10.0, 600.0)
    for bad in ("rpc_timeout_s=0", "rpc_timeout_s=x", "request_timeout_s=-1", "connect_timeout_s=nan"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            KServeEngine.from_uri(f"kserve://h:9?{bad}", "m")
    assert frontend_main(["--engine", "kserve://127.0.0.1:9?rpc_timeout_s=0", "--model", "m"]) == 2
    assert "rpc_timeout_s must be a positive number of seconds" in capsys.readouterr().err
