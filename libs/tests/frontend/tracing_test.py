"""Request ids and trace context through the frontend main (simulated engine) and through the
gateway main in front of it: x-request-id echoed on every response, well-formed ids and
traceparents continued (malformed ones replaced), the id inside the engine request id (unique
per request), and one JSON access line per request on `paved.frontend.access` naming the same
request id and trace id as the gateway's access line, with token counts and never the body or
the authorization header."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

import httpx
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

SIM = "sim://tiny?tokens_per_s=400"
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def frontend():
    server = ServerProcess("--engine", SIM, ready_timeout_s=120)
    try:
        yield server
    finally:
        server.terminate()


def _log_text(proc: ServerProcess | GatewayProcess) -> str:
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")


def _access_lines(proc: ServerProcess | GatewayProcess, logger: str) -> list[dict[str, Any]]:
    marker = f" {logger}: "
    return [json.loads(line.split(marker, 1)[1]) for line in _log_text(proc).splitlines() if marker in line]


def _access_line(proc: ServerProcess | GatewayProcess, request_id: str, logger: str) -> dict[str, Any]:
    """The one access line for `request_id` (written once the response has ended, so shortly
    after the client saw it: waited for, with a deadline)."""
    deadline = time.monotonic() + 20
    while True:
        found = [entry for entry in _access_lines(proc, logger) if entry["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(found) == 1, (request_id, proc.tail())
    return found[0]


def _frontend_line(frontend: ServerProcess, request_id: str) -> dict[str, Any]:
    return _access_line(frontend, request_id, "paved.frontend.access")


def _chat(url: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers, timeout=30)


def test_given_ids_are_echoed_continued_logged_and_in_the_engine_request_id(frontend):
    request_id = f"client.req-{secrets.token_hex(4)}:A_1"
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    secret, marker = "Bearer sk-" + secrets.token_hex(12), "zebra" + secrets.token_hex(6)
    r = _chat(
        frontend.url,
        {"x-request-id": request_id, "traceparent": f"00-{trace_id}-{span_id}-01", "authorization": secret},
        messages=[{"role": "user", "content": marker}],
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    body = r.json()
    # The chat completion's id is the engine request id vLLM logs and aborts by.
    assert body["id"].startswith(f"chatcmpl-{request_id}-")
    line = _frontend_line(frontend, request_id)
    assert line["trace_id"] == trace_id
    assert line["parent_span_id"] == span_id
    assert _HEX16.fullmatch(line["span_id"]) and line["span_id"] != span_id
    assert (line["method"], line["path"], line["model"], line["status"]) == (
        "POST",
        "/v1/chat/completions",
        "tiny",
        200,
    )
    assert line["prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert line["completion_tokens"] == body["usage"]["completion_tokens"] > 0
    assert line["duration_ms"] >= 0
    # The key names other tools grep for lead the line.
    assert list(line)[:2] == ["request_id", "trace_id"]
    text = _log_text(frontend)
    assert marker not in text and secret not in text and "sk-" not in text


def test_a_reused_request_id_still_gives_distinct_engine_request_ids(frontend):
    request_id = "reused-" + secrets.token_hex(4)
    ids = set()
    for _ in range(2):
        r = httpx.post(
            frontend.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            headers={"x-request-id": request_id},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == request_id
        assert r.json()["id"].startswith(f"cmpl-{request_id}-")
        ids.add(r.json()["id"])
    assert len(ids) == 2


@pytest.mark.parametrize(
    "given",
    ["has space", "x" * 129, "", "semi;colon", "ünicode"],
)
def test_a_malformed_request_id_and_traceparent_are_replaced(frontend, given):
    before = {e["request_id"] for e in _access_lines(frontend, "paved.frontend.access")}
    r = httpx.post(
        frontend.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        headers={"x-request-id": given.encode(), "traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    assert request_id != given and _ID.fullmatch(request_id)
    assert request_id not in before
    line = _frontend_line(frontend, request_id)
    # An all-zero trace id is invalid: a new trace, no parent.
    assert _HEX32.fullmatch(line["trace_id"]) and line["trace_id"] != "0" * 32
    assert line["parent_span_id"] is None


def test_no_ids_given_starts_a_trace(frontend):
    r = httpx.get(frontend.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]
    line = _frontend_line(frontend, request_id)
    assert _HEX32.fullmatch(line["trace_id"]) and line["parent_span_id"] is None
    assert (line["path"], line["status"], line["model"]) == ("/v1/models", 200, None)
    assert "prompt_tokens" not in line


def test_errors_echo_the_request_id_and_are_logged(frontend):
    unknown = "unknown-" + secrets.token_hex(4)
    r = _chat(frontend.url, {"x-request-id": unknown}, model="no-such-model")
    assert r.status_code == 404 and r.headers["x-request-id"] == unknown
    assert _frontend_line(frontend, unknown)["model"] == "no-such-model"
    assert _frontend_line(frontend, unknown)["status"] == 404

    invalid = "invalid-" + secrets.token_hex(4)
    r = _chat(frontend.url, {"x-request-id": invalid}, max_tokens=-1)
    assert r.status_code == 400 and r.headers["x-request-id"] == invalid
    assert _frontend_line(frontend, invalid)["status"] == 400

    missing = "missing-" + secrets.token_hex(4)
    r = httpx.get(frontend.url + "/no/such/route", headers={"x-request-id": missing}, timeout=10)
    assert r.status_code == 404 and r.headers["x-request-id"] == missing


def test_a_stream_is_logged_once_it_ended_with_its_tokens(frontend):
    request_id = "stream-" + secrets.token_hex(4)
    usage = None
    with httpx.stream(
        "POST",
        frontend.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"x-request-id": request_id},
        timeout=30,
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == request_id
        for raw in r.iter_lines():
            if raw.startswith("data: {"):
                event = json.loads(raw[len("data: ") :])
                assert event["id"].startswith(f"chatcmpl-{request_id}-")
                usage = event.get("usage") or usage
    assert usage is not None
    line = _frontend_line(frontend, request_id)
    assert line["status"] == 200
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_the_gateway_and_the_frontend_log_the_same_request_and_trace(frontend, tmp_path):
    routes = write_routes(
        tmp_path / "routes.json",
        [{"alias": "tiny", "backends": [{"url": frontend.url, "version": "v1"}]}],
    )
    gw = GatewayProcess(routes, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path)
    try:
        gw.tenant("acme", models=["tiny"])
        key = gw.key("acme")
        request_id = "via-gw-" + secrets.token_hex(4)
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        headers = {
            "authorization": f"Bearer {key}",
            "x-request-id": request_id,
            "traceparent": f"00-{trace_id}-{client_span}-01",
        }
        deadline = time.monotonic() + 30
        while True:  # the gateway's first health check marks the frontend routable
            r = _chat(gw.url, headers)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
            request_id = "via-gw-" + secrets.token_hex(4)
            headers["x-request-id"] = request_id
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == request_id
        assert r.json()["id"].startswith(f"chatcmpl-{request_id}-")
        gateway_line = _access_line(gw, request_id, "paved.gateway.access")
        assert gateway_line["status"] == 200
        assert gateway_line["trace_id"] == trace_id
        line = _frontend_line(frontend, request_id)
        # The gateway continued the client's trace with a span of its own: the frontend's parent.
        assert line["trace_id"] == trace_id
        assert line["parent_span_id"] is not None and line["parent_span_id"] != client_span
        assert line["span_id"] not in (client_span, line["parent_span_id"])
        assert line["status"] == 200 and line["model"] == "tiny"
        assert key not in _log_text(frontend)
    finally:
        gw.stop()


def test_new_ids_are_well_formed_and_independent():
    """One read of randomness gives a request its request, trace and span ids: each of its W3C
    length, none a part of another, and new for every request."""
    from paved.http.tracing import trace_context

    seen = set()
    for _ in range(200):
        context = trace_context({})
        assert _HEX32.fullmatch(context.request_id) and _HEX32.fullmatch(context.trace_id)
        assert _HEX16.fullmatch(context.span_id) and context.parent_span_id is None
        assert context.trace_id != "0" * 32 and context.span_id != "0" * 16
        ids = (context.request_id, context.trace_id, context.span_id)
        assert not any(a != b and a in b for a in ids for b in ids)
        seen.update(ids)
    assert len(seen) == 600
