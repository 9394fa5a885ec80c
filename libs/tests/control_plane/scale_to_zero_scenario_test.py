"""Scale to zero with real processes: the control-plane main (local driver, launchers of the tiny
package on the simulated engine) and gateway mains following its routes, the official `openai`
client and httpx as callers.

1. An idle deployment goes to zero, its alias stays in /v1/models and in the routes (marked),
   a burst through two gateway replicas at once is held, wakes it, and is answered in full: one
   wake event, one replica started.
2. A gateway holding requests for a model at zero (a routes file: nothing wakes it): a full
   queue and an expired wait are 503 with Retry-After and an OpenAI error body, never a 404 or
   a hang; a client that leaves is removed from the queue at once.
3. KServe v2 and version pins at zero (the tiny package declaring KServe, on the simulated
   engine): tritonclient gRPC (bare and `model_version` v1, unary and a stream), tritonclient
   HTTP and an OpenAI `tiny@v1` request are held together, wake the model once and are
   answered; `tiny@v9` is unknown on every protocol; ModelReady is false and the repository
   index lists it while at zero; a metadata call at zero answers UNAVAILABLE "waking" and
   wakes it.
4. KServe refusals at zero (a routes file): gRPC, HTTP v2 and OpenAI requests share the model's
   one queue (a full queue refuses whichever protocol comes second: UNAVAILABLE with a
   retry-after trailer / 503 + Retry-After with the KServe or OpenAI body), an expired wait
   says the model is scaled to zero, a gRPC client's deadline and an HTTP client that leaves
   end their wait at once.
"""

from __future__ import annotations

import asyncio
import queue
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fleet import FAST, SIM, chat_burst, gateway_for, make_fleet, tiny_package
from gateway_proc import GatewayProcess, write_routes
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from paved.gateway.routing.routes import parse_routes
from paved.runfiles import runfile


@pytest.fixture
def fleet(tmp_path):
    with make_fleet(tmp_path) as make:
        yield make


def _metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _routes(cp) -> dict:
    r = httpx.get(cp.url + "/v1/routes", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=10)
    return r.json()


def _has_table(gw: GatewayProcess, revision: str) -> bool:
    return gw.admin("GET", "/admin/v1/routes").json()["revision"] == revision


async def _burst(url: str, key: str, n: int) -> list[int | str]:
    return [status for status, _ in await chat_burst(url, key, n)]


def test_an_idle_model_goes_to_zero_and_a_burst_through_two_gateways_wakes_it_once(fleet, tmp_path):
    cp, gw, key = fleet()
    gw2 = gateway_for(cp, tmp_path / "gw2")
    try:
        gw2.tenant("team")
        key2 = gw2.key("team")
        cp.api(
            "POST",
            "/v1/deployments",
            {
                "model_id": "tiny",
                "version": "v1",
                "package_uri": tiny_package(),
                "engine": SIM,
                "min_replicas": 0,
                "replicas": 1,
                "autoscale": {"enabled": True, "scale_to_zero_after_s": 2},
            },
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded"

        # Idle: scaled to zero, drained, the alias kept in the routes with no backend.
        cp.wait_for(
            "tiny at zero in the routes",
            lambda: [m for m in _routes(cp)["table"]["models"] if m.get("scaled_to_zero")],
        )
        cp.wait_for(
            "its replica drained", lambda: not [x for x in cp.replicas("tiny") if x["state"] != "stopped"]
        )
        audit = cp.api("GET", "/v1/audit?model_id=tiny&limit=1000")["data"]
        (to_zero,) = [e for e in audit if e["data"].get("mode") == "to_zero"]
        table = _routes(cp)["table"]
        (model,) = table["models"]
        assert model["backends"] == [] and model["scaled_to_zero"] and "waking" not in model
        revision = parse_routes(table).revision
        for g in (gw, gw2):
            cp.wait_for("the gateway following the table at zero", lambda g=g: _has_table(g, revision))
        models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert "tiny" in {m["id"] for m in models.json()["data"]}, models.text

        # A burst through both gateways at once: held, one wake, every request answered.
        async def both() -> list[int | str]:
            a, b = await asyncio.gather(_burst(gw.url, key, 12), _burst(gw2.url, key2, 12))
            return a + b

        results = asyncio.run(both())
        assert results == [200] * 24, results
        audit = cp.api("GET", f"/v1/audit?model_id=tiny&after_id={to_zero['id']}&limit=1000")["data"]
        wakes = [e for e in audit if e["data"].get("mode") == "wake"]
        started = [e for e in audit if e["kind"] == "scale" and e["message"].startswith("started replica")]
        assert len(wakes) == 1 and len(started) == 1, [e["message"] for e in audit]
        for g in (gw, gw2):
            assert _metric(g, "paved_gateway_wake_calls_total", model="tiny", outcome="ok") >= 1, g.tail()
            assert _metric(g, "paved_gateway_held_requests", model="tiny") == 0
    finally:
        gw2.stop()


def test_requests_held_for_a_model_at_zero_are_refused_with_503_when_full_or_late(tmp_path):
    routes = write_routes(tmp_path / "routes.json", [{"alias": "tiny", "scaled_to_zero": True}])
    admin = "adm-" + secrets.token_hex(16)
    # A routes file: no control plane to wake the model, so nothing ever releases the queue.
    short = GatewayProcess(
        routes, "--queue-size", "2", "--wake-max-wait", "2", admin_key=admin, state_dir=tmp_path
    )
    (tmp_path / "long").mkdir()
    long = GatewayProcess(routes, "--wake-max-wait", "600", admin_key=admin, state_dir=tmp_path / "long")
    try:
        short.tenant("team")
        key = short.key("team")
        models = httpx.get(short.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert [m["id"] for m in models.json()["data"]] == ["tiny"], models.text

        async def three() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(
                    await asyncio.gather(
                        *(
                            client.post(
                                short.url + "/v1/chat/completions",
                                headers={"Authorization": f"Bearer {key}"},
                                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                            )
                            for _ in range(3)
                        )
                    )
                )

        answers = asyncio.run(three())
        codes = sorted(r.json()["error"]["code"] for r in answers)
        assert codes == ["queue_full", "queue_timeout", "queue_timeout"], [r.text for r in answers]
        for r in answers:
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
        late = [r.json()["error"]["message"] for r in answers if r.json()["error"]["code"] == "queue_timeout"]
        assert all("scaled to zero" in m for m in late), late
        assert _metric(short, "paved_gateway_held_requests", model="tiny") == 0

        # A client that leaves while held is out of the queue at once (its wait is 600 s).
        long.tenant("team")
        key = long.key("team")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                long.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                timeout=httpx.Timeout(10, read=1),
            )
        deadline = time.monotonic() + 60
        while _metric(long, "paved_gateway_held_requests", model="tiny") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(long, "paved_gateway_held_requests", model="tiny") == 0, long.tail()
        assert _metric(long, "paved_gateway_queue_depth", model="tiny") == 0
        assert _metric(long, "paved_gateway_client_disconnects_total", model="tiny") == 1
    finally:
        short.stop()
        long.stop()


# ---- KServe v2 and version pins at zero ------------------------------------------------------

PARAMS = '{"max_tokens": 4, "temperature": 0}'


def _llm_inputs(module) -> list:
    """Triton vLLM-backend inputs (text_input, sampling_parameters) for a tritonclient module."""
    inputs = []
    for name, value in (("text_input", b"hello"), ("sampling_parameters", PARAMS.encode())):
        tensor = module.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value], dtype=object))
        inputs.append(tensor)
    return inputs


def _infer_request(version: str = "") -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="tiny", model_version=version)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(b"hello").to_bytes(4, "little") + b"hello")
    return request


def _raw_grpc(gw: GatewayProcess, key: str, method: str, request, timeout: float = 60):
    """(status code, details, trailing metadata, response or None) of one call on the raw stub,
    which shows the trailers tritonclient hides."""
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            response, _ = getattr(stub, method).with_call(
                request, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout
            )
        except grpc.RpcError as e:
            return e.code(), e.details(), dict(e.trailing_metadata() or ()), None
        return grpc.StatusCode.OK, "", {}, response


def _v2_infer(
    gw: GatewayProcess, key: str, path: str = "/v2/models/tiny/infer", timeout: float | httpx.Timeout = 60
) -> httpx.Response:
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}
    return httpx.post(gw.url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=timeout)


def _chat(gw: GatewayProcess, key: str, model: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
        timeout=120,
    )


def _audit(cp, after_id: int) -> list[dict]:
    return cp.api("GET", f"/v1/audit?model_id=tiny&after_id={after_id}&limit=1000")["data"]


def _at_zero(cp) -> bool:
    models = _routes(cp)["table"]["models"]
    return bool(models) and all(m.get("scaled_to_zero") for m in models)


def test_kserve_calls_and_version_pins_for_a_model_at_zero_are_held_and_wake_it(fleet, tmp_path):
    cp, _, _ = fleet()
    gw = gateway_for(cp, tmp_path / "gwk", "--kserve-grpc-port", "0")
    auth = {}
    try:
        gw.tenant("team")
        key = gw.key("team")
        auth = {"authorization": f"Bearer {key}"}
        cp.api(
            "POST",
            "/v1/deployments",
            {
                "model_id": "tiny",
                "version": "v1",
                "package_uri": runfile("services/launcher/tiny_kserve_package.tar"),
                "engine": SIM,
                "min_replicas": 0,
                "replicas": 1,
                "autoscale": {"enabled": True, "scale_to_zero_after_s": 2},
            },
        )
        r = cp.api("POST", "/v1/rollouts", {"model_id": "tiny", "version": "v1", "params": FAST})
        assert cp.wait_rollout(r["id"])["status"] == "succeeded"
        cp.wait_for("tiny at zero in the routes", lambda: _at_zero(cp))
        cp.wait_for(
            "its replica drained", lambda: not [x for x in cp.replicas("tiny") if x["state"] != "stopped"]
        )
        table = _routes(cp)["table"]
        (model,) = table["models"]
        # The control plane publishes the versions a wake brings up.
        assert model["versions"] == ["v1"] and model["backends"] == [], model
        revision = parse_routes(table).revision
        cp.wait_for("the gateway following the table at zero", lambda: _has_table(gw, revision))
        (to_zero,) = [e for e in _audit(cp, 0) if e["data"].get("mode") == "to_zero"]

        # At zero: not ready, still listed, a pin to an unknown version is unknown everywhere.
        gc = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
        hc = httpclient.InferenceServerClient(gw.url.removeprefix("http://"))
        try:
            assert not gc.is_model_ready("tiny", headers=auth)
            assert not hc.is_model_ready("tiny", headers=dict(auth))
            index = gc.get_model_repository_index(headers=auth, as_json=True)["models"]
            assert [(m["name"], m["state"]) for m in index] == [("tiny", "UNAVAILABLE")], index
            assert "scaled to zero" in index[0]["reason"]
            assert _chat(gw, key, "tiny@v9").status_code == 404
            code, *_ = _raw_grpc(gw, key, "ModelInfer", _infer_request("v9"))
            assert code == grpc.StatusCode.NOT_FOUND
            assert _v2_infer(gw, key, "/v2/models/tiny/versions/v9/infer").status_code == 404
            models = httpx.get(gw.url + "/v1/models", headers=auth, timeout=10).json()["data"]
            assert {m["id"] for m in models} == {"tiny", "tiny@v1"}, models

            # One burst over every protocol, held together; one wake; every call answered.
            def grpc_infer(version: str) -> str:
                result = gc.infer("tiny", _llm_inputs(grpcclient), model_version=version, headers=auth)
                return result.as_numpy("text_output")[0].decode()

            def grpc_stream() -> str:
                client = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.grpc_port}")
                results: queue.Queue = queue.Queue()
                client.start_stream(callback=lambda result, error: results.put((result, error)), headers=auth)
                try:
                    client.async_stream_infer("tiny", _llm_inputs(grpcclient))
                    result, error = results.get(timeout=120)
                    assert error is None, error
                    return result.as_numpy("text_output")[0].decode()
                finally:
                    client.stop_stream()
                    client.close()

            def http_infer() -> str:
                # Its own client: tritonclient.http (gevent) serves only the thread that made it.
                client = httpclient.InferenceServerClient(gw.url.removeprefix("http://"), network_timeout=120)
                try:
                    # A copy: tritonclient.http adds its own headers to the dict it is given.
                    result = client.infer("tiny", _llm_inputs(httpclient), headers=dict(auth))
                    return result.as_numpy("text_output")[0].decode()
                finally:
                    client.close()

            def pinned_chat() -> str:
                r = _chat(gw, key, "tiny@v1")
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            with ThreadPoolExecutor(5) as pool:
                calls = [
                    pool.submit(grpc_infer, ""),
                    pool.submit(grpc_infer, "v1"),
                    pool.submit(grpc_stream),
                    pool.submit(http_infer),
                    pool.submit(pinned_chat),
                ]
                answers = [c.result(timeout=300) for c in calls]
            assert all(isinstance(a, str) and a for a in answers), answers
            audit = _audit(cp, to_zero["id"])
            wakes = [e for e in audit if e["data"].get("mode") == "wake"]
            started = [
                e for e in audit if e["kind"] == "scale" and e["message"].startswith("started replica")
            ]
            assert len(wakes) == 1 and len(started) == 1, [e["message"] for e in audit]
            assert _metric(gw, "paved_gateway_wake_calls_total", model="tiny", outcome="ok") >= 1, gw.tail()
            assert _metric(gw, "paved_gateway_held_requests", model="tiny") == 0
            assert gc.is_model_ready("tiny", headers=auth)

            # At zero again: metadata is a replica's to tell, so the call answers "waking" and
            # wakes the model; once it is routed the metadata comes from the replica.
            cp.wait_for("tiny at zero again", lambda: _at_zero(cp))
            revision = parse_routes(_routes(cp)["table"]).revision
            cp.wait_for("the gateway following it", lambda: _has_table(gw, revision))
            last = max(e["id"] for e in _audit(cp, to_zero["id"]))
            request = service_pb2.ModelMetadataRequest(name="tiny")
            code, details, trailers, _ = _raw_grpc(gw, key, "ModelMetadata", request)
            assert code == grpc.StatusCode.UNAVAILABLE and "scaled to zero and waking" in details, details
            assert int(trailers["retry-after"]) >= 1, trailers
            cp.wait_for(
                "a wake from the metadata call",
                lambda: [e for e in _audit(cp, last) if e["data"].get("mode") == "wake"],
            )
            cp.wait_for("tiny routed again", lambda: not _at_zero(cp))
            cp.wait_for("its metadata through the gateway", lambda: _metadata_name(gc, auth) == "tiny")
        finally:
            gc.close()
            hc.close()
    finally:
        gw.stop()


def _metadata_name(gc, auth: dict) -> str | None:
    try:
        return gc.get_model_metadata("tiny", headers=auth).name
    except InferenceServerException:
        return None


def test_kserve_requests_held_for_a_model_at_zero_share_its_queue_and_are_refused_when_full_or_late(tmp_path):
    routes = write_routes(
        tmp_path / "routes.json", [{"alias": "tiny", "scaled_to_zero": True, "versions": ["v1"]}]
    )
    admin = "adm-" + secrets.token_hex(16)
    # A routes file: nothing wakes the model, so nothing releases its queue.
    short = GatewayProcess(
        routes, "--kserve-grpc-port", "0", "--queue-size", "1", "--wake-max-wait", "6",
        admin_key=admin, state_dir=tmp_path,
    )  # fmt: skip
    (tmp_path / "long").mkdir()
    long = GatewayProcess(
        routes,
        "--kserve-grpc-port",
        "0",
        "--wake-max-wait",
        "600",
        admin_key=admin,
        state_dir=tmp_path / "long",
    )
    try:
        short.tenant("team")
        key = short.key("team")

        # One queue for every protocol: whichever comes second and third finds it full.
        with ThreadPoolExecutor(3) as pool:
            grpc_call = pool.submit(_raw_grpc, short, key, "ModelInfer", _infer_request("v1"))
            http_call = pool.submit(_v2_infer, short, key)
            openai_call = pool.submit(_chat, short, key, "tiny")
            code, details, trailers, _ = grpc_call.result(timeout=120)
            v2, chat = http_call.result(timeout=120), openai_call.result(timeout=120)
        assert code == grpc.StatusCode.UNAVAILABLE and int(trailers["retry-after"]) >= 1, (code, details)
        assert v2.status_code == 503 and int(v2.headers["retry-after"]) >= 1, v2.text
        assert chat.status_code == 503 and int(chat.headers["retry-after"]) >= 1, chat.text
        assert set(v2.json()) == {"error"}  # the KServe error body
        outcomes = [
            "full" if "queue is full" in details else "late" if "scaled to zero" in details else details,
            "full"
            if "queue is full" in v2.json()["error"]
            else "late"
            if "scaled to zero" in v2.json()["error"]
            else v2.text,
            {"queue_full": "full", "queue_timeout": "late"}.get(chat.json()["error"]["code"], chat.text),
        ]
        assert sorted(outcomes) == ["full", "full", "late"], outcomes
        assert _metric(short, "paved_gateway_held_requests", model="tiny") == 0

        # Not ready, unknown versions, metadata only from a replica; nothing here hangs.
        code, _, _, ready = _raw_grpc(short, key, "ModelReady", service_pb2.ModelReadyRequest(name="tiny"))
        assert code == grpc.StatusCode.OK and not ready.ready
        code, *_ = _raw_grpc(short, key, "ModelInfer", _infer_request("v9"))
        assert code == grpc.StatusCode.NOT_FOUND
        code, details, trailers, _ = _raw_grpc(
            short, key, "ModelConfig", service_pb2.ModelConfigRequest(name="tiny")
        )
        assert code == grpc.StatusCode.UNAVAILABLE and int(trailers["retry-after"]) >= 1, details
        auth = {"authorization": f"Bearer {key}"}
        meta = httpx.get(short.url + "/v2/models/tiny", headers=auth, timeout=10)
        assert meta.status_code == 503 and int(meta.headers["retry-after"]) >= 1, meta.text
        assert "scaled to zero" in meta.json()["error"]
        assert httpx.get(short.url + "/v2/models/tiny/ready", headers=auth, timeout=10).status_code == 400

        # A gRPC client's deadline and an HTTP client that leaves end their wait (600 s) at once.
        long.tenant("team")
        key = long.key("team")
        code, *_ = _raw_grpc(long, key, "ModelInfer", _infer_request(), timeout=1)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(httpx.ReadTimeout):
            _v2_infer(long, key, timeout=httpx.Timeout(10, read=1))
        _wait_held(long, 0)
        # And a gRPC client that cancels (no deadline of its own).
        with grpc.insecure_channel(f"127.0.0.1:{long.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelInfer.future(_infer_request(), metadata=(("authorization", f"Bearer {key}"),))
            _wait_held(long, 1)
            call.cancel()
        _wait_held(long, 0)
        assert _metric(long, "paved_gateway_queue_depth", model="tiny") == 0
    finally:
        short.stop()
        long.stop()


def _wait_held(gw: GatewayProcess, n: int) -> None:
    """Until the gateway holds `n` requests for tiny (a minute at most, then the assertion)."""
    deadline = time.monotonic() + 60
    while _metric(gw, "paved_gateway_held_requests", model="tiny") != n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(gw, "paved_gateway_held_requests", model="tiny") == n, gw.tail()
