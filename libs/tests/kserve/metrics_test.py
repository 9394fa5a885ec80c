"""paved.kserve's request metrics (paved_kserve_*) over both transports, with tritonclient.

One in-process server (a scripted FakeEngine and the //models/xgb fixture) recording into a
registry the test holds, as the frontend's is; a server with no registry given, serving its
own at /metrics; and the frontend main (simulated engine) with its KServe listeners on, whose
/metrics carries the families. Counts are read as differences, so the tests' order is free.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import (
    LLM,
    XGB,
    FakeEngine,
    llm_inputs,
    loopback_server,
    serving,
    stream,
    tensor,
    wait_for,
    xgb_model_dir,
)
from paved.kserve.errors import KServeError
from paved.kserve.metrics import HTTP, UNKNOWN_MODEL, KServeMetrics


@pytest.fixture(scope="module")
def registry():
    return CollectorRegistry()


@pytest.fixture(scope="module")
def server(loop, registry):
    with serving(loop, loopback_server([FakeEngine()], metrics_registry=registry)) as server:
        yield server


class Reading:
    """The registry's samples now; `delta(later, ...)` is what a name + labels grew by since."""

    def __init__(self, registry: CollectorRegistry):
        self.samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect()
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)


def grew(before: Reading, after: Reading, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def xgb_inputs(module, n: int):
    x = np.random.default_rng(n).standard_normal((n, 32)).astype(np.float32)
    return [tensor(module, "input__0", x, "FP32")]


def test_grpc_and_http_inferences_are_counted_by_model_protocol_and_rows(registry, gc, hc):
    before = Reading(registry)
    gc.infer(XGB, xgb_inputs(grpcclient, 5))
    gc.infer(XGB, xgb_inputs(grpcclient, 2))
    hc.infer(XGB, xgb_inputs(httpclient, 3))
    gc.infer(LLM, llm_inputs(grpcclient, "hi", params={"max_tokens": 2}, exclude=True))
    after = Reading(registry)
    success = "paved_kserve_request_success_total"
    rows = "paved_kserve_inference_count_total"
    duration = "paved_kserve_request_duration_seconds_count"
    assert grew(before, after, success, model=XGB, protocol="grpc") == 2
    assert grew(before, after, success, model=XGB, protocol="http") == 1
    assert grew(before, after, rows, model=XGB, protocol="grpc") == 7  # 5 + 2 rows
    assert grew(before, after, rows, model=XGB, protocol="http") == 3
    assert grew(before, after, duration, model=XGB, protocol="grpc") == 2
    # An LLM request is one inference, whatever it generates.
    assert grew(before, after, success, model=LLM, protocol="grpc") == 1
    assert grew(before, after, rows, model=LLM, protocol="grpc") == 1
    for protocol in ("grpc", "http"):
        assert after.value("paved_kserve_requests_in_flight", model=XGB, protocol=protocol) == 0


def test_streams_and_http_generate_count_each_request(registry, gc, server):
    before = Reading(registry)
    requests = [
        (llm_inputs(grpcclient, f"p{i}", stream=True, params={"max_tokens": 3}), {"request_id": f"r{i}"})
        for i in range(3)
    ]
    assert all(error is None for _, error in stream(gc, requests))
    # One bad request on a stream fails in-band; the stream's other requests are unaffected.
    ((_, error),) = stream(gc, [(llm_inputs(grpcclient, "x", stream=True, exclude=False), {})])
    assert error is not None
    base = f"http://127.0.0.1:{server.http_port}/v2/models/{LLM}"
    with httpx.Client(timeout=10) as client:
        r = client.post(f"{base}/generate", json={"text_input": "a", "parameters": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        body = {"text_input": "x", "stream": True, "parameters": {"max_tokens": 3}}
        with client.stream("POST", f"{base}/generate_stream", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 3
    # The stream's outcome is recorded when its response has ended, just after the client saw it.
    success = "paved_kserve_request_success_total"
    assert wait_for(lambda: grew(before, Reading(registry), success, model=LLM, protocol="http") == 2)
    after = Reading(registry)
    assert grew(before, after, success, model=LLM, protocol="grpc") == 3
    failed = {"model": LLM, "protocol": "grpc", "status": "INVALID_ARGUMENT"}
    assert grew(before, after, "paved_kserve_request_failure_total", **failed) == 1
    assert after.value("paved_kserve_requests_in_flight", model=LLM, protocol="http") == 0


def test_failures_are_counted_with_their_status(registry, gc, hc):
    before = Reading(registry)
    bad = [tensor(grpcclient, "input__0", np.zeros((1, 7), np.float32), "FP32")]  # 32 columns wanted
    with pytest.raises(InferenceServerException):
        gc.infer(XGB, bad)
    with pytest.raises(InferenceServerException) as info:
        hc.infer(XGB, [tensor(httpclient, "input__0", np.zeros((1, 7), np.float32), "FP32")])
    assert info.value.status() == "400"
    after = Reading(registry)
    failure = "paved_kserve_request_failure_total"
    for protocol in ("grpc", "http"):
        assert grew(before, after, failure, model=XGB, protocol=protocol, status="INVALID_ARGUMENT") == 1
        assert grew(before, after, "paved_kserve_request_success_total", model=XGB, protocol=protocol) == 0
        assert after.value("paved_kserve_requests_in_flight", model=XGB, protocol=protocol) == 0
    # A failure takes no time in the latency histogram (successes only).
    assert grew(before, after, "paved_kserve_request_duration_seconds_count", model=XGB, protocol="grpc") == 0


def test_unknown_model_names_share_one_label_value(registry, gc, hc):
    before = Reading(registry)
    for i in range(5):
        with pytest.raises(InferenceServerException):
            gc.infer(f"nope-{i}", xgb_inputs(grpcclient, 1))
        with pytest.raises(InferenceServerException):
            hc.infer(f"nope-{i}", xgb_inputs(httpclient, 1))
    after = Reading(registry)
    failure = "paved_kserve_request_failure_total"
    for protocol in ("grpc", "http"):
        assert grew(before, after, failure, model=UNKNOWN_MODEL, protocol=protocol, status="NOT_FOUND") == 5
    # Every paved_kserve_* series names a served model or the one shared value, none a 'nope-i'.
    models = {dict(labels)["model"] for name, labels in after.samples if name.startswith("paved_kserve_")}
    assert models <= {XGB, LLM, UNKNOWN_MODEL}, models


def test_a_server_without_a_registry_serves_its_own_metrics(loop):
    with serving(loop, loopback_server([])) as server:
        gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            gc.infer(XGB, xgb_inputs(grpcclient, 4))
        finally:
            gc.close()
        r = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        assert "process_cpu_seconds" in families  # the process collectors, as a /metrics has
        rows = [s for s in families["paved_kserve_inference_count"].samples if s.name.endswith("_total")]
        assert [(s.labels, s.value) for s in rows] == [({"model": XGB, "protocol": "grpc"}, 4.0)]


def test_a_server_given_a_registry_leaves_serving_it_to_its_owner(server):
    r = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10)
    assert r.status_code == 404


def test_the_frontends_metrics_carry_its_kserve_listeners_requests():
    """The frontend main (simulated engine) with both KServe listeners: its /metrics shows them."""
    from servers import ServerProcess

    server = ServerProcess(
        "--engine", "sim://tiny", "--kserve-grpc-port", "0", "--kserve-http-port", "0",
        "--kserve-model-dir", xgb_model_dir(), ready_timeout_s=120,
    )  # fmt: skip
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.kserve_grpc_port}")
    hc = httpclient.InferenceServerClient(f"127.0.0.1:{server.kserve_http_port}")
    try:
        assert wait_for(lambda: gc.is_model_ready(XGB), timeout=60), server.tail()
        gc.infer(XGB, xgb_inputs(grpcclient, 3))
        hc.infer(XGB, xgb_inputs(httpclient, 2))
        with pytest.raises(InferenceServerException):
            gc.infer("nope", xgb_inputs(grpcclient, 1))
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'paved_kserve_request_success_total{model="xgb_scorer",protocol="grpc"} 1.0' in text, text
        assert 'paved_kserve_request_success_total{model="xgb_scorer",protocol="http"} 1.0' in text
        assert 'paved_kserve_inference_count_total{model="xgb_scorer",protocol="grpc"} 3.0' in text
        failure = 'paved_kserve_request_failure_total{model="(unknown)",protocol="grpc",status="NOT_FOUND"}'
        assert f"{failure} 1.0" in text
        assert "paved_http_requests_total" in text  # the frontend's own families, same exposition
        # The KServe HTTP port serves no second copy: the frontend's port is the one to scrape.
        assert httpx.get(f"http://127.0.0.1:{server.kserve_http_port}/metrics", timeout=10).status_code == 404
    finally:
        gc.close()
        hc.close()
        server.terminate()


def test_a_client_that_hangs_up_mid_upload_is_counted_cancelled_not_internal():
    import asyncio

    import grpc
    from starlette.requests import Request

    from paved.kserve.http_server import _read_body

    # Starlette's own request over an ASGI receive that delivers part of the body, then the
    # client's disconnect (what request.stream() turns into ClientDisconnect).
    messages = iter(
        [{"type": "http.request", "body": b'{"in', "more_body": True}, {"type": "http.disconnect"}]
    )

    async def receive():
        return next(messages)

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    own = CollectorRegistry()
    record = KServeMetrics(own, lambda name: name == "m").request("m", HTTP)
    with pytest.raises(KServeError) as info, record.failures():
        asyncio.run(_read_body(request, 1 << 20))
    assert info.value.code == grpc.StatusCode.CANCELLED
    labels = {"model": "m", "protocol": HTTP}
    failures = "paved_kserve_request_failure_total"
    assert own.get_sample_value(failures, {**labels, "status": "CANCELLED"}) == 1
    assert own.get_sample_value(failures, {**labels, "status": "INTERNAL"}) is None
    assert own.get_sample_value("paved_kserve_requests_in_flight", labels) == 0
