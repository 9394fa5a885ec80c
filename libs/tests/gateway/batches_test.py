"""The OpenAI Files + Batches API at the gateway, driven with the official `openai` client
against gateway mains in front of a paved frontend on the simulated engine.

One module fleet: a frontend (sim), a PostgreSQL, and two gateway replicas sharing it (and one
files directory); a third gateway on SQLite with a short batch window for expiry."""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import signal
import time

import httpx
import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.testing.postgres import create_database, postgres_server

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches")
    frontend = ServerProcess("--engine", "sim://tiny?tokens_per_s=2000&max_num_seqs=64", ready_timeout_s=120)
    gateways: list[GatewayProcess] = []
    try:
        with postgres_server() as pg:
            state = create_database(pg, "gateway")
            routes = write_routes(
                tmp / "routes.json",
                [
                    {
                        "alias": "tiny",
                        "backends": [{"url": frontend.url, "version": "v1"}],
                        "cache": {"exact": True},
                    }
                ],
            )
            admin = "adm-" + secrets.token_hex(16)
            # Small output chunks: a batch here spans several, committed by both replicas.
            common = [
                "--state",
                state,
                "--files-dir",
                str(tmp / "files"),
                "--batch-lease",
                "3",
                "--batch-chunk-lines",
                "25",
            ]
            for _ in range(2):
                gateways.append(GatewayProcess(routes, *common, admin_key=admin, state_dir=tmp))
            yield {"gateways": gateways, "frontend": frontend, "tmp": tmp, "routes": routes, "admin": admin}
            for gw in gateways:
                gw.stop()
    finally:
        for gw in gateways:
            gw.stop()
        frontend.terminate()


def _client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=30, max_retries=0)


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def _chat_lines(n: int, *, prefix: str = "q", max_tokens: int = 8) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"question {prefix} {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


@pytest.mark.parametrize(
    ("header", "wait"),
    [(None, None), ("2", 2.0), ("0.5", 0.5), ("-3", 0.0), ("1e6", 300.0), ("soon", None)]
    + [(v, None) for v in ("nan", "NaN", "inf", "-inf", "1e999")],
)
def test_a_backends_retry_after_is_finite_and_clamped(header, wait):
    """Retry-After is the upstream's word: NaN failed the lease's NOT NULL write on every tick
    (the runner stuck), inf parked the line until its batch expired."""
    from paved.gateway.batches.runner import _retry_after_s

    assert _retry_after_s(header) == wait


def test_a_line_request_reads_connected_through_every_proxy_step():
    """The proxy watches for a client disconnect around each step of a request (headers, then
    the body) and cancels each watcher when its step ends. A batch line's request must still
    read as connected at the next step: it did not, and a line whose body read took a loop turn
    was answered 499 and retried after a backoff."""
    from paved.gateway.batches.runner import _request
    from paved.gateway.forwarding.held import unless_gone

    async def go() -> list[int]:
        request = _request("/v1/chat/completions", [], b"{}")
        assert await request.body() == b"{}"
        return [
            await unless_gone(request.receive, asyncio.sleep(0.01, result=step), lambda _: None)
            for step in range(3)
        ]

    assert asyncio.run(go()) == [0, 1, 2]


class _FakeLines:
    """The runner's side of BatchStore over one in-memory batch of `total` lines."""

    def __init__(self, total: int):
        self.total, self.next_line, self.status = total, 0, "in_progress"
        self.states: dict[int, str] = {}

    async def runnable(self, now):
        batch = {"id": "batch_x", "tenant": "t", "key_id": "k", "model": "tiny", "metadata": None}
        return [{**batch, "endpoint": "/v1/chat/completions"}] if self.status == "in_progress" else []

    async def lease(self, batch_id, owner, n, now, lease_s):
        from paved.gateway.batches.store import Lease

        nos = [i for i in range(self.total) if self.states.get(i, "pending") == "pending"][:n]
        for i in nos:
            self.states[i] = "leased"
        return [Lease(batch_id, i, f"c{i}", {}, 1, 0.0) for i in nos]

    async def settle(self, lease, owner, state, result, next_at=0.0):
        self.states[lease.line_no] = state
        return True

    async def settle_many(self, owner, outcomes, tokens=None, now=0.0):
        for lease, state, _, _ in outcomes:
            self.states[lease.line_no] = state
        return [True] * len(outcomes)

    async def token_use(self, now):
        return {}

    async def retired(self, cutoff, limit):
        return []

    async def expired_files(self, now, limit):
        return []

    async def prune_token_use(self, now):
        pass

    async def batch_states(self, ids):
        return {"batch_x": (self.status, 1e12)}

    async def renew(self, owner, until):
        pass

    async def to_finalize(self, now):
        return []

    async def line_stats(self):
        return []


def test_runner_starts_a_line_leased_ahead_as_one_ends_and_releases_them_on_cancel():
    """A runner keeps its slots full from lines leased ahead: a line that ends starts the next
    one at once, before any tick (slots waiting for the next tick's lease cost the batch a
    tenth of its throughput). On cancel, the running lines and those leased ahead go back to
    pending: none is left leased."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from paved.gateway.batches.runner import BatchMetrics, BatchRunner, RunnerConfig

    async def go() -> None:
        store = _FakeLines(20)
        router = SimpleNamespace(split_model=lambda m: (m, None), saturated=lambda m, sticky_key: False)
        proxy = SimpleNamespace(router=router, flow=None)
        clock = [1000.0]
        runner = BatchRunner(
            store,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            proxy,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            BatchMetrics(CollectorRegistry()),
            RunnerConfig(concurrency=4),
            clock=lambda: clock[0],
        )
        answers: dict[int, asyncio.Future] = {}

        async def send(batch, lease):
            answers[lease.line_no] = asyncio.get_running_loop().create_future()
            await answers[lease.line_no]
            return 200, "req", {"ok": True}, None

        runner._send = send  # type: ignore[method-assign]
        await runner.tick()
        for _ in range(3):
            await asyncio.sleep(0)
        assert sorted(answers) == [0, 1, 2, 3]  # concurrency 4 running ...
        assert sum(v == "leased" for v in store.states.values()) == 6  # ... and 2 leased ahead
        answers[0].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert sorted(answers) == [0, 1, 2, 3, 4]  # started without a tick
        clock[0] += 0.5
        await runner.tick()  # commits line 0, refills the lines ahead
        assert store.states[0] == "done"
        store.status = "cancelling"
        clock[0] += 1.0
        await runner.tick()  # maintenance: abandons the running lines, releases the ones ahead
        for _ in range(3):
            await asyncio.sleep(0)
        assert "leased" not in store.states.values(), store.states
        await runner.stop()

    asyncio.run(go())


def test_openai_client_end_to_end_and_outputs_equal_interactive(fleet):
    a, _ = fleet["gateways"]
    a.tenant("acme", models=["tiny"])
    key = a.key("acme")
    client = _client(a, key)
    lines = _chat_lines(20)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.content(uploaded.id).content == _jsonl(lines)

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 20
    assert batch.metadata == {"job": "e2e"}
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.completed == 20 and done.request_counts.failed == 0
    assert done.error_file_id is None and done.completed_at is not None
    out = _lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    by_id = {x["custom_id"]: x for x in out}
    # The same lines sent interactively at temperature 0 answer the same text.
    for line in lines[:5]:
        answer = client.chat.completions.create(**line["body"])
        got = by_id[line["custom_id"]]
        assert got["response"]["status_code"] == 200 and got["error"] is None
        assert got["id"].startswith("batch_req_") and got["response"]["request_id"]
        assert (
            got["response"]["body"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
        )
    # Listing: newest first, cursor pagination.
    second = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = client.batches.list(limit=1)
    assert [x.id for x in page.data] == [second.id] and page.has_more
    older = client.batches.list(limit=1, after=second.id)
    assert [x.id for x in older.data] == [batch.id]
    _wait(client, second.id)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_invalid_files_are_refused_naming_the_line(fleet):
    a, _ = fleet["gateways"]
    a.tenant("strict", models=["tiny"])
    client = _client(a, a.key("strict"))
    good = _chat_lines(3)
    cases = [
        ([*good, dict(good[0])], "line 4", "custom_id"),
        ([good[0], {**good[1], "method": "GET"}], "line 2", "method"),
        ([good[0], {**good[1], "body": {**good[1]["body"], "model": "nope"}}], "line 2", "body.model"),
        ([good[0], {**good[1], "body": {**good[1]["body"], "stream": True}}], "line 2", "body.stream"),
        ([{**good[0], "body": {**good[0]["body"], "max_tokens": -1}}], "line 1", "body.max_tokens"),
        (
            [good[0], {**good[1], "body": {**good[1]["body"], "response_format": {"type": "xml"}}}],
            "line 2",
            "body.response_format",
        ),
        ([good[0], {**good[1], "url": "/v1/embeddings"}], "line 2", "url"),
    ]
    before = len(client.files.list().data)
    for lines, where, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.files.create(file=("bad.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        message = err.value.body["message"]
        assert where in message and field in message, message
        assert err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(
            file=("bad.jsonl", io.BytesIO(b'{"custom_id": "x"}\nnot json\n')), purpose="batch"
        )
    assert "line 1" in err.value.body["message"]
    assert len(client.files.list().data) == before  # nothing kept of an invalid file
    # A valid file for another endpoint than the batch's is refused at create.
    uploaded = client.files.create(file=("ok.jsonl", io.BytesIO(_jsonl(good))), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
        )


def test_file_expires_after(fleet):
    """OpenAI's `expires_after` at upload: the file object carries its `expires_at` (the sweep
    that deletes it then is batch_chunks_test's); bounds and anchor checked, 400 naming them."""
    a, b = fleet["gateways"]
    a.tenant("expiring", models=["tiny"])
    client = _client(a, a.key("expiring"))
    data = io.BytesIO(_jsonl(_chat_lines(2)))
    f = client.files.create(
        file=("in.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert f.expires_at == f.created_at + 3600
    assert _client(b, a.key("expiring")).files.retrieve(f.id).expires_at == f.expires_at
    assert {x.id: x.expires_at for x in client.files.list()}[f.id] == f.expires_at
    kept = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")
    assert kept.expires_at is None
    for expires_after, param in (
        ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 31 * 24 * 3600}, "expires_after.seconds"),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.files.create(
                file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))),
                purpose="batch",
                expires_after=expires_after,  # type: ignore[arg-type]
            )
        assert err.value.body["param"] == param


def test_tenant_isolation(fleet):
    a, b = fleet["gateways"]
    a.tenant("one", models=["tiny"])
    a.tenant("two", models=["tiny"])
    one, two = _client(a, a.key("one")), _client(b, a.key("two"))
    f = one.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")
    batch = one.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: two.files.retrieve(f.id),
        lambda: two.files.content(f.id),
        lambda: two.files.delete(f.id),
        lambda: two.batches.retrieve(batch.id),
        lambda: two.batches.cancel(batch.id),
        lambda: two.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in two.files.list()]
    assert batch.id not in [x.id for x in two.batches.list()]
    done = _wait(one, batch.id)
    with pytest.raises(openai.NotFoundError):
        two.files.content(done.output_file_id)


def test_cache_write_feeds_the_interactive_path(fleet):
    a, b = fleet["gateways"]
    a.tenant("cat", models=["tiny"])
    key = a.key("cat")
    client = _client(a, key)
    lines = _chat_lines(3, prefix="cat")
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"paved_cache": "write"},
    )
    assert _wait(client, batch.id).status == "completed"
    # The exact cache here is each replica's memory: the replica that ran the line answers it.
    served = {
        httpx.post(
            gw.url + "/v1/chat/completions",
            json=lines[0]["body"],
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ).headers.get("x-paved-cache")
        for gw in (a, b)
    }
    assert "exact" in served, served


def test_cancel_delivers_partial_files(fleet):
    a, _ = fleet["gateways"]
    a.tenant("stopper", models=["tiny"])
    client = _client(a, a.key("stopper"))
    lines = _chat_lines(300, prefix="c", max_tokens=64)
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each exactly once
    assert any(x["error"] and x["error"]["code"] == "batch_cancelled" for x in err)
    assert done.request_counts.completed == len(out)


def test_replica_killed_mid_batch_the_other_finishes_each_line_once(fleet):
    a, b = fleet["gateways"]
    a.tenant("durable", models=["tiny"])
    client = _client(b, a.key("durable"))
    lines = _chat_lines(400, prefix="k", max_tokens=32)
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # Both replicas run lines; a is killed (no shutdown) once some are done.
    while client.batches.retrieve(batch.id).request_counts.completed < 40:
        time.sleep(0.05)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    done = _wait(client, batch.id, timeout_s=240)
    assert done.status == "completed", done
    out = _lines(client, done.output_file_id)
    ids = [x["custom_id"] for x in out]
    assert len(ids) == len(set(ids)) == 400 and done.error_file_id is None
    # The chunks the output was assembled from (some written by the killed replica, perhaps
    # one it wrote and never committed) went once the files were published.
    assert not (fleet["tmp"] / "files" / "batches" / batch.id).exists()
    expected = client.chat.completions.create(**lines[7]["body"]).choices[0].message.content
    assert {x["custom_id"]: x for x in out}["k-7"]["response"]["body"]["choices"][0]["message"][
        "content"
    ] == expected


def test_expiry_delivers_finished_lines(tmp_path, fleet):
    admin = fleet["admin"]
    gw = GatewayProcess(
        fleet["routes"],
        "--batch-window",
        "3",
        "--batch-concurrency",
        "2",
        admin_key=admin,
        state_dir=tmp_path,
    )
    try:
        gw.tenant("late", models=["tiny"])
        client = _client(gw, gw.key("late"))
        lines = _chat_lines(500, prefix="e", max_tokens=128)
        f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _wait(client, batch.id)
        assert done.status == "expired" and done.expired_at is not None
        out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
        assert out, "finished lines are delivered"
        assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
        assert all(x["error"]["code"] == "batch_expired" for x in err)
    finally:
        gw.stop()


def test_cli_create_wait_list_get_download(fleet, tmp_path, monkeypatch, capsys):
    from paved.cli.main import main

    gw = fleet["gateways"][1]  # the replica still up after the kill test
    gw.tenant("cli", models=["tiny"])
    monkeypatch.setenv("PAVED_API_KEY", gw.key("cli"))
    monkeypatch.setenv("PAVED_GATEWAY_URL", gw.url)
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(_chat_lines(5, prefix="cli")))
    assert main(["batches", "create", str(src), "--wait", "--poll", "0.2"]) == 0
    out = capsys.readouterr()
    batch_id = out.out.strip()
    assert batch_id.startswith("batch_") and "5/5 (0 failed) completed" in out.err
    assert main(["batches", "list"]) == 0 and batch_id in capsys.readouterr().out
    assert main(["batches", "get", batch_id]) == 0 and "completed, 5/5 done" in capsys.readouterr().out
    target = tmp_path / "out.jsonl"
    assert main(["batches", "download", batch_id, "--output", str(target)]) == 0
    assert sorted(json.loads(x)["custom_id"] for x in target.read_text().splitlines()) == [
        f"cli-{i}" for i in range(5)
    ]
    assert main(["batches", "get", "batch_nope"]) == 1
    assert "No such batch" in capsys.readouterr().err
    assert main(["batches", "create", str(tmp_path / "missing.jsonl")]) == 2


def test_an_unwritable_file_store_is_a_503_not_a_500(tmp_path, fleet):
    """A file store that cannot be written (a full or read-only disk, here a folder under /proc)
    refuses the upload with a 503 naming the cause and a Retry-After, never a 500; with no
    --files-dir the files go beside the gateway's SQLite state, which it can write."""
    admin = fleet["admin"]
    broken = GatewayProcess(
        fleet["routes"], "--files-dir", "/proc/paved-no-such-dir", admin_key=admin, state_dir=tmp_path / "a"
    )
    try:
        broken.tenant("ro", models=["tiny"])
        client = _client(broken, broken.key("ro"))
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")
        assert refused.value.status_code == 503, refused.value
        assert "file store is unavailable" in str(refused.value) and "/proc" not in str(refused.value)
        assert refused.value.response.headers.get("retry-after")
    finally:
        broken.stop()
    state = tmp_path / "b"
    plain = GatewayProcess(fleet["routes"], admin_key=admin, state_dir=state)
    try:
        plain.tenant("rw", models=["tiny"])
        client = _client(plain, plain.key("rw"))
        f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")
        assert list((state / "gateway-files").rglob(f.id)), "stored beside the gateway's state"
    finally:
        plain.stop()


def test_malformed_values_are_4xx_never_500(fleet):
    """Values of the wrong type, digits int() refuses, and NUL characters (which PostgreSQL's
    text refuses: each was a 500 on this fleet's database) are answered with a 4xx and the
    OpenAI error body, wherever they appear: a path's id, a query, a body, a file's line."""
    # b: a is killed by an earlier test of the module.
    _, b = fleet["gateways"]
    b.tenant("odd", models=["tiny"])
    headers = {"Authorization": f"Bearer {b.key('odd')}"}
    client = _client(b, b.key("odd"))
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")

    def refused(response: httpx.Response, status: int, param: str | None = None) -> None:
        assert response.status_code == status, (response.status_code, response.text)
        error = response.json()["error"]
        assert error["message"] and set(error) >= {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param, error

    def create(**body: object) -> httpx.Response:
        good = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return httpx.post(b.url + "/v1/batches", json={**good, **body}, headers=headers, timeout=30)

    def upload(data: bytes, **fields: str) -> httpx.Response:
        return httpx.post(
            b.url + "/v1/files",
            files={"file": ("in.jsonl", data)},
            data={"purpose": "batch", **fields},
            headers=headers,
            timeout=30,
        )

    refused(create(endpoint=["/v1/chat/completions"]), 400, "endpoint")
    refused(create(completion_window={"24h": True}), 400, "completion_window")
    refused(create(input_file_id="file-a\x00b"), 404, "input_file_id")
    line = _chat_lines(1)[0]
    refused(upload(_jsonl([{**line, "url": {"path": "/v1/chat/completions"}}])), 400, "url")
    refused(upload(_jsonl([{**line, "custom_id": "a\x00b"}])), 400, "custom_id")
    # A lone surrogate (no UTF-8 text holds it: every later create and read was a 500) and a
    # line nested past the bound (RecursionError: a 500 at upload) are the line's 400.
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (rb'{"custom_id": "\ud800"}', b'{"custom_id": "x", "body": ' + deep + b"}"):
        response = upload(raw + b"\n")
        refused(response, 400)
        assert "line 1" in response.json()["error"]["message"], response.text
    raw_create = (
        json.dumps(
            {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        ).encode()[:-1]
        + rb', "metadata": {"k": "\ud800"}}'
    )
    refused(
        httpx.post(
            b.url + "/v1/batches",
            content=raw_create,
            headers={**headers, "content-type": "application/json"},
            timeout=30,
        ),
        400,
        "metadata",
    )
    for seconds in ("²", "9" * 5000):
        refused(
            upload(
                _jsonl([line]), **{"expires_after[anchor]": "created_at", "expires_after[seconds]": seconds}
            ),
            400,
            "expires_after.seconds",
        )
    for method, path in (
        ("GET", "/v1/files/file-a%00b"),
        ("GET", "/v1/files/file-a%00b/content"),
        ("DELETE", "/v1/files/file-a%00b"),
        ("GET", "/v1/batches/batch_a%00b"),
        ("POST", "/v1/batches/batch_a%00b/cancel"),
    ):
        refused(httpx.request(method, b.url + path, headers=headers, timeout=30), 404)
    for path, param in (
        ("/v1/files?after=file-a%00b", "after"),
        ("/v1/files?purpose=ba%00tch", "purpose"),
        ("/v1/batches?after=batch_a%00b", "after"),
    ):
        refused(httpx.get(b.url + path, headers=headers, timeout=30), 400, param)
    assert uploaded.id in [f.id for f in client.files.list()]  # the gateway still serves


def test_a_file_whose_object_is_gone_is_a_404_not_a_cut_answer(fleet):
    """The object deleted under a file's row (a DELETE racing the read, or lost): its content and
    a batch created from it are 404s, answered before any byte of a 200 (the content used to be
    a 200 whose body was cut at the first chunk, the create a 500)."""
    _, b = fleet["gateways"]
    b.tenant("vanishing", models=["tiny"])
    client = _client(b, b.key("vanishing"))
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(_chat_lines(2)))), purpose="batch")
    (stored,) = (fleet["tmp"] / "files").rglob(f.id)
    stored.unlink()
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.body["param"] == "input_file_id"
    assert f.id not in [b.input_file_id for b in client.batches.list()]
