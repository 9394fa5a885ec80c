"""The Responses API and resumable streams through two real gateway mains (sharing one SQLite
state file and one Redis), in front of a paved frontend on the simulated engine: the official
`openai` client's create / retrieve / cancel / streaming / background polling, a stream cut
mid-way and resumed from the OTHER replica (exactly the original events, no gap, no
duplicate), background responses surviving a SIGKILL of the replica that created them,
Last-Event-ID resume of a chat stream, cross-tenant reads refused, and the stores' bounds."""

from __future__ import annotations

import json
import secrets
import signal
import time

import httpx
import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.testing.redis import redis_server

MODEL = "tiny"
TERMINAL = {"completed", "incomplete", "failed", "cancelled"}


def _gateway(routes, state, redis, admin, tmp, *extra: str) -> GatewayProcess:
    return GatewayProcess(
        routes, "--state", state, "--redis", redis, "--resumable-streams", "--stream-grace", "20",
        "--responses-lease", "2", "--streams-per-tenant", "50", *extra, admin_key=admin, state_dir=tmp,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    # Slow enough that a stream can be cut in its middle.
    frontend = ServerProcess("--engine", "sim://tiny?tokens_per_s=200&max_num_seqs=256", ready_timeout_s=120)
    gateways: list[GatewayProcess] = []
    try:
        with redis_server() as redis:
            state = f"sqlite:///{tmp / 'gw.sqlite'}"
            routes = write_routes(
                tmp / "routes.json", [{"alias": MODEL, "backends": [{"url": frontend.url, "version": "v1"}]}]
            )
            admin = "adm-" + secrets.token_hex(16)
            gateways.append(_gateway(routes, state, redis, admin, tmp))
            gateways.append(_gateway(routes, state, redis, admin, tmp))
            gateways[0].tenant("acme", models=[MODEL])
            gateways[0].tenant("other", models=[MODEL])
            keys = {"acme": gateways[0].key("acme"), "other": gateways[0].key("other")}
            yield {
                "gateways": gateways,
                "keys": keys,
                "spawn": lambda: _gateway(routes, state, redis, admin, tmp),
            }
    finally:
        for gw in gateways:
            gw.stop()
        frontend.terminate()


def _client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _sse(response: httpx.Response) -> list[tuple[str | None, bytes]]:
    """(id, raw event) of every SSE event of a streamed answer."""
    events = []
    for raw in response.content.split(b"\n\n"):
        if not raw.strip():
            continue
        ident = None
        for line in raw.split(b"\n"):
            if line.startswith(b"id: "):
                ident = line[4:].decode()
        events.append((ident, raw))
    return events


def _wait_status(client: openai.OpenAI, rid: str, statuses: set[str], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        got = client.responses.retrieve(rid)
        # A terminal status ends the wait too (the assertion after it says which was wanted).
        if got.status in statuses | TERMINAL or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_create_retrieve_and_input_items_with_the_openai_client(fleet):
    a, b = fleet["gateways"]
    client = _client(a, fleet["keys"]["acme"])
    first = client.responses.create(
        model=MODEL, input="Say hello", instructions="Be brief.", max_output_tokens=8, metadata={"k": "v"}
    )
    assert first.status in ("completed", "incomplete")
    assert first.output_text
    assert first.metadata == {"k": "v"}
    assert first.usage is not None and first.usage.output_tokens > 0
    # Any replica answers for it.
    again = _client(b, fleet["keys"]["acme"]).responses.retrieve(first.id)
    assert again.output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    # Chained: the previous turn's messages come first.
    second = client.responses.create(
        model=MODEL, input="And again", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    deleted = httpx.delete(
        f"{b.url}/v1/responses/{first.id}", headers={"authorization": f"Bearer {fleet['keys']['acme']}"}
    )
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_unsupported_fields_are_a_400_naming_them(fleet):
    a, _ = fleet["gateways"]
    client = _client(a, fleet["keys"]["acme"])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "low"})
    assert e.value.body["param"] == "reasoning"


def test_streaming_events_parse_and_resume_on_the_other_replica_exactly(fleet):
    a, b = fleet["gateways"]
    key = fleet["keys"]["acme"]
    client = _client(a, key)
    seen = []
    with client.responses.create(model=MODEL, input="Count", max_output_tokens=60, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if len(seen) == 12:
                break  # the client goes away mid-stream
    rid = seen[0].response.id
    assert [e.type for e in seen[:3]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ]
    assert [e.sequence_number for e in seen] == list(range(12))
    # Resumed on the other replica from the last event seen: the rest follows live.
    rest = list(_client(b, key).responses.retrieve(rid, stream=True, starting_after=11))
    numbers = [e.sequence_number for e in seen] + [e.sequence_number for e in rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    # The whole replay equals what was streamed, byte for byte, from either replica.
    auth = {"authorization": f"Bearer {key}"}
    whole_a = httpx.get(f"{a.url}/v1/responses/{rid}?stream=true", headers=auth, timeout=60).content
    whole_b = httpx.get(
        f"{b.url}/v1/responses/{rid}?stream=true&starting_after=-1", headers=auth, timeout=60
    ).content
    assert whole_a == whole_b
    assert whole_a.count(b"\n\n") == len(numbers)
    # Past the end: the terminal event again.
    past = httpx.get(
        f"{b.url}/v1/responses/{rid}?stream=true&starting_after=100000", headers=auth, timeout=60
    )
    assert [json.loads(e.split(b"data: ")[1])["type"] for _, e in _sse(past)] == [rest[-1].type]
    text = "".join(e.delta for e in [*seen, *rest] if e.type == "response.output_text.delta")
    assert client.responses.retrieve(rid).output_text == text


def test_background_polling_cancel_and_cross_tenant(fleet):
    a, b = fleet["gateways"]
    client = _client(a, fleet["keys"]["acme"])
    queued = client.responses.create(model=MODEL, input="Go", max_output_tokens=20, background=True)
    assert queued.status in ("queued", "in_progress")
    done = _wait_status(_client(b, fleet["keys"]["acme"]), queued.id, {"completed", "incomplete"})
    assert done.status in ("completed", "incomplete") and done.output_text
    # Another tenant's id answers as an unknown one.
    stranger = _client(b, fleet["keys"]["other"])
    for call in (
        lambda: stranger.responses.retrieve(queued.id),
        lambda: stranger.responses.cancel(queued.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # Cancelled from the other replica while it generates.
    long = client.responses.create(model=MODEL, input="Long", max_output_tokens=1500, background=True)
    assert _wait_status(client, long.id, {"in_progress"}).status == "in_progress"
    cancelled = _client(b, fleet["keys"]["acme"]).responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert _wait_status(client, long.id, {"cancelled"}).status == "cancelled"


def test_background_response_outlives_a_sigkill_of_its_replica(fleet):
    _, b = fleet["gateways"]
    victim = fleet["spawn"]()
    try:
        client = _client(victim, fleet["keys"]["acme"])
        finished = client.responses.create(model=MODEL, input="Short", max_output_tokens=4, background=True)
        _wait_status(client, finished.id, {"completed", "incomplete"})
        running = client.responses.create(model=MODEL, input="Long", max_output_tokens=1500, background=True)
        assert _wait_status(client, running.id, {"in_progress"}).status == "in_progress"
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
    finally:
        victim.stop()
    other = _client(b, fleet["keys"]["acme"])
    assert other.responses.retrieve(finished.id).status in ("completed", "incomplete")
    # Its lease (2 s here) lapses: it ends failed, saying why.
    failed = _wait_status(other, running.id, {"failed"})
    assert failed.status == "failed" and "stopped" in failed.error.message


def test_chat_stream_resumes_with_last_event_id_on_the_other_replica(fleet):
    a, b = fleet["gateways"]
    auth = {"authorization": f"Bearer {fleet['keys']['acme']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "stream": True}
    got: list[bytes] = []
    with httpx.stream("POST", f"{a.url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200
        stream_id = r.headers["x-paved-stream-id"]
        buffer = b""
        for chunk in r.iter_bytes():
            buffer += chunk
            *whole, buffer = buffer.split(b"\n\n")
            got.extend(e for e in whole if e)
            if len(got) >= 10:
                break
    last = got[-1].split(b"\n")[0].removeprefix(b"id: ").decode()
    assert [e.split(b"\n")[0] for e in got] == [b"id: %d" % i for i in range(len(got))]
    rest = httpx.get(
        f"{b.url}/v1/chat/completions/streams/{stream_id}",
        headers={**auth, "last-event-id": last},
        timeout=60,
    )
    assert rest.status_code == 200
    events = [e for _, e in _sse(rest)]
    ids = [int(e.split(b"\n")[0].removeprefix(b"id: ")) for e in events]
    assert ids == list(range(len(got), len(got) + len(ids)))
    assert events[-1].endswith(b"data: [DONE]")
    full = httpx.get(f"{a.url}/v1/chat/completions/streams/{stream_id}", headers=auth, timeout=60)
    assert [e for _, e in _sse(full)] == got + events
    # Another tenant cannot read it.
    other = {"authorization": f"Bearer {fleet['keys']['other']}"}
    refused = httpx.get(f"{b.url}/v1/chat/completions/streams/{stream_id}", headers=other, timeout=60)
    assert refused.status_code == 404


def test_stream_bounds_per_tenant(fleet):
    """--streams-per-tenant 50: the 51st stream of a tenant drops its oldest."""
    a, _ = fleet["gateways"]
    auth = {"authorization": f"Bearer {fleet['keys']['other']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stream": True}
    ids = []
    for _ in range(51):
        r = httpx.post(f"{a.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200
        ids.append(r.headers["x-paved-stream-id"])
    first = httpx.get(f"{a.url}/v1/chat/completions/streams/{ids[0]}", headers=auth, timeout=60)
    assert first.status_code == 404 and "expired" in first.json()["error"]["message"]
    assert (
        httpx.get(f"{a.url}/v1/chat/completions/streams/{ids[-1]}", headers=auth, timeout=60).status_code
        == 200
    )
