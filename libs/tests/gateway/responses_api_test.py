"""The Responses API and resumable streams through two real gateway mains (sharing one SQLite
state file and one Redis), in front of a paved frontend on the simulated engine: the official
`openai` client's create / retrieve / cancel / streaming / background polling, a stream cut
mid-way and resumed from the OTHER replica (exactly the original events, no gap, no
duplicate), a background response continued by another replica after a SIGKILL (or SIGTERM)
of the one generating it (a follower's sequence contiguous across the takeover; over Redis
and over the database log), a stream whose replica died resumed and finished on another,
Last-Event-ID resume of a chat stream (resumable by default; the SDK parses it), cross-tenant
reads refused, and the stores' bounds: requests the chat path refuses use up none of them, a
resume point past what a log holds is a 400, input item ids are unique strings. Without
processes: the response store's takeover claims and their bound, a cancelled response's final
output and usage, ResponseStream.resumed continuing a sequence exactly, and the continuation's
chat bodies."""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import signal
import sqlite3
import threading
import time

import httpx
import openai
import pytest
import redis
from gateway_proc import GatewayProcess, write_routes
from prometheus_client.parser import text_string_to_metric_families
from servers import ServerProcess

from paved.gateway.access.state import GatewayStore
from paved.gateway.responses.store import ResponseStore, StoreBounds
from paved.http import openai_responses as oai
from paved.testing.redis import redis_server

MODEL = "tiny"
TERMINAL = {"completed", "incomplete", "failed", "cancelled"}


def _gateway(routes, state, redis, admin, tmp, *extra: str) -> GatewayProcess:
    return GatewayProcess(
        routes, "--state", state, "--redis", redis, "--stream-grace", "20",
        "--responses-lease", "2", "--streams-per-tenant", "50", *extra, admin_key=admin, state_dir=tmp,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    # Slow enough that a stream can be cut in its middle.
    frontend = ServerProcess("--engine", "sim://tiny?tokens_per_s=100&max_num_seqs=256", ready_timeout_s=120)
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
                "spawn": lambda *extra: _gateway(routes, state, redis, admin, tmp, *extra),
                "redis": redis,
                "state": tmp / "gw.sqlite",
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
    headers = {"Authorization": f"Bearer {fleet['keys']['acme']}", "content-type": "application/json"}
    # A lone surrogate left create waiting forever (the chat body could not be encoded, and the
    # start it waited for never came); stored with background, every read was a 500.
    for extra in (b"", b', "background": true'):
        body = b'{"model": "%s", "input": "\\ud800"%s}' % (MODEL.encode(), extra)
        r = httpx.post(a.url + "/v1/responses", content=body, headers=headers, timeout=30)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    # Ids no database text can hold (NUL) name nothing: 404, not a 500 from PostgreSQL.
    for method, path in (("GET", "/v1/responses/resp_a%00b"), ("DELETE", "/v1/responses/resp_a%00b")):
        r = httpx.request(method, a.url + path, headers=headers, timeout=30)
        assert r.status_code == 404, r.text
    r = httpx.post(
        a.url + "/v1/responses",
        json={"model": MODEL, "input": "x", "previous_response_id": "resp_a\x00b"},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
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
    # "Essay" (144 tokens, 1.4 s on this engine), not a short answer the polling could miss.
    long = client.responses.create(model=MODEL, input="Essay", max_output_tokens=1500, background=True)
    assert _wait_status(client, long.id, {"in_progress"}).status == "in_progress"
    cancelled = _client(b, fleet["keys"]["acme"]).responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert _wait_status(client, long.id, {"cancelled"}).status == "cancelled"


@pytest.mark.parametrize(
    "stop", [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP], ids=["killed", "stopped", "paused"]
)
def test_background_response_is_continued_after_its_replica_dies(fleet, stop):
    """Killed: its lease lapses and another replica claims it. Stopped: it hands it off.
    Paused (a frozen VM, a long GC): its lease lapses, another replica claims it, and then it
    wakes up with the rest of its answer buffered: the log's fence refuses every event it still
    writes, so the stream and the stored response are the successor's alone after the claim."""
    a, b = fleet["gateways"]
    key = fleet["keys"]["acme"]
    victim = fleet["spawn"]()
    followed: list = []
    try:
        client = _client(victim, key)
        finished = client.responses.create(model=MODEL, input="Short", max_output_tokens=4, background=True)
        _wait_status(client, finished.id, {"completed", "incomplete"})
        charged_before = sum(_completion_tokens(gw) for gw in (a, b))
        # "Essay": the simulated engine's answer to it is long (144 tokens, 1.4 s here).
        running = client.responses.create(model=MODEL, input="Essay", max_output_tokens=1500, background=True)

        def follow() -> None:
            # From the log on another replica, across the takeover, to the terminal event.
            followed.extend(_client(b, key).responses.retrieve(running.id, stream=True))

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        deadline = time.monotonic() + 60
        while not any(e.type == "response.output_text.delta" for e in list(followed)):
            assert time.monotonic() < deadline, "no output before the kill"
            time.sleep(0.05)
        victim.proc.send_signal(stop)
        if stop == signal.SIGSTOP:
            while not _continued_by(fleet, running.id):
                assert time.monotonic() < deadline + 60, "nobody took the paused replica's response over"
                time.sleep(0.1)
            time.sleep(0.5)  # the successor writes on before the paused one wakes up
            victim.proc.send_signal(signal.SIGCONT)
            follower.join(timeout=120)  # the woken replica runs on meanwhile
            time.sleep(1.0)
        else:
            victim.proc.wait(timeout=20)
        deltas_at_kill = sum(e.type == "response.output_text.delta" for e in list(followed))
        handed_off = "handed off for another replica" in victim.tail(200)
        taken_over = "taken over by another" in victim.tail(400)
    finally:
        if stop == signal.SIGSTOP:
            victim.proc.send_signal(signal.SIGCONT)
        victim.stop()
    other = _client(b, key)
    assert other.responses.retrieve(finished.id).status in ("completed", "incomplete")
    follower.join(timeout=120)
    assert not follower.is_alive()
    # One sequence, no gap, no duplicate, ending in the terminal event; more text after the kill.
    assert [e.sequence_number for e in followed] == list(range(len(followed)))
    assert followed[-1].type in ("response.completed", "response.incomplete")
    assert [e.type for e in followed].count("response.in_progress") == 1
    deltas = [e.delta for e in followed if e.type == "response.output_text.delta"]
    if stop == signal.SIGKILL:
        assert len(deltas) > deltas_at_kill  # (a stopping replica writes on until it hands off)
    elif stop == signal.SIGTERM:
        assert handed_off
    else:
        assert taken_over
    assert len(_continued_by(fleet, running.id)) == 1
    done = _wait_status(other, running.id, {"completed", "incomplete"})
    assert done.status in ("completed", "incomplete") and done.error is None
    assert done.output_text == "".join(deltas)
    assert len(done.output) == 1  # the continuation went on in the same message
    assert 0 < done.usage.output_tokens <= 1500
    # A reader starting afresh on the first replica replays the same sequence.
    auth = {"authorization": f"Bearer {key}"}
    replay = httpx.get(f"{a.url}/v1/responses/{running.id}?stream=true", headers=auth, timeout=60)
    replayed = [json.loads(e.split(b"data: ")[1]) for _, e in _sse(replay)]
    assert [e["sequence_number"] for e in replayed] == list(range(len(followed)))
    assert replayed[-1]["response"]["output"][0]["content"][0]["text"] == done.output_text
    # The surviving replicas charged the tenant for the continuation's tokens only: what the
    # dead one generated is output once, not charged again.
    charged = sum(_completion_tokens(gw) for gw in (a, b)) - charged_before
    assert 0 < charged < done.usage.output_tokens


def _completion_tokens(gw: GatewayProcess) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "paved_gateway_tokens_total"
        and sample.labels == {"tenant": "acme", "model": MODEL, "kind": "completion"}
    )


def test_a_stream_whose_replica_dies_is_continued_and_resumed_on_another(fleet):
    """Not background: the client was reading from the replica that died; it resumes on another
    one, which continued the generation (a reader came back within the grace)."""
    _, b = fleet["gateways"]
    key = fleet["keys"]["acme"]
    auth = {"authorization": f"Bearer {key}"}
    victim = fleet["spawn"]()
    seen = []
    try:
        create = _client(victim, key).responses.create
        with create(model=MODEL, input="Essay", max_output_tokens=1500, stream=True) as stream:
            for event in stream:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        rid, last = seen[0].response.id, seen[-1].sequence_number
        # The log has what the client saw (the first event after it, read on the other replica).
        url = f"{b.url}/v1/responses/{rid}?stream=true&starting_after={last - 1}"
        with httpx.stream("GET", url, headers=auth, timeout=60) as r:
            first = next(r.iter_lines())
        assert first.startswith("event: response.output_text.delta")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
    finally:
        victim.stop()
    rest = list(_client(b, key).responses.retrieve(rid, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in [*seen, *rest] if e.type == "response.output_text.delta")
    done = _client(b, key).responses.retrieve(rid)
    assert done.status == rest[-1].response.status and done.output_text == text
    assert len(text) > sum(e.type == "response.output_text.delta" for e in seen)
    assert _continued_by(fleet, rid)


def _continued_by(fleet, rid: str) -> list:
    """The fleet's replicas that logged continuing `rid`."""
    return [gw for gw in fleet["gateways"] if f"continuing response {rid}" in gw.tail(2000)]


def test_takeover_over_the_database_event_log(tmp_path):
    """No Redis: the events in the gateways' SQLite; a background response continued after
    a SIGKILL, its follower's sequence contiguous."""
    frontend = ServerProcess("--engine", "sim://tiny?tokens_per_s=100", ready_timeout_s=120)
    gateways: list[GatewayProcess] = []
    try:
        routes = write_routes(
            tmp_path / "routes.json", [{"alias": MODEL, "backends": [{"url": frontend.url, "version": "v1"}]}]
        )
        admin = "adm-" + secrets.token_hex(16)
        state = f"sqlite:///{tmp_path / 'gw.sqlite'}"
        flags = ("--state", state, "--responses-lease", "2")
        for _ in range(2):
            gateways.append(GatewayProcess(routes, *flags, admin_key=admin, state_dir=tmp_path))
        survivor, victim = gateways
        survivor.tenant("acme", models=[MODEL])
        key = survivor.key("acme")
        running = _client(victim, key).responses.create(
            model=MODEL, input="Essay", max_output_tokens=1500, background=True
        )
        followed: list = []
        reader = _client(survivor, key)
        follower = threading.Thread(
            target=lambda: followed.extend(reader.responses.retrieve(running.id, stream=True)), daemon=True
        )
        follower.start()
        deadline = time.monotonic() + 60
        while not any(e.type == "response.output_text.delta" for e in list(followed)):
            assert time.monotonic() < deadline, "no output before the kill"
            time.sleep(0.05)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        follower.join(timeout=120)
        assert not follower.is_alive()
        assert [e.sequence_number for e in followed] == list(range(len(followed)))
        assert followed[-1].type in ("response.completed", "response.incomplete")
        done = _client(survivor, key).responses.retrieve(running.id)
        deltas = "".join(e.delta for e in followed if e.type == "response.output_text.delta")
        assert done.status == followed[-1].response.status and done.output_text == deltas
        assert f"continuing response {running.id}" in survivor.tail(2000)
    finally:
        for gw in gateways:
            gw.stop()
        frontend.terminate()


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


def test_chat_streams_are_resumable_by_default_and_the_sdk_parses_them(fleet):
    a, _ = fleet["gateways"]
    client = _client(a, fleet["keys"]["acme"])
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
    )
    assert raw.headers["x-paved-stream-id"].startswith("chatstream_")
    chunks = list(raw.parse())
    assert chunks and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_no_resumable_streams_forwards_chat_streams_as_before(fleet):
    plain = fleet["spawn"]("--no-resumable-streams")
    try:
        auth = {"authorization": f"Bearer {fleet['keys']['acme']}"}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "stream": True,
        }
        r = httpx.post(f"{plain.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and "x-paved-stream-id" not in r.headers
        events = _sse(r)
        assert events[-1][1].endswith(b"data: [DONE]")
        assert all(ident is None for ident, _ in events)
    finally:
        plain.stop()


def test_refused_requests_store_no_response_and_open_no_stream(fleet):
    """Requests the chat path refuses (429 past the tenant's requests/min, 404 an unknown
    model) leave no stored response and no stream: each used to count toward
    --streams-per-tenant (50) and --responses-per-tenant, so a burst of retries evicted the
    tenant's real streams (here: the first response's events)."""
    a, b = fleet["gateways"]
    a.tenant("capped", models=[MODEL], limits={"requests_per_min": 2})
    auth = {"authorization": f"Bearer {a.key('capped')}"}
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 20, "stream": True}
    first = httpx.post(f"{a.url}/v1/responses", json=body, headers=auth, timeout=60)
    assert first.status_code == 200
    rid = first.headers["x-paved-stream-id"]
    codes: collections.Counter[int] = collections.Counter()
    for _ in range(55):
        codes[httpx.post(f"{a.url}/v1/responses", json=body, headers=auth, timeout=60).status_code] += 1
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}
    for _ in range(55):
        codes[
            httpx.post(f"{a.url}/v1/chat/completions", json=chat, headers=auth, timeout=60).status_code
        ] += 1
    accepted = codes.pop(200, 0)  # (the limiter may let one more through)
    assert set(codes) <= {404, 429} and sum(codes.values()) >= 100, codes
    # Only what was accepted is stored and counted in the tenant's stream index.
    with sqlite3.connect(fleet["state"]) as db:
        (stored,) = db.execute("SELECT count(*) FROM gateway_responses WHERE tenant = 'capped'").fetchone()
    assert stored == 1 + accepted
    index = redis.Redis.from_url(fleet["redis"])
    try:
        assert index.zcard("pvd:et:capped") == 1 + accepted
    finally:
        index.close()
    replay = httpx.get(f"{b.url}/v1/responses/{rid}?stream=true", headers=auth, timeout=60)
    assert replay.status_code == 200 and replay.content == first.content


def test_a_resume_point_past_what_a_log_holds_is_a_400_naming_it(fleet):
    """On a replica that does not own the stream, a huge resume point was a 500 (Redis refused
    the entry id); it is refused before any read, for a running stream and a finished one."""
    a, b = fleet["gateways"]
    key = fleet["keys"]["acme"]
    auth = {"authorization": f"Bearer {key}"}
    running = _client(a, key).responses.create(
        model=MODEL, input="Essay", max_output_tokens=1500, background=True
    )
    for huge in (str(10**22), str(2**31)):
        r = httpx.get(
            f"{b.url}/v1/responses/{running.id}?stream=true&starting_after={huge}", headers=auth, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    done = httpx.post(f"{a.url}/v1/chat/completions", json=chat, headers=auth, timeout=60)
    url = f"{b.url}/v1/chat/completions/streams/{done.headers['x-paved-stream-id']}"
    r = httpx.get(url, headers={**auth, "last-event-id": str(10**22)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID", r.text
    # The largest a log holds is a resume point like any past the end: the final event again.
    r = httpx.get(url, headers={**auth, "last-event-id": str(2**31 - 1)}, timeout=60)
    assert r.status_code == 200 and [e for _, e in _sse(r)] == [e for _, e in _sse(done)][-1:]
    assert _wait_status(_client(b, key), running.id, {"completed", "incomplete"}).status in TERMINAL


def test_input_item_ids_must_be_unique_strings_and_pages_always_progress(fleet):
    a, _ = fleet["gateways"]
    client = _client(a, fleet["keys"]["acme"])

    def item(ident, text: str) -> dict:
        return {"id": ident, "type": "message", "role": "user", "content": text}

    for items, param in (
        ([item("m", "a"), item("m", "b")], "input[1].id"),
        ([item(7, "a")], "input[0].id"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=items, max_output_tokens=2)
        assert e.value.body["param"] == param
    created = client.responses.create(
        model=MODEL, input=[item("m1", "a"), item("m2", "b"), item("m3", "c")], max_output_tokens=2
    )
    auth = {"authorization": f"Bearer {fleet['keys']['acme']}"}
    seen, after = [], None
    for _ in range(5):
        query = "limit=1&order=asc" + (f"&after={after}" if after else "")
        page = httpx.get(
            f"{a.url}/v1/responses/{created.id}/input_items?{query}", headers=auth, timeout=60
        ).json()
        seen += [d["id"] for d in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ["m1", "m2", "m3"]
    # A limit out of range is named with its own range, however large it is.
    for limit in ("0", "101", str(10**12), "-1"):
        r = httpx.get(
            f"{a.url}/v1/responses/{created.id}/input_items?limit={limit}", headers=auth, timeout=60
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "limit", r.text
        assert "between 1 and 100" in error["message"], r.text


def test_a_response_cancelled_while_it_generates_keeps_its_final_output_and_usage(tmp_path):
    """The generation ends after the cancel: the stored object (still `cancelled`) gets the
    output and usage its terminal event has, not the snapshot the cancel took."""

    async def scenario() -> None:
        db = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
        responses = ResponseStore(db, StoreBounds(), "one")
        await responses.start()
        start = {"id": "resp_c", "status": "in_progress", "output": [], "usage": None, "error": None}
        await responses.create("acme", start, [], True, {"key_id": "k"})
        cancelled = await responses.cancel("acme", "resp_c")
        assert cancelled is not None and cancelled.body["output"] == []
        output = [{"type": "message", "content": [{"type": "output_text", "text": "partial"}]}]
        usage = {"input_tokens": 3, "output_tokens": 7, "total_tokens": 10}
        final = {**start, "status": "cancelled", "output": output, "usage": usage}
        messages = [{"role": "assistant", "content": "partial"}]
        assert await responses.finish("resp_c", "cancelled", final, messages) is False
        got = await responses.get("acme", "resp_c")
        assert got is not None and got.status == "cancelled" and got.body["status"] == "cancelled"
        assert got.body["output"] == output and got.body["usage"] == usage and got.messages == messages
        # A run that finished as if not cancelled (it raced the cancel): still `cancelled`.
        await responses.create("acme", {**start, "id": "resp_d"}, [], True)
        await responses.cancel("acme", "resp_d")
        await responses.finish("resp_d", "completed", {**final, "id": "resp_d", "status": "completed"}, [])
        raced = await responses.get("acme", "resp_d")
        assert raced is not None and raced.status == "cancelled" and raced.body["status"] == "cancelled"
        assert raced.body["usage"] == usage
        await db.close()

    asyncio.run(scenario())


def test_store_hands_a_lapsed_background_response_to_one_replica_a_bounded_number_of_times(tmp_path):
    async def scenario() -> None:
        db = GatewayStore(f"sqlite:///{tmp_path / 'gw.db'}")
        bounds = StoreBounds(lease_s=30)
        first, second, third = (ResponseStore(db, bounds, owner) for owner in ("one", "two", "three"))
        await first.start()
        job = {"key_id": "k", "request": {}, "chat": {}, "headers": [], "base": []}
        await first.create("acme", {"id": "resp_bg", "status": "queued"}, [], True, job)
        await first.create("acme", {"id": "resp_fg", "status": "in_progress"}, [], True)
        assert await first.sweep(2) == []  # leases held: nothing to claim
        # Its stream's readers are told its writer lives (however long it is silent).
        assert await second.writing("resp_bg") and not await second.writing("chatstream-x")

        def lapse() -> None:
            with db.engine.begin() as conn:
                conn.exec_driver_sql("UPDATE gateway_responses SET lease_until = 0")

        lapse()
        assert not await second.writing("resp_bg")  # lapsed: nobody writes it now
        found = await second.get("acme", "resp_bg")
        assert found is not None and found.lapsed and found.status == "queued"
        claims = [await second.sweep(2), await third.sweep(2)]
        assert [[c.id for c in claim] for claim in claims] == [["resp_bg"], []]
        assert claims[0][0].job == job and claims[0][0].takeovers == 1
        # Not background: nothing could continue it, it failed.
        fg = await first.get("acme", "resp_fg")
        assert fg is not None and fg.status == "failed" and "stopped" in fg.body["error"]["message"]
        # The old owner finds it taken and writes nothing more; the new one renews it.
        assert await first.renew("resp_bg") == "taken"
        assert await first.finish("resp_bg", "completed", {"id": "resp_bg"}, []) is False
        assert await second.renew("resp_bg", 1) == "renewed"  # its claim's epoch
        assert await third.writing("resp_bg")  # taken over: alive again
        lapse()
        assert [c.takeovers for c in await third.sweep(2)] == [2]
        lapse()
        assert await second.sweep(2) == []  # the bound: 2 takeovers, then it ends failed
        spent = await second.get("acme", "resp_bg")
        assert spent is not None and spent.status == "failed"
        assert "stopped 3 times" in spent.body["error"]["message"]
        assert not await first.writing("resp_bg")  # ended failed: its readers may stop
        assert await third.renew("resp_bg") == "ended"

        # One replica stalled past its lease claims its own response: the stalled writer
        # (epoch 0) is not taken for the new one (epoch 1), though the replica is the same.
        await first.create("acme", {"id": "resp_self", "status": "in_progress"}, [], True, job)
        lapse()
        assert [c.takeovers for c in await first.sweep(2)] == [1]
        assert await first.renew("resp_self") == "taken"
        assert await first.finish("resp_self", "completed", {"id": "resp_self"}, []) is False
        assert await first.release("resp_self") is False
        assert await first.renew("resp_self", 1) == "renewed"
        assert await first.finish("resp_self", "completed", {"id": "resp_self"}, [], 1) is True
        done = await first.get("acme", "resp_self")
        assert done is not None and done.status == "completed"

    asyncio.run(scenario())


def _chunks(text: str) -> list[dict]:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    pieces = [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in text]
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(text)}}
    return [role, *pieces, end, usage]


def test_a_resumed_response_stream_continues_the_same_sequence_and_message():
    parsed = oai.parse_request({"model": MODEL, "input": "x", "background": True})
    text = "hello world"
    whole = oai.ResponseStream(parsed, "resp_x", queued=True)
    events = [*whole.start(), *whole.running()]
    for chunk in _chunks(text):
        events.extend(whole.feed(chunk))
    events.extend(whole.finish())
    cut_points = [i for i, e in enumerate(events) if e["type"] == "response.output_text.delta"]
    for cut in (2, 3, *cut_points[:3], cut_points[-1] + 1):
        replayed = json.loads(json.dumps(events[:cut]))  # as the log gives them back
        resumed = oai.ResponseStream.resumed(parsed, "resp_x", replayed)
        emitted = "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta")
        assert resumed.text == emitted and resumed.seq == cut - 1 and not resumed.has_calls
        rest: list[dict] = []
        # What a continuation's chat stream gives: the rest of the text; its prompt held the
        # emitted part.
        remaining = text[len(emitted) :]
        for chunk in _chunks(remaining)[1:-1]:
            rest.extend(resumed.feed(chunk))
        resumed.feed(
            {"choices": [], "usage": {"prompt_tokens": 5 + len(emitted), "completion_tokens": len(remaining)}}
        )
        rest.extend(resumed.finish())
        assert [e["sequence_number"] for e in rest] == list(range(cut, cut + len(rest)))
        assert rest[-1]["type"] == "response.completed"
        unnamed = [{k: v for k, v in item.items() if k != "id"} for item in resumed.response["output"]]
        assert unnamed == [{k: v for k, v in item.items() if k != "id"} for item in whole.response["output"]]
        if emitted:  # the same message went on
            assert resumed.response["output"][0]["id"] == whole.response["output"][0]["id"]
        usage = resumed.response["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (5, len(text))
    with pytest.raises(ValueError):
        oai.ResponseStream.resumed(parsed, "resp_x", [events[0], events[2]])


def test_usage_the_backend_never_reported_is_null_not_zero():
    """A response cancelled (or failed) before the chat stream's usage chunk: its usage is
    unknown, and zeros would claim the tokens it did generate were free."""
    parsed = oai.parse_request({"model": MODEL, "input": "x", "background": True})
    for kwargs in ({"cancelled": True}, {"error": "backend went away"}):
        run = oai.ResponseStream(parsed, "resp_u", queued=True)
        run.start()
        run.running()
        for chunk in _chunks("partial")[:-2]:  # no finish_reason, no usage chunk
            run.feed(chunk)
        final = run.finish(**kwargs)[-1]
        assert final["type"] == "response.failed"
        assert final["response"]["usage"] is None and run.response["usage"] is None
        assert final["response"]["output"][0]["content"][0]["text"] == "partial"
    reported = oai.ResponseStream(parsed, "resp_r", queued=True)
    reported.start()
    for chunk in _chunks("ab"):
        reported.feed(chunk)
    reported.finish(cancelled=True)
    assert reported.response["usage"]["output_tokens"] == 2


def test_a_continuation_asks_for_the_rest_and_refuses_what_cannot_be_continued():
    from types import SimpleNamespace

    from paved.gateway.responses.api import ResponsesAPI

    def resumed(request: dict, chunks: list[dict]):
        parsed = oai.parse_request({"model": MODEL, "input": "x", "background": True, **request})
        run = oai.ResponseStream(parsed, "resp_x", queued=True)
        events = [*run.start(), *run.running()]
        for chunk in chunks:
            events.extend(run.feed(chunk))
        return parsed, oai.ResponseStream.resumed(parsed, "resp_x", json.loads(json.dumps(events)))

    def continuation(request: dict, chunks: list[dict]):
        parsed, run = resumed(request, chunks)
        job = SimpleNamespace(error=None)
        bodies = [json.loads(b) for b in ResponsesAPI._continuation(parsed.chat_body(), run, job)]
        return run, job.error, bodies

    # Text so far: the rest, after it as a final assistant message, with vLLM's extension first.
    run, error, bodies = continuation({"max_output_tokens": 10}, _chunks("abc")[:4])
    assert error is None and len(bodies) == 2
    assert bodies[0]["continue_final_message"] is True and bodies[0]["add_generation_prompt"] is False
    assert "continue_final_message" not in bodies[1]
    for body in bodies:
        assert body["messages"][-1] == {"role": "assistant", "content": "abc"} and body["max_tokens"] == 7
    # Nothing output yet: the request as it was.
    _, error, bodies = continuation({"max_output_tokens": 10}, _chunks("abc")[:1])
    assert error is None and len(bodies) == 1 and bodies[0]["messages"][-1]["role"] == "user"
    assert bodies[0]["max_tokens"] == 10
    # The budget is spent: nothing to ask, it ends incomplete.
    run, error, bodies = continuation({"max_output_tokens": 3}, _chunks("abc")[:4])
    assert error is None and bodies == []
    assert run.finish()[-1]["type"] == "response.incomplete"
    # Mid function call, mid structured output: refused with a reason.
    call = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a"'}}
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    _, error, bodies = continuation(
        {"tools": [tool]}, [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}]
    )
    assert bodies == [] and "function call" in error
    schema = {"type": "json_schema", "name": "s", "schema": {"type": "object"}}
    _, error, bodies = continuation({"text": {"format": schema}}, _chunks('{"a"')[:3])
    assert bodies == [] and "structured output" in error
