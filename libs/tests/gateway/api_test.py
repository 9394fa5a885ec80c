"""The gateway's OpenAI surface end to end, over real processes on loopback: the gateway main
(SQLite state, in-process limiter) in front of two paved frontends serving the simulated
engine. Keys, tenants, 401/404/429/503, streaming (usage, disconnects, resets), failover,
live routes reloads under load, bodies and headers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

SIM = "sim://tiny?tokens_per_s=400&max_num_seqs=64"
SLOW = "sim://tiny?tokens_per_s=20&max_num_seqs=64"


def _backend(server: ServerProcess, version: str = "v1", **extra) -> dict:
    return {"url": server.url, "version": version, **extra}


@pytest.fixture(scope="module")
def frontends():
    servers = [ServerProcess("--engine", SIM, ready_timeout_s=120) for _ in range(2)]
    yield servers
    for s in servers:
        s.terminate()


@pytest.fixture(scope="module")
def gateway(frontends, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    routes = write_routes(
        tmp / "routes.json",
        [
            {"alias": "tiny", "strategy": "least_outstanding", "backends": [_backend(s) for s in frontends]},
            {"alias": "secret-model", "backends": [_backend(frontends[0], upstream_model="tiny")]},
            {
                "alias": "scorer",
                "kind": "kserve",
                "backends": [_backend(frontends[0], id="scorer-0", kserve_http="http://127.0.0.1:9")],
            },
        ],
    )
    gw = GatewayProcess(
        routes, "--health-interval", "0.5", admin_key="adm-" + secrets.token_hex(16), state_dir=tmp
    )
    gw.routes_path = routes  # type: ignore[attr-defined]
    try:
        gw.tenant("acme", models=["tiny"])
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def key(gateway):
    return gateway.key("acme", name="tests")


def _client(gateway, key, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def test_chat_and_completions_through_the_openai_client(gateway, key):
    client = _client(gateway, key)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    chat = raw.parse()
    assert chat.choices[0].message.content is not None
    assert chat.usage.completion_tokens > 0
    assert raw.headers["x-paved-backend"].startswith("http://127.0.0.1:")
    assert raw.headers["x-request-id"]
    assert int(raw.headers.get("x-ratelimit-remaining-requests", "1")) >= 0
    done = client.completions.create(model="tiny", prompt="once upon", max_tokens=5)
    assert done.usage.completion_tokens > 0


def test_request_id_is_propagated_and_traceparent_continued(gateway, key):
    rid = "req-" + secrets.token_hex(6)
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {key}",
            "x-request-id": rid,
            "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01",
        },
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    # A malformed id is replaced, never echoed.
    r = httpx.post(
        gateway.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}", "x-request-id": "bad id\twith spaces"},
        json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] != "bad id\twith spaces"


def test_streaming_strips_usage_unless_asked(gateway, key):
    client = _client(gateway, key)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens > 0


def test_structured_output_passes_through(gateway, key):
    client = _client(gateway, key)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a number"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(out.choices[0].message.content)["n"], int)


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Bearer", "missing_api_key"),
        ("Basic dXNlcjpwdw==", "invalid_api_key"),
        ("Bearer pvd_aaaaaaaaaaaa_" + "x" * 32, "invalid_api_key"),
        ("Bearer not-a-key", "invalid_api_key"),
        ("Bearer " + "A" * 5000, "invalid_api_key"),
    ],
)
def test_bad_keys_get_401_with_an_openai_body(gateway, authorization, code):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = httpx.post(gateway.url + "/v1/chat/completions", headers=headers, json={"model": "tiny"}, timeout=10)
    assert r.status_code == 401, r.text
    error = _error(r)
    assert error["code"] == code
    assert "x" * 32 not in error["message"] and "A" * 100 not in error["message"]


def test_revoked_and_expired_keys_get_401(gateway):
    gateway.tenant("revokers", models=["tiny"])
    key = gateway.key("revokers")
    ok = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200
    key_id = key.split("_")[1]
    assert gateway.admin("POST", f"/admin/v1/keys/{key_id}/revoke").status_code == 200
    deadline = time.monotonic() + 1.0
    status = 200
    while time.monotonic() < deadline and status == 200:
        status = httpx.get(
            gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
        ).status_code
        time.sleep(0.05)
    assert status == 401
    expired = gateway.key("revokers", expires_in_s=1)
    time.sleep(1.2)
    r = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {expired}"}, timeout=10)
    assert r.status_code == 401 and _error(r)["code"] == "expired_api_key"


def test_model_not_allowed_is_indistinguishable_from_unknown(gateway, key):
    headers = {"Authorization": f"Bearer {key}"}
    hidden = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers=headers,
        json={"model": "secret-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    unknown = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers=headers,
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert hidden.status_code == unknown.status_code == 404
    assert _error(hidden)["message"].replace("secret-model", "M") == _error(unknown)["message"].replace(
        "no-such-model", "M"
    )
    ids = [m["id"] for m in httpx.get(gateway.url + "/v1/models", headers=headers, timeout=10).json()["data"]]
    assert "tiny" in ids and "tiny@v1" in ids and not any(i.startswith("secret-model") for i in ids)
    assert httpx.get(gateway.url + "/v1/models/secret-model", headers=headers, timeout=10).status_code == 404


def test_version_pinning(gateway, key):
    client = _client(gateway, key)
    out = client.completions.create(model="tiny@v1", prompt="x", max_tokens=2)
    assert out.choices
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny@v9", prompt="x", max_tokens=2)


def test_request_limit_gives_429_with_retry_after(gateway):
    gateway.tenant("limited", models=["tiny"], limits={"requests_per_min": 2})
    key = gateway.key("limited")
    statuses = []
    last = None
    for _ in range(4):
        last = httpx.post(
            gateway.url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            timeout=10,
        )
        statuses.append(last.status_code)
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429]
    assert int(last.headers["retry-after"]) >= 1
    assert last.headers["x-ratelimit-limit-requests"] == "2"
    assert _error(last)["type"] == "rate_limit_error"


def test_token_limit_reserves_prompt_plus_max_tokens(gateway):
    gateway.tenant("tokens", models=["tiny"], limits={"tokens_per_min": 400})
    key = gateway.key("tokens")
    headers = {"Authorization": f"Bearer {key}"}
    # Bigger than the whole per-minute budget: never admitted, whatever the wait.
    r = httpx.post(
        gateway.url + "/v1/completions",
        headers=headers,
        json={"model": "tiny", "prompt": "x", "max_tokens": 1000},
        timeout=10,
    )
    assert r.status_code == 429 and "retry-after" not in r.headers, r.text
    ok = httpx.post(
        gateway.url + "/v1/completions",
        headers=headers,
        json={"model": "tiny", "prompt": "x", "max_tokens": 300},
        timeout=10,
    )
    assert ok.status_code == 200, ok.text
    # Reconciled on finish: the unused part of the 300-token reservation came back.
    used = ok.json()["usage"]["total_tokens"]
    # Fits only if the unused part came back (without reconciling, 97 tokens would be left).
    second = 400 - used - 20
    assert second > 97 + 20, f"the first answer used {used} tokens; the test needs a shorter one"
    again = httpx.post(
        gateway.url + "/v1/completions",
        headers=headers,
        json={"model": "tiny", "prompt": "x", "max_tokens": second},
        timeout=10,
    )
    assert again.status_code == 200, again.text


def test_bodies_and_headers_are_validated(gateway, key):
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    url = gateway.url + "/v1/chat/completions"
    assert httpx.post(url, headers=headers, content=b"{not json", timeout=10).status_code == 400
    assert httpx.post(url, headers=headers, content=b"[1,2]", timeout=10).status_code == 400
    assert httpx.post(url, headers=headers, content=b"\xff\xfe", timeout=10).status_code == 400
    assert httpx.post(url, headers=headers, json={"messages": []}, timeout=10).status_code == 400
    bad = httpx.post(
        url, headers=headers, json={"model": "tiny", "max_tokens": -1, "messages": []}, timeout=10
    )
    assert bad.status_code == 400 and _error(bad)["param"] == "max_tokens"
    big = httpx.post(url, headers=headers, content=b"x" * (33 * 1024 * 1024), timeout=30)
    assert big.status_code == 413
    # The upstream's own validation errors pass through as they are.
    r = httpx.post(url, headers=headers, json={"model": "tiny", "messages": "nope"}, timeout=10)
    assert r.status_code == 400 and _error(r)


def test_admin_api_needs_the_admin_key(gateway, key):
    for auth in (None, f"Bearer {key}", "Bearer wrong"):
        headers = {} if auth is None else {"Authorization": auth}
        r = httpx.get(gateway.url + "/admin/v1/keys", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
    assert gateway.admin("GET", "/admin/v1/routes").json()["revision"]


async def _count_running(url: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics", timeout=10)).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_bad_max_completion_tokens_is_named(gateway, key):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert r.status_code == 400 and _error(r)["param"] == "max_completion_tokens", r.text


def test_a_kserve_model_over_the_openai_api_is_a_clear_400(gateway):
    gateway.tenant("scoring", models=["scorer"])
    key = gateway.key("scoring")
    for path, body in [
        ("/v1/chat/completions", {"model": "scorer", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/embeddings", {"model": "scorer", "input": "x"}),
    ]:
        r = httpx.post(gateway.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 400, r.text  # was the replica's bare 404 {"error": "Not Found"}
        error = _error(r)
        assert error["code"] == "model_not_supported" and error["param"] == "model"
        assert "KServe v2 model" in error["message"]


def test_a_client_gone_mid_upload_is_a_499_not_a_traceback(gateway, key):
    host, port = gateway.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + b'{"model": "tiny", "messages": [')
    deadline = time.monotonic() + 10
    while 499 not in _access_statuses(gateway):
        assert time.monotonic() < deadline, gateway.tail()
        time.sleep(0.05)
    assert "Exception in ASGI application" not in gateway.tail(400)
    assert "ClientDisconnect" not in gateway.tail(400)


def _access_statuses(gateway) -> list[int]:
    marker = "paved.gateway.access: "
    lines = gateway.tail(400).splitlines()
    return [json.loads(line.split(marker, 1)[1])["status"] for line in lines if marker in line]


def test_disconnect_storm_aborts_upstream_requests(tmp_path):
    slow = ServerProcess("--engine", SLOW, ready_timeout_s=120)
    gw = None
    try:
        routes = write_routes(tmp_path / "r.json", [{"alias": "tiny", "backends": [_backend(slow)]}])
        gw = GatewayProcess(routes, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path)
        gw.tenant("t")
        key = gw.key("t")

        async def one(stream: bool) -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                body = {
                    "model": "tiny",
                    "prompt": "x",
                    "max_tokens": 400,
                    "stream": stream,
                    "ignore_eos": True,
                }
                if stream:
                    async with c.stream(
                        "POST",
                        gw.url + "/v1/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    ) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_bytes():
                            if stop.is_set():
                                break  # mid-stream: leave
                else:
                    post = asyncio.ensure_future(
                        c.post(
                            gw.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                        )
                    )
                    await stop.wait()
                    post.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await post

        stop = asyncio.Event()

        async def storm() -> tuple[float, float]:
            tasks = [asyncio.ensure_future(one(i % 2 == 0)) for i in range(40)]
            peak = 0.0
            for _ in range(100):
                peak = await _count_running(slow.url)
                if peak >= 40:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*tasks)
            for _ in range(100):
                if await _count_running(slow.url) == 0:
                    break
                await asyncio.sleep(0.1)
            return peak, await _count_running(slow.url)

        peak, after = asyncio.run(storm())
        assert peak == 40  # every request reached the engine and was decoding
        assert after == 0  # and every one was aborted when its client left
    finally:
        if gw is not None:
            gw.stop()
        slow.terminate()


def test_upstream_killed_mid_stream_is_an_error_event_not_done(tmp_path):
    slow = ServerProcess("--engine", SLOW, ready_timeout_s=120)
    gw = None
    try:
        routes = write_routes(tmp_path / "r.json", [{"alias": "tiny", "backends": [_backend(slow)]}])
        gw = GatewayProcess(routes, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path)
        gw.tenant("t")
        key = gw.key("t")
        events = []
        with httpx.stream(
            "POST",
            gw.url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True},
            timeout=30,
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    slow.proc.send_signal(signal.SIGKILL)
        assert len(events) > 3
        assert events[-1] != "data: [DONE]"
        assert "error" in json.loads(events[-1].removeprefix("data: "))
        assert "data: [DONE]" not in events
    finally:
        if gw is not None:
            gw.stop()
        slow.terminate()


def test_failover_and_no_healthy_backend(tmp_path, frontends):
    doomed = ServerProcess("--engine", SIM, ready_timeout_s=120)
    gw = None
    try:
        routes = write_routes(
            tmp_path / "r.json",
            [
                {
                    "alias": "tiny",
                    "strategy": "weighted",
                    "backends": [_backend(doomed), _backend(frontends[0])],
                }
            ],
        )
        gw = GatewayProcess(
            routes, "--health-interval", "60", admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path
        )
        gw.tenant("t")
        key = gw.key("t")
        doomed.terminate()
        client = _client(gw, key)
        for _ in range(10):
            assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices
        write_routes(tmp_path / "r.json", [{"alias": "tiny", "backends": [_backend(doomed)]}])
        deadline = time.monotonic() + 10
        revision = None
        while time.monotonic() < deadline:
            view = gw.admin("GET", "/admin/v1/routes").json()
            if all(b.get("id", k) != frontends[0].url for k, b in _backends(view).items()):
                revision = view["revision"]
                break
            time.sleep(0.1)
        assert revision is not None
        r = httpx.post(
            gw.url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code in (502, 503), r.text
        r = httpx.post(
            gw.url + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code in (502, 503) and _error(r)
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
    finally:
        if gw is not None:
            gw.stop()
        doomed.terminate()


def _backends(view: dict) -> dict:
    backends = view["backends"]
    if isinstance(backends, list):
        return {b["id"]: b for b in backends}
    return backends


def test_routes_rewritten_during_load_fail_nothing(gateway, key, frontends):
    routes: Path = gateway.routes_path
    tables = [
        [{"alias": "tiny", "strategy": "weighted", "backends": [_backend(frontends[0])]}],
        [{"alias": "tiny", "strategy": "prefix_affinity", "backends": [_backend(s) for s in frontends]}],
        [{"alias": "tiny", "strategy": "least_outstanding", "backends": [_backend(frontends[1])]}],
    ]
    keep = [{"alias": "secret-model", "backends": [_backend(frontends[0], upstream_model="tiny")]}]

    async def load() -> list[int]:
        statuses: list[int] = []
        async with httpx.AsyncClient(timeout=30) as c:

            async def worker() -> None:
                for _ in range(15):
                    r = await c.post(
                        gateway.url + "/v1/chat/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={
                            "model": "tiny",
                            "messages": [{"role": "user", "content": "q"}],
                            "max_tokens": 4,
                        },
                    )
                    statuses.append(r.status_code)

            async def rewrite() -> None:
                for i in range(6):
                    write_routes(routes, tables[i % 3] + keep)
                    await asyncio.sleep(0.4)

            await asyncio.gather(rewrite(), *(worker() for _ in range(8)))
        return statuses

    statuses = asyncio.run(load())
    write_routes(routes, [{"alias": "tiny", "backends": [_backend(s) for s in frontends]}, *keep])
    assert len(statuses) == 120
    assert set(statuses) == {200}, statuses


class _ClosesKeptAliveConnections:
    """A loopback backend that answers the first request on each connection, keeps it alive, and
    closes it without a word when a second request arrives on it: the race a pooled connection
    meets when the backend's idle timeout fires just as the gateway reuses it."""

    BODY = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "tiny",
            "choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.completions = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn) -> None:
        conn.settimeout(30)
        with conn, contextlib.suppress(OSError):
            buf = b""
            served = 0
            for _ in range(100):
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                is_completion = head.startswith(b"POST /v1/completions")
                if is_completion and served:
                    return  # a kept-alive connection closed as the request arrives
                body = self.BODY if is_completion else b"{}"
                self.completions += is_completion
                served += is_completion
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_a_kept_alive_connection_closed_under_a_request_is_retried(tmp_path):
    backend = _ClosesKeptAliveConnections()
    gw = None
    try:
        routes = write_routes(tmp_path / "r.json", [{"alias": "tiny", "backends": [_backend(backend)]}])
        gw = GatewayProcess(
            routes, "--health-interval", "60", admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path
        )
        gw.tenant("t")
        key = gw.key("t")
        for i in range(4):
            r = httpx.post(
                gw.url + "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                timeout=30,
            )
            # The only backend is tried again on a fresh connection, not excluded for the call.
            assert r.status_code == 200, (i, r.text)
        assert backend.completions == 4
    finally:
        if gw is not None:
            gw.stop()
        backend.close()


# Flow control (paved.gateway.flow.flow) end to end: two frontends that hold 4 requests each (2
# decoding, 2 waiting in the engine; more is a 503 "overloaded"), requests of ~1 s each.
TIGHT = "sim://tiny?tokens_per_s=10&max_num_seqs=2&max_waiting=2"
TIGHT_CAPACITY = 8
BURST = 24


@pytest.fixture(scope="module")
def tight_frontends():
    servers = [ServerProcess("--engine", TIGHT, ready_timeout_s=120) for _ in range(2)]
    yield servers
    for s in servers:
        s.terminate()


@contextlib.contextmanager
def _tight_gateway(tmp_path: Path, frontends, *args: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    routes = write_routes(
        tmp_path / "tight.json",
        [{"alias": "tiny", "strategy": "least_outstanding", "backends": [_backend(s) for s in frontends]}],
    )
    gw = GatewayProcess(routes, *args, admin_key="adm-" + secrets.token_hex(16), state_dir=tmp_path)
    try:
        gw.tenant("t")
        gw.key_t = gw.key("t")  # type: ignore[attr-defined]
        yield gw
    finally:
        gw.stop()


_SLOW_BODY = {"model": "tiny", "prompt": "x", "max_tokens": 10, "ignore_eos": True}


async def _burst(gw, n: int, body: dict | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        return await asyncio.gather(
            *(
                c.post(
                    gw.url + "/v1/completions",
                    json=body or _SLOW_BODY,
                    headers={"Authorization": f"Bearer {gw.key_t}"},
                )
                for _ in range(n)
            )
        )


def _metric(gw, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_burst_beyond_the_backends_but_within_the_queue_is_fully_served(tmp_path, tight_frontends):
    # Without the queue the same burst is partly refused: it does exceed the backends.
    with _tight_gateway(tmp_path / "off", tight_frontends, "--queue-size", "0") as gw:
        statuses = [r.status_code for r in asyncio.run(_burst(gw, BURST))]
    assert statuses.count(503) >= 1 and set(statuses) <= {200, 503}, statuses
    with _tight_gateway(tmp_path / "on", tight_frontends, "--queue-size", "64") as gw:
        responses = asyncio.run(_burst(gw, BURST))
        assert [r.status_code for r in responses] == [200] * BURST, [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 10 for r in responses)
        # They did wait: the gateway's queue held them, and it is empty again.
        assert _metric(gw, "paved_gateway_queue_wait_seconds_count", model="tiny", tenant="t") > BURST
        assert _metric(gw, "paved_gateway_queue_depth", model="tiny", tenant="t") == 0


def test_a_burst_beyond_the_queue_is_refused_for_the_excess_only(tmp_path, tight_frontends):
    queue = 4
    with _tight_gateway(tmp_path, tight_frontends, "--queue-size", str(queue)) as gw:
        responses = asyncio.run(_burst(gw, BURST))
        refused = [r for r in responses if r.status_code != 200]
        served = BURST - len(refused)
        # The backends' capacity and the queue are served; only what is beyond both is refused.
        assert 1 <= len(refused) <= BURST - TIGHT_CAPACITY - queue, [r.status_code for r in responses]
        assert served >= TIGHT_CAPACITY + queue
        for r in refused:
            assert r.status_code == 503, r.text
            assert _error(r)["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        assert _metric(gw, "paved_gateway_queue_refused_total", reason="full") == len(refused)


def test_a_client_that_leaves_the_queue_leaves_no_trace(tmp_path, tight_frontends):
    long = {**_SLOW_BODY, "max_tokens": 400}
    with _tight_gateway(tmp_path, tight_frontends, "--queue-size", "16") as gw:

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as c:

                def post() -> asyncio.Task:
                    return asyncio.ensure_future(
                        c.post(
                            gw.url + "/v1/completions",
                            json=long,
                            headers={"Authorization": f"Bearer {gw.key_t}"},
                        )
                    )

                # Fill both backends, then one more: it is pushed back and queued.
                holders = [post() for _ in range(TIGHT_CAPACITY)]
                for _ in range(300):
                    if sum([await _count_running(s.url) for s in tight_frontends]) >= 4:
                        break
                    await asyncio.sleep(0.05)
                queued = post()
                for _ in range(300):
                    if _metric(gw, "paved_gateway_queue_depth", model="tiny") == 1:
                        break
                    await asyncio.sleep(0.05)
                assert _metric(gw, "paved_gateway_queue_depth", model="tiny") == 1
                queued.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
                for _ in range(300):
                    if _metric(gw, "paved_gateway_queue_depth", model="tiny") == 0:
                        break
                    await asyncio.sleep(0.05)
                assert _metric(gw, "paved_gateway_queue_depth", model="tiny") == 0
                for h in holders:
                    h.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

        asyncio.run(scenario())
        # The one that left is a 499 in the access log, and its place in flight was given back:
        # the backends take a full burst again afterwards.
        for _ in range(100):
            if 499 in _access_statuses(gw):
                break
            time.sleep(0.05)
        assert 499 in _access_statuses(gw)
        short = {**_SLOW_BODY, "max_tokens": 2}
        again = asyncio.run(_burst(gw, TIGHT_CAPACITY, short))
        assert [r.status_code for r in again] == [200] * TIGHT_CAPACITY


def test_an_unknown_priority_is_a_400(gateway, key):
    r = httpx.post(
        gateway.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}", "x-paved-priority": "urgent"},
        json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        timeout=10,
    )
    assert r.status_code == 400 and "x-paved-priority" in _error(r)["message"], r.text
    r = httpx.post(
        gateway.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}", "x-paved-priority": "background"},
        json={"model": "tiny", "prompt": "x", "max_tokens": 1},
        timeout=10,
    )
    assert r.status_code == 200, r.text


# The backends' load gauges (the health rounds read each frontend's /metrics): two frontends
# that admit 2 sequences each (paved_max_queued_sequences; a third is a 503 "overloaded").
BOUNDED = "sim://tiny?tokens_per_s=10&max_num_seqs=4"
_LONG_BODY = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def bounded_frontends():
    servers = [
        ServerProcess("--engine", BOUNDED, "--max-queued-sequences", "2", ready_timeout_s=120)
        for _ in range(2)
    ]
    yield servers
    for s in servers:
        s.terminate()


def _gauges_when(gw, accept, what: str) -> dict:
    """The router's backends (GET /admin/v1/routes) once `accept(backends)` holds (bounded poll)."""
    backends: dict = {}
    for _ in range(400):
        backends = _backends(gw.admin("GET", "/admin/v1/routes").json())
        if accept(backends):
            return backends
        time.sleep(0.05)
    raise AssertionError(f"the gateway's router never saw {what}: {backends}")


def _rejected(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("paved_requests_rejected_total{") and 'reason="queue_full"' in line
    )


async def _hold(client: httpx.AsyncClient, server: ServerProcess, n: int) -> list[asyncio.Task]:
    """`n` long streams straight to `server` (not through the gateway), held until cancelled."""

    async def one() -> None:
        async with client.stream("POST", server.url + "/v1/completions", json=_LONG_BODY) as r:
            async for _ in r.aiter_bytes():
                pass

    return [asyncio.create_task(one()) for _ in range(n)]


def test_the_gateways_router_reads_the_frontends_gauges(tmp_path, bounded_frontends):
    with _tight_gateway(tmp_path, bounded_frontends, "--health-interval", "0.2") as gw:
        idle = _gauges_when(gw, lambda bs: all(b["gauges"] for b in bs.values()), "gauges")
        for s in bounded_frontends:
            g = idle[s.url]["gauges"]
            assert (g["waiting"], g["kv_usage"], g["queued"], g["max_queued"], g["full"]) == (
                0,
                0,
                0,
                2,
                False,
            )

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                holders = await _hold(c, bounded_frontends[0], 2)
                try:
                    busy = await asyncio.to_thread(
                        _gauges_when,
                        gw,
                        lambda bs: (bs[bounded_frontends[0].url]["gauges"] or {}).get("queued") == 2,
                        "the first frontend full",
                    )
                    assert busy[bounded_frontends[0].url]["gauges"]["full"] is True
                    assert busy[bounded_frontends[0].url]["gauges"]["kv_usage"] > 0
                    assert busy[bounded_frontends[1].url]["gauges"]["full"] is False
                finally:
                    for h in holders:
                        h.cancel()
                    await asyncio.gather(*holders, return_exceptions=True)

        asyncio.run(scenario())
    # Turned off, the rounds still check readiness but read no gauges.
    with _tight_gateway(
        tmp_path / "off", bounded_frontends, "--health-interval", "0.2", "--no-backend-metrics"
    ) as gw:
        checked = _gauges_when(gw, lambda bs: all(b["checked"] for b in bs.values()), "a health round")
        assert all(b["gauges"] is None and b["ready"] for b in checked.values()), checked


def test_every_backend_reading_full_holds_the_request_in_the_queue_not_a_503(tmp_path, bounded_frontends):
    with _tight_gateway(tmp_path, bounded_frontends, "--health-interval", "0.2", "--queue-size", "8") as gw:

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                holders = [t for s in bounded_frontends for t in await _hold(c, s, 2)]
                try:
                    await asyncio.to_thread(
                        _gauges_when,
                        gw,
                        lambda bs: all((b["gauges"] or {}).get("full") for b in bs.values()),
                        "both frontends full",
                    )
                    refused_before = [_rejected(s) for s in bounded_frontends]
                    waiter = asyncio.ensure_future(
                        c.post(
                            gw.url + "/v1/completions",
                            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {gw.key_t}"},
                        )
                    )
                    for _ in range(400):
                        if _metric(gw, "paved_gateway_queue_depth", model="tiny") == 1:
                            break
                        await asyncio.sleep(0.05)
                    # Held in the gateway's queue, never sent to a frontend that would refuse it.
                    assert _metric(gw, "paved_gateway_queue_depth", model="tiny") == 1
                    assert not waiter.done()
                    assert [_rejected(s) for s in bounded_frontends] == refused_before
                finally:
                    for h in holders:
                        h.cancel()
                    await asyncio.gather(*holders, return_exceptions=True)
                # The frontends drain, the next health round reads room: the request is served.
                r = await waiter
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 2
                assert [_rejected(s) for s in bounded_frontends] == refused_before
                assert _metric(gw, "paved_gateway_queue_depth", model="tiny") == 0

        asyncio.run(scenario())
