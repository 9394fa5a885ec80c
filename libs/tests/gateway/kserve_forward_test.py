"""KServe v2 forwarding through the gateway, gRPC and HTTP, driven by the real tritonclient.

One real paved frontend (simulated LLM `tiny` + the XGBoost fixture `xgb_scorer`, KServe
ports on) sits behind the gateway's KServeForwarder (grpc.aio, loopback) and KServe HTTP
routes (a Starlette app on loopback), with the real Router, Authenticator over a SQLite
GatewayStore, and InProcessLimiter. A recording fake upstream proves the forwarded bytes are
the client's bytes. Every server and process is stopped at module teardown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import secrets
import socket
import tempfile
import threading

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import uvicorn
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess
from starlette.applications import Starlette
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import llm_inputs, stream, wait_for, xgb_model_dir
from paved.gateway.access.auth import Authenticator
from paved.gateway.access.limits import InProcessLimiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.forwarding.kserve_grpc import KServeForwarder, read_head
from paved.gateway.forwarding.kserve_http import body_max_tokens, kserve_http_routes
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import Backend, ModelRoute, RoutesTable
from paved.gateway.types import Limits

LLM = "tiny"
XGB = "xgb_scorer"
INFER = "/inference.GRPCInferenceService/ModelInfer"


class Loop:
    """An event loop in a thread: the gateway's servers run there while blocking clients run
    in the test."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """A fake upstream ModelInfer that records the raw request bytes it receives."""

    def __init__(self):
        self.received: list[bytes] = []
        self.metadata: list[dict] = []

    def handler(self) -> grpc.GenericRpcHandler:
        async def infer(request: bytes, context) -> bytes:
            self.received.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
            return service_pb2.ModelInferResponse(model_name="recorded", id="r").SerializeToString()

        return grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
        )


class Gateway:
    def __init__(self, frontend: ServerProcess, tmp: str):
        self.loop = Loop()
        self.recorder = Recorder()
        self.dead_port = free_port()  # nothing listens there: connections are refused
        self.loop.run(self._start(frontend, tmp))

    async def _start(self, frontend: ServerProcess, tmp: str) -> None:
        self.upstream = grpc.aio.server()
        self.upstream.add_generic_rpc_handlers((self.recorder.handler(),))
        recorder_port = self.upstream.add_insecure_port("127.0.0.1:0")
        await self.upstream.start()

        live = Backend(
            id="f1",
            url=frontend.url,
            version="v1",
            kserve_grpc=f"127.0.0.1:{frontend.kserve_grpc_port}",
            kserve_http=f"http://127.0.0.1:{frontend.kserve_http_port}",
        )
        dead = Backend(
            id="dead",
            url=f"http://127.0.0.1:{self.dead_port}",
            version="v1",
            weight=100,  # least outstanding prefers it: the retry path is taken every time
            kserve_grpc=f"127.0.0.1:{self.dead_port}",
            kserve_http=f"http://127.0.0.1:{self.dead_port}",
        )
        down = Backend(
            id="down",
            url="http://127.0.0.1:9",
            version="v1",
            kserve_grpc="127.0.0.1:9",
            kserve_http="http://127.0.0.1:9",
        )
        table = RoutesTable.of(
            [
                ModelRoute(LLM, (live,)),
                ModelRoute(XGB, (live,), kind="kserve"),
                # Alias "scorer" is served as xgb_scorer upstream.
                ModelRoute("scorer", (Backend(**{**live.__dict__, "upstream_model": XGB}),), kind="kserve"),
                ModelRoute(
                    "retry", (dead, Backend(**{**live.__dict__, "upstream_model": XGB})), kind="kserve"
                ),
                ModelRoute("down", (down,), kind="kserve"),
                ModelRoute("openai-only", (Backend(id="o", url=frontend.url + "/", version="v1"),)),
                ModelRoute(
                    "recorded",
                    (
                        Backend(
                            id="rec",
                            url="http://127.0.0.1:8",
                            version="v7",
                            kserve_grpc=f"127.0.0.1:{recorder_port}",
                        ),
                    ),
                    kind="kserve",
                ),
            ]
        )
        self.router = Router(table)
        self.router.set_ready("down", False)
        self.store = GatewayStore(f"sqlite:///{os.path.join(tmp, 'gateway.db')}")
        await self.store.start()
        await self.store.create_tenant("all")
        await self.store.create_tenant("xgb-only", models=[XGB])
        await self.store.create_tenant("slow", limits=Limits(requests_per_min=1))
        _, self.key = await self.store.create_key("all")
        _, self.xgb_key = await self.store.create_key("xgb-only")
        _, self.slow_key = await self.store.create_key("slow")
        self.authenticator = Authenticator(self.store)
        self.limiter = InProcessLimiter()

        self.forwarder = KServeForwarder(self.router, self.authenticator, self.limiter, connect_timeout_s=2)
        self.grpc_server = grpc.aio.server()
        self.grpc_server.add_generic_rpc_handlers((self.forwarder.handler(),))
        self.grpc_port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        await self.grpc_server.start()

        self.session = aiohttp.ClientSession(auto_decompress=False)
        app = Starlette(
            routes=kserve_http_routes(self.router, self.authenticator, self.limiter, lambda: self.session)
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.http_port = sock.getsockname()[1]
        self.http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.http.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.http_task = asyncio.ensure_future(self.http.serve(sockets=[sock]))
        for _ in range(1000):
            if self.http.started:
                break
            await asyncio.sleep(0.01)
        assert self.http.started

    async def _stop(self) -> None:
        self.http.should_exit = True
        await self.http_task
        await self.grpc_server.stop(grace=1)
        await self.upstream.stop(grace=1)
        await self.forwarder.close()
        await self.session.close()
        await self.store.close()

    def stop(self) -> None:
        self.loop.run(self._stop())
        self.loop.stop()

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.key}"}


@pytest.fixture(scope="module")
def frontend():
    server = ServerProcess(
        "--engine",
        f"sim://{LLM}",
        "--model",
        LLM,
        "--kserve-grpc-port",
        "0",
        "--kserve-http-port",
        "0",
        "--kserve-model-dir",
        xgb_model_dir(),
        ready_timeout_s=120,
    )
    # The XGBoost model loads in the background after the OpenAI side is ready.
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{server.kserve_grpc_port}")
    try:
        assert wait_for(direct.is_server_ready, timeout=120), server.tail()
    finally:
        direct.close()
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def gw(frontend):
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
        gateway = Gateway(frontend, tmp)
        yield gateway
        gateway.stop()


@pytest.fixture
def gc(gw):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
    yield client
    client.close()


@pytest.fixture
def hc(gw):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{gw.http_port}", network_timeout=60)
    yield client
    client.close()


def xgb_input(module, rows: int = 4):
    x = np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)
    t = module.InferInput("input__0", [rows, 32], "FP32")
    t.set_data_from_numpy(x)
    return t


LLM_PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def code_of(e: InferenceServerException) -> str:
    return str(e.status())


# ---- the same call, the same key, an XGBoost model and an LLM -------------------------------
def test_grpc_scores_xgboost_and_llm_with_one_client_and_key(gw, gc, frontend):
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{frontend.kserve_grpc_port}")
    try:
        h = gw.headers()
        assert gc.is_server_live() and gc.is_server_ready()
        via = gc.infer(XGB, [xgb_input(grpcclient)], headers=h).as_numpy("output__0")
        assert np.array_equal(via, direct.infer(XGB, [xgb_input(grpcclient)]).as_numpy("output__0"))
        # An alias the backend knows by another name answers the same scores.
        assert np.array_equal(
            gc.infer("scorer", [xgb_input(grpcclient)], headers=h).as_numpy("output__0"), via
        )

        inputs = llm_inputs(grpcclient, "The quick brown fox", params=LLM_PARAMS, exclude=True)
        text = gc.infer(LLM, inputs, headers=h).as_numpy("text_output")[0]
        assert text and text == direct.infer(LLM, inputs).as_numpy("text_output")[0]

        assert gc.is_model_ready(XGB, headers=h) and gc.is_model_ready(LLM, headers=h)
        assert gc.get_model_metadata(XGB, headers=h).name == XGB
        assert gc.get_model_config(LLM, headers=h).config.name == LLM
        # A pinned version that the route serves; one it does not serve is unknown.
        assert gc.get_model_metadata(XGB, "v1", headers=h).name == XGB
        with pytest.raises(InferenceServerException) as e:
            gc.get_model_metadata(XGB, "v9", headers=h)
        assert "NOT_FOUND" in code_of(e.value)
    finally:
        direct.close()


def test_http_scores_xgboost_and_llm_with_one_client_and_key(gw, hc, frontend):
    direct = httpclient.InferenceServerClient(f"127.0.0.1:{frontend.kserve_http_port}")
    try:
        h = gw.headers()
        assert hc.is_server_live() and hc.is_server_ready()
        via = hc.infer(XGB, [xgb_input(httpclient)], headers=h).as_numpy("output__0")
        assert np.array_equal(via, direct.infer(XGB, [xgb_input(httpclient)]).as_numpy("output__0"))
        assert np.array_equal(
            hc.infer(XGB, [xgb_input(httpclient)], model_version="v1", headers=h).as_numpy("output__0"), via
        )
        inputs = llm_inputs(httpclient, "The quick brown fox", params=LLM_PARAMS, exclude=True)
        text = hc.infer(LLM, inputs, headers=h).as_numpy("text_output")[0]
        assert text and text == direct.infer(LLM, inputs).as_numpy("text_output")[0]
        assert hc.is_model_ready(LLM, headers=h) and not hc.is_model_ready("nope", headers=h)
        assert hc.get_model_metadata(XGB, headers=h)["name"] == XGB
        assert hc.get_model_config(XGB, headers=h)["name"] == XGB
    finally:
        direct.close()


def test_http_generate_and_sse_stream(gw, frontend):
    import httpx

    url = f"http://127.0.0.1:{gw.http_port}/v2/models/{LLM}"
    body = {"text_input": "Once upon", "parameters": LLM_PARAMS, "exclude_input_in_output": True}
    r = httpx.post(url + "/generate", json=body, headers=gw.headers(), timeout=60)
    direct = httpx.post(
        f"http://127.0.0.1:{frontend.kserve_http_port}/v2/models/{LLM}/generate", json=body, timeout=60
    )
    assert r.status_code == 200 and r.json() == direct.json()

    with httpx.stream(
        "POST", url + "/generate_stream", json={**body, "stream": True}, headers=gw.headers(), timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line]
    assert len(events) >= 2 and "".join(e["text_output"] for e in events) == direct.json()["text_output"]


def test_stream_infer_routes_by_first_message_and_refuses_another_model(gw, gc):
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)), headers=gw.headers())
    try:
        gc.async_stream_infer(
            LLM,
            llm_inputs(
                grpcclient, "Once upon", params=LLM_PARAMS, stream=True, return_num_output_tokens=True
            ),
        )
        tokens = 0
        for _ in range(64):
            result, error = results.get(timeout=60)
            assert error is None, error
            tokens += int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert tokens == LLM_PARAMS["max_tokens"]

        # The stream is the LLM's: a request for another model is refused in-band.
        gc.async_stream_infer(XGB, [xgb_input(grpcclient)], request_id="other")
        result, error = results.get(timeout=60)
        assert error is not None and "open another stream" in str(error)
    finally:
        gc.stop_stream()


# ---- refusals happen before any upstream call -----------------------------------------------
def test_grpc_refusals(gw, gc):
    cases = [
        ({}, XGB, "UNAUTHENTICATED"),
        ({"authorization": "Bearer pvd_nope"}, XGB, "UNAUTHENTICATED"),
        (gw.headers(gw.xgb_key), LLM, "NOT_FOUND"),
        (gw.headers(), "nope", "NOT_FOUND"),
        (gw.headers(), "down", "UNAVAILABLE"),
        # No backend serves KServe gRPC: no retry can help (it was UNAVAILABLE, retried forever).
        (gw.headers(), "openai-only", "INVALID_ARGUMENT"),
    ]
    messages = {}
    for headers, model, code in cases:
        with pytest.raises(InferenceServerException) as e:
            gc.infer(model, [xgb_input(grpcclient)], headers=headers)
        assert code in code_of(e.value), (model, e.value)
        messages[model] = e.value.message()
    # Not allowed reads exactly like unknown (no probing which models exist).
    assert messages[LLM].replace(LLM, "M") == messages["nope"].replace("nope", "M")
    # The xgb-only key still scores its model.
    assert gc.infer(XGB, [xgb_input(grpcclient)], headers=gw.headers(gw.xgb_key)).as_numpy(
        "output__0"
    ).shape == (4, 3)
    assert not gc.is_model_ready(LLM, headers=gw.headers(gw.xgb_key))


def test_http_refusals(gw, hc):
    for headers, model, status in [
        ({}, XGB, 401),
        (gw.headers(gw.xgb_key), LLM, 404),
        (gw.headers(), "nope", 404),
        (gw.headers(), "down", 503),
        # No backend serves KServe HTTP: not "none of its backends is healthy".
        (gw.headers(), "openai-only", 400),
        (gw.headers(), "recorded", 400),
    ]:
        with pytest.raises(InferenceServerException) as e:
            hc.infer(model, [xgb_input(httpclient)], headers=headers)
        assert str(status) in code_of(e.value), (model, e.value)
        assert e.value.message()
        if status == 400:
            assert "not served over KServe HTTP" in e.value.message(), e.value.message()


def test_rate_limit_is_resource_exhausted_with_retry_after(gw):
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        call = channel.unary_unary(INFER)
        request = service_pb2.ModelInferRequest(model_name=XGB)
        metadata = (("authorization", f"Bearer {gw.slow_key}"),)
        with pytest.raises(grpc.RpcError):  # the first passes the limit and fails upstream (no input)
            call(request.SerializeToString(), metadata=metadata, timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            call(request.SerializeToString(), metadata=metadata, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(e.value.trailing_metadata())
        assert int(trailing["retry-after"]) >= 1
        assert len(trailing["x-request-id"]) == 32  # kept beside it


def test_repository_index_lists_only_the_tenants_models(gw, gc, hc):
    everything = {m.name for m in gc.get_model_repository_index(headers=gw.headers()).models}
    assert {LLM, XGB, "scorer", "retry", "recorded"} <= everything
    assert {m.name for m in gc.get_model_repository_index(headers=gw.headers(gw.xgb_key)).models} == {XGB}
    assert [m["name"] for m in hc.get_model_repository_index(headers=gw.headers(gw.xgb_key))] == [XGB]
    with pytest.raises(InferenceServerException) as e:
        gc.get_model_repository_index()
    assert "UNAUTHENTICATED" in code_of(e.value)


# ---- raw forwarding -------------------------------------------------------------------------
def test_forwarded_bytes_are_the_clients_bytes(gw):
    x = np.arange(12, dtype=np.float32)
    request = service_pb2.ModelInferRequest(model_name="recorded", id="q1")
    request.inputs.add(name="input__0", datatype="FP32", shape=[3, 4])
    request.raw_input_contents.append(x.tobytes())
    raw = request.SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        call = channel.unary_unary(INFER)
        reply = call(raw, metadata=(("authorization", f"Bearer {gw.key}"), ("x-trace", "t1")), timeout=30)
        assert service_pb2.ModelInferResponse.FromString(reply).model_name == "recorded"
        assert gw.recorder.received[-1] == raw
        forwarded = gw.recorder.metadata[-1]
        assert "authorization" not in forwarded and forwarded["x-trace"] == "t1" and forwarded["x-request-id"]

        # A pinned version: the original bytes plus an override clearing the version upstream.
        pinned = service_pb2.ModelInferRequest()
        pinned.CopyFrom(request)
        pinned.model_version = "v7"
        call(pinned.SerializeToString(), metadata=(("authorization", f"Bearer {gw.key}"),), timeout=30)
        sent = gw.recorder.received[-1]
        assert sent.startswith(pinned.SerializeToString())
        upstream = service_pb2.ModelInferRequest.FromString(sent)
        assert upstream.model_version == "" and upstream.raw_input_contents[0] == x.tobytes()


def test_connect_failure_retries_on_another_backend(gw, gc, hc):
    before = gw.router.snapshot()["dead"]["consecutive_failures"]
    scores = gc.infer("retry", [xgb_input(grpcclient)], headers=gw.headers()).as_numpy("output__0")
    assert scores.shape == (4, 3)
    after_grpc = gw.router.snapshot()["dead"]
    assert after_grpc["consecutive_failures"] == before + 1 or after_grpc["ejected_until"] is not None
    assert hc.infer("retry", [xgb_input(httpclient)], headers=gw.headers()).as_numpy("output__0").shape == (
        4,
        3,
    )
    assert all(s["outstanding"] == 0 for s in gw.router.snapshot().values())


# ---- the request head scan ------------------------------------------------------------------
def test_read_head_reads_routing_fields_and_max_tokens():
    request = service_pb2.ModelInferRequest(model_name="m", model_version="v2", id="i")
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    text = json.dumps({"max_tokens": 40}).encode()
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    head = read_head(request.SerializeToString(), infer=True)
    assert (head.name, head.version, head.id, head.max_tokens) == ("m", "v2", "i", 40)

    by_param = service_pb2.ModelInferRequest(model_name="m")
    by_param.parameters["max_tokens"].int64_param = 9
    assert read_head(by_param.SerializeToString(), infer=True).max_tokens == 9
    assert (
        read_head(service_pb2.ModelInferRequest(model_name="x").SerializeToString(), infer=True).max_tokens
        == 0
    )
    with pytest.raises(Exception, match="not a valid protobuf"):
        read_head(b"\xff\xff\xff", infer=True)


def test_read_head_parses_in_protobufs_runtime_not_a_python_walk(monkeypatch):
    """A crafted ModelInfer of millions of empty fields held the event loop (the OpenAI side's
    too) ~13 s per 16 MiB while a Python scan walked it: the head is parsed by protobuf's C
    runtime, as the instance parses it, and never walked field by field here."""
    from paved.gateway.forwarding import kserve_grpc

    def walked(*args, **kwargs):
        raise AssertionError("read_head walked the message in Python")

    monkeypatch.setattr(kserve_grpc, "scan_fields", walked)
    crafted = service_pb2.ModelInferRequest(model_name="m").SerializeToString() + b"\x3a\x00" * (1 << 18)
    head = read_head(crafted, infer=True)
    assert (head.name, head.max_tokens) == ("m", 0)
    ready = service_pb2.ModelReadyRequest(name="r", version="2").SerializeToString()
    assert (read_head(ready, infer=False).name, read_head(ready, infer=False).version) == ("r", "2")
    with pytest.raises(Exception, match="not a valid protobuf"):
        read_head(b"\n\x02\xff\xfe", infer=False)  # a model name that is not UTF-8


def test_body_max_tokens_forms():
    assert (
        body_max_tokens(
            "generate", json.dumps({"text_input": "x", "parameters": {"max_tokens": 7}}).encode(), None
        )
        == 7
    )
    assert body_max_tokens("generate", b'{"sampling_parameters": "{\\"max_tokens\\": 5}"}', None) == 5
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "sampling_parameters",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": ['{"max_tokens": 3}'],
                }
            ]
        }
    ).encode()
    assert body_max_tokens("infer", header, None) == 3
    element = b'{"max_tokens": 11}'
    binary = len(element).to_bytes(4, "little") + element
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text_input",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": 5},
                },
                {
                    "name": "sampling_parameters",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": len(binary)},
                },
            ]
        }
    ).encode()
    assert body_max_tokens("infer", header + b"\x01\x00\x00\x00a" + binary, str(len(header))) == 11
    assert body_max_tokens("infer", b"not json", None) == 0


# ---- request ids, trace context and access lines --------------------------------------------
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


def gateway_line(caplog, request_id: str) -> dict:
    def lines() -> list[dict]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == "paved.gateway.access"]

    # Written once the call has ended on the gateway's side, maybe just after the client returns.
    assert wait_for(lambda: any(e["request_id"] == request_id for e in lines()), timeout=30), lines()
    (line,) = [e for e in lines() if e["request_id"] == request_id]
    return line


def instance_line(frontend, request_id: str) -> dict:
    def lines() -> list[dict]:
        marker = "paved.kserve.access: "
        return [json.loads(x.split(marker, 1)[1]) for x in frontend.tail(2000).splitlines() if marker in x]

    assert wait_for(lambda: any(e["request_id"] == request_id for e in lines()), timeout=30), frontend.tail()
    (line,) = [e for e in lines() if e["request_id"] == request_id]
    return line


def test_grpc_request_id_and_trace_cross_the_gateway(gw, frontend, caplog):
    caplog.set_level(logging.INFO, logger="paved.gateway.access")
    request = service_pb2.ModelInferRequest(model_name=XGB)
    request.inputs.add(name="input__0", datatype="FP32", shape=[2, 32])
    request.raw_input_contents.append(np.zeros((2, 32), np.float32).tobytes())
    metadata = (("authorization", f"Bearer {gw.key}"), ("x-request-id", "kg-1"), ("traceparent", TRACEPARENT))
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelInfer.with_call(request, metadata=metadata, timeout=60)
        assert dict(call.trailing_metadata())["x-request-id"] == "kg-1"
    line = gateway_line(caplog, "kg-1")
    assert line["trace_id"] == TRACE_ID
    assert (line["protocol"], line["method"], line["model"], line["status"]) == (
        "kserve-grpc",
        "ModelInfer",
        XGB,
        "OK",
    )
    assert line["tenant"] == "all" and line["backend"] == "f1" and line["total_ms"] >= 0
    # Neither the key nor the tensors are in the line.
    assert gw.key not in json.dumps(line) and "raw_input_contents" not in json.dumps(line)

    # The instance logs the same request id and trace, under the gateway's span (not the client's).
    upstream = instance_line(frontend, "kg-1")
    assert upstream["trace_id"] == TRACE_ID and upstream["parent_span_id"] not in (None, CLIENT_SPAN)
    assert (upstream["method"], upstream["model"], upstream["status"]) == ("ModelInfer", XGB, "OK")

    # A refusal is logged with its gRPC code.
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}").get_model_metadata(
            "nope", headers={**gw.headers(), "x-request-id": "kg-2"}
        )
    assert gateway_line(caplog, "kg-2")["status"] == "NOT_FOUND"


def test_grpc_forwards_only_validated_ids(gw, gc, caplog):
    caplog.set_level(logging.INFO, logger="paved.gateway.access")
    request = service_pb2.ModelInferRequest(model_name="recorded", id="q2")
    metadata = (
        ("authorization", f"Bearer {gw.key}"),
        ("x-request-id", "bad id!"),
        ("traceparent", TRACEPARENT),
    )
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelInfer.with_call(request, metadata=metadata, timeout=30)
        returned = dict(call.trailing_metadata())["x-request-id"]
    forwarded = gw.recorder.metadata[-1]
    assert returned != "bad id!" and forwarded["x-request-id"] == returned
    version, trace, span, flags = forwarded["traceparent"].split("-")
    assert (version, trace, flags) == ("00", TRACE_ID, "01") and span != CLIENT_SPAN
    line = gateway_line(caplog, returned)
    assert line["trace_id"] == TRACE_ID and line["backend"] == "rec"

    # A stream's one line is written when it ends.
    inputs = llm_inputs(grpcclient, "Once", params=LLM_PARAMS, stream=True)
    headers = {**gw.headers(), "x-request-id": "ks-1"}
    responses = stream(gc, [(inputs, {})], model=LLM, headers=headers, timeout=60)
    assert [e for _, e in responses if e is not None] == []
    line = gateway_line(caplog, "ks-1")
    assert (line["method"], line["model"], line["status"]) == ("ModelStreamInfer", LLM, "OK")


def test_http_request_id_and_trace_cross_the_gateway(gw, hc, frontend, caplog):
    import httpx

    caplog.set_level(logging.INFO, logger="paved.gateway.access")
    ids = {"x-request-id": "kh-1", "traceparent": TRACEPARENT}
    hc.infer(XGB, [xgb_input(httpclient)], headers={**gw.headers(), **ids})
    line = gateway_line(caplog, "kh-1")
    assert (line["trace_id"], line["protocol"], line["method"], line["model"], line["status"]) == (
        TRACE_ID,
        "kserve-http",
        "ModelInfer",
        XGB,
        200,
    )
    assert line["tenant"] == "all" and line["backend"] == "f1"
    upstream = instance_line(frontend, "kh-1")
    assert upstream["trace_id"] == TRACE_ID and upstream["parent_span_id"] not in (None, CLIENT_SPAN)
    assert upstream["protocol"] == "kserve-http" and upstream["status"] == 200

    # The response names the request id; a malformed one is replaced, an error is logged too.
    url = f"http://127.0.0.1:{gw.http_port}/v2/models/nope/config"
    r = httpx.get(url, headers={**gw.headers(), "x-request-id": "bad id!"}, timeout=30)
    returned = r.headers["x-request-id"]
    assert r.status_code == 404 and returned != "bad id!"
    assert gateway_line(caplog, returned)["status"] == 404


def test_the_gateway_mains_grpc_port_takes_the_gateway_wide_body_bound(frontend, tmp_path):
    """--max-body-bytes bounds a gRPC message as it bounds an HTTP body (the gRPC port took
    64 MiB whatever the flag said): a 2 MiB ModelInfer under a 1 MiB bound is
    RESOURCE_EXHAUSTED; one under it is forwarded."""
    backend = {
        "id": "f1",
        "url": frontend.url,
        "version": "v1",
        "kserve_grpc": f"127.0.0.1:{frontend.kserve_grpc_port}",
    }
    routes = write_routes(tmp_path / "routes.json", [{"alias": XGB, "kind": "kserve", "backends": [backend]}])
    gateway = GatewayProcess(
        routes,
        "--kserve-grpc-port",
        "0",
        "--max-body-bytes",
        str(1 << 20),
        admin_key="adm-" + secrets.token_hex(16),
        state_dir=tmp_path,
    )
    try:
        gateway.tenant("big", models=["*"])
        metadata = (("authorization", f"Bearer {gateway.key('big')}"),)
        with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            for rows, expected in ((16 * 1024, grpc.StatusCode.RESOURCE_EXHAUSTED), (2, None)):
                request = service_pb2.ModelInferRequest(model_name=XGB)
                request.inputs.add(name="input__0", datatype="FP32", shape=[rows, 32])
                request.raw_input_contents.append(np.zeros((rows, 32), np.float32).tobytes())
                if expected is None:
                    assert len(infer(request, metadata=metadata, timeout=60).outputs) == 1
                else:
                    with pytest.raises(grpc.RpcError) as e:
                        infer(request, metadata=metadata, timeout=60)
                    assert e.value.code() == expected
    finally:
        gateway.stop()
