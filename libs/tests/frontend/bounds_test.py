"""The frontend's edges are bounded: chunked bodies buffered at once, and the queue merging a
multi-prompt completion's engine streams. States, not timings: hold the bound, show the next
one refused (or paused), release, show it admitted."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest

from paved.engine.protocol import ChoiceDelta, GenerateOutput
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry
from paved.frontend.responses import MERGE_QUEUE_SIZE, merge
from paved.frontend.server import main
from paved.http.body_limit import DEFAULT_MAX_BUFFERED_BYTES, BodyLimitMiddleware
from paved.http.json_body import MAX_DEPTH, JSONBodyError, JSONTooDeepError, parse_json


# ---- chunked bodies buffered at once --------------------------------------------------------------
class _Client:
    """One chunked upload driven by hand: chunks are handed over when the test says so."""

    def __init__(self, middleware: BodyLimitMiddleware):
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.sent: list[dict] = []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        self.task = asyncio.ensure_future(middleware(scope, self.chunks.get, self._send))

    async def _send(self, message: dict) -> None:
        self.sent.append(message)

    def chunk(self, size: int, more: bool) -> None:
        self.chunks.put_nowait({"type": "http.request", "body": b"x" * size, "more_body": more})

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    def body(self) -> dict:
        return json.loads(
            b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        )


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_json_bodies_are_bounded_in_depth():
    assert parse_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == functools.reduce(
        lambda v, _: [v], range(MAX_DEPTH - 1), []
    )
    assert parse_json('{"a": {"b": [1, {"c": null}]}}') == {"a": {"b": [1, {"c": None}]}}
    # Many brackets, little depth: no refusal (a long conversation has a `{` per message).
    assert len(parse_json(b"[" + b",".join([b"{}"] * 10000) + b"]")) == 10000
    for raw in (
        b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
        '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1),
        b"[" * 100000 + b"]" * 100000,  # json.loads itself overflows: RecursionError
    ):
        with pytest.raises(JSONTooDeepError, match=f"nested more than {MAX_DEPTH} levels deep"):
            parse_json(raw)
    with pytest.raises(JSONBodyError, match="not valid UTF-8"):
        parse_json(b'{"a": "\xff"}')
    with pytest.raises(JSONBodyError, match="not valid JSON"):
        parse_json(b"{nope")
    assert issubclass(JSONBodyError, ValueError) and issubclass(JSONTooDeepError, JSONBodyError)


def test_text_bodies_hold_no_lone_surrogate_however_spelled():
    """`unicode_text`: a lone surrogate is refused as an escape, as its own UTF-8 bytes (which
    json.loads decodes with surrogatepass) and inside UTF-16 text (which it auto-detects)."""
    for raw in (
        b'{"a": "\\ud800"}',
        '{"k\\udfff": 1}',
        b'{"a": "\xed\xa0\x80"}',
        '{"a": "\\ud800"}'.encode("utf-16-le"),
    ):
        with pytest.raises(JSONBodyError):
            parse_json(raw, unicode_text=True)
        if isinstance(raw, bytes) and b"\x00" not in raw:
            parse_json(raw)  # without it: as before
    pair = '{"a": "\\ud83d\\ude00 \u00e9"}'.encode()  # a valid pair, and a non-ASCII letter
    assert parse_json(pair, unicode_text=True) == {"a": "\U0001f600 \u00e9"}


def test_chunked_bodies_share_one_buffer_budget():
    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps({"size": len(body)}).encode()})

    async def run():
        middleware = BodyLimitMiddleware(app, max_bytes=100, max_buffered_bytes=150)
        a, b = _Client(middleware), _Client(middleware)
        a.chunk(90, more=True)  # A holds 90 of the 150 bytes, still uploading
        await _settle()
        assert middleware.buffered_bytes == 90 and a.status is None
        b.chunk(40, more=True)
        b.chunk(40, more=True)  # 90 + 80 > 150: B is refused while A is held
        await b.task
        assert middleware.buffered_bytes == 90
        refused = (b.status, b.body())
        a.chunk(10, more=False)
        await a.task
        assert a.status == 200 and a.body() == {"size": 100}
        assert middleware.buffered_bytes == 0  # released when A's request ended
        c = _Client(middleware)  # the same upload as B's now fits
        c.chunk(40, more=True)
        c.chunk(40, more=False)
        await c.task
        b_headers = dict(next(m for m in b.sent if m["type"] == "http.response.start")["headers"])
        return refused, b_headers, c.status, c.body()

    (status, body), headers, c_status, c_body = asyncio.run(run())
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert body["error"]["code"] == "overloaded"
    assert "max_buffered_body_bytes=150" in body["error"]["message"]
    assert c_status == 200 and c_body == {"size": 80}


def test_a_disconnect_mid_upload_releases_its_bytes():
    async def run():
        middleware = BodyLimitMiddleware(lambda *a: None, max_bytes=100, max_buffered_bytes=100)
        a = _Client(middleware)
        a.chunk(60, more=True)
        await _settle()
        assert middleware.buffered_bytes == 60
        a.chunks.put_nowait({"type": "http.disconnect"})
        await a.task
        return middleware.buffered_bytes

    assert asyncio.run(run()) == 0


def test_streamed_chunked_bodies_pass_through_counted_and_are_cut_past_the_limit():
    """With stream_chunked (the gateway's file uploads, which spool to disk) a chunked body
    reaches the app chunk by chunk, nothing buffered; one past max_bytes is cut off there (the
    app sees a disconnect) and the client gets the 413, not the app's answer to the cut."""
    seen: list[list[int]] = []

    async def app(scope, receive, send):
        sizes: list[int] = []
        seen.append(sizes)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 499, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            sizes.append(len(message["body"]))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps({"size": sum(sizes)}).encode()})

    async def run():
        middleware = BodyLimitMiddleware(app, max_bytes=100, max_buffered_bytes=100, stream_chunked=True)
        fits = _Client(middleware)
        fits.chunk(60, more=True)
        await _settle()
        assert seen == [[60]] and middleware.buffered_bytes == 0  # passed on, not held
        fits.chunk(40, more=False)
        await fits.task
        over = _Client(middleware)
        over.chunk(60, more=True)
        over.chunk(60, more=True)
        await over.task
        return fits, over

    fits, over = asyncio.run(run())
    assert fits.status == 200 and fits.body() == {"size": 100} and seen[0] == [60, 40]
    assert seen[1] == [60]  # the app never saw the chunk past the limit
    assert over.status == 413 and over.body()["error"]["code"] == "request_too_large"


def test_buffer_budget_default_and_validation(capsys):
    app = create_app(ModelRegistry([]), max_body_bytes=1024)
    (limit,) = [m for m in app.user_middleware if m.cls is BodyLimitMiddleware]
    assert limit.kwargs["max_buffered_bytes"] == DEFAULT_MAX_BUFFERED_BYTES
    big = create_app(ModelRegistry([]), max_body_bytes=DEFAULT_MAX_BUFFERED_BYTES * 2)
    (limit,) = [m for m in big.user_middleware if m.cls is BodyLimitMiddleware]
    assert limit.kwargs["max_buffered_bytes"] == DEFAULT_MAX_BUFFERED_BYTES * 2
    with pytest.raises(ValueError, match="max_buffered_body_bytes"):
        create_app(ModelRegistry([]), max_body_bytes=4096, max_buffered_body_bytes=1024)
    argv = ["--engine", "kserve://127.0.0.1:9", "--model", "m", "--max-buffered-body-bytes", "10"]
    assert main(argv) == 2
    assert "max_buffered_body_bytes must be an integer >= max_body_bytes" in capsys.readouterr().err


# ---- merge(): backpressure, not loss --------------------------------------------------------------
def test_merge_queue_is_bounded_and_loses_nothing():
    produced = [0, 0]
    per_stream = 500

    async def stream(i: int):
        for k in range(per_stream):
            produced[i] += 1
            yield GenerateOutput([ChoiceDelta(0, f"{i}:{k}")])

    async def run():
        merged = merge([stream(0), stream(1)], max_queued=4)
        first = await merged.__anext__()
        await _settle()
        await _settle()
        # The consumer stopped after one output: the pumps wait for room instead of reading on.
        held = sum(produced)
        rest = [x async for x in merged]
        return first, held, rest

    first, held, rest = asyncio.run(run())
    # One output consumed, 4 queued, one more read by each pump and waiting to be queued.
    assert held <= 1 + 4 + 2
    got = [first, *rest]
    assert len(got) == 2 * per_stream
    for i in (0, 1):
        texts = [out.choices[0].text for s, out in got if s == i]
        assert texts == [f"{i}:{k}" for k in range(per_stream)]  # all of them, in order
    assert MERGE_QUEUE_SIZE == 64


def test_merge_closed_while_its_pumps_wait_for_room():
    async def endless():
        while True:
            yield GenerateOutput([ChoiceDelta(0, "x")])

    async def run():
        merged = merge([endless(), endless()], max_queued=1)
        await merged.__anext__()
        await _settle()
        # Both pumps are blocked on a full queue; closing must not hang on them.
        await asyncio.wait_for(merged.aclose(), 10)

    asyncio.run(run())


# ---- the KServe listener's limits, set on the frontend ----------------------------------------
def test_kserve_limits_are_the_frontends_to_set(tmp_path):
    """`--kserve-max-message-bytes` bounds the frontend's own KServe listener: a request under it
    is scored, one over it is RESOURCE_EXHAUSTED (and the server carries on)."""
    import os

    import numpy as np
    import tritonclient.grpc as grpcclient
    from servers import ServerProcess
    from tritonclient.utils import InferenceServerException

    from paved.runfiles import runfile

    xgb = os.path.dirname(runfile("models/xgb/config.json"))
    server = ServerProcess(
        "--engine", "sim://tiny", "--kserve-grpc-port", "0", "--kserve-model-dir", xgb,
        "--kserve-max-message-bytes", "4096", ready_timeout_s=120,
    )  # fmt: skip
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.kserve_grpc_port}")
    try:
        deadline = time.monotonic() + 60
        while not client.is_model_ready("xgb_scorer"):  # classic models load in the background
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.1)

        def score(rows: int):
            t = grpcclient.InferInput("input__0", [rows, 32], "FP32")
            t.set_data_from_numpy(np.zeros((rows, 32), np.float32))
            return client.infer("xgb_scorer", [t])

        assert score(4).as_numpy("output__0").shape == (4, 3)  # 512 bytes of tensor
        with pytest.raises(InferenceServerException) as e:
            score(64)  # 8 KiB of tensor
        assert "RESOURCE_EXHAUSTED" in str(e.value.status()), e.value
        assert score(4).as_numpy("output__0").shape == (4, 3)
    finally:
        client.close()
        server.terminate()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kserve-grpc-port", "0", "--kserve-max-message-bytes", "100"], "kserve_max_message_bytes"),
        (["--kserve-grpc-port", "0", "--kserve-stream-queue-size", "0"], "kserve_stream_queue_size"),
        (["--kserve-http-port", "0", "--kserve-stream-max-in-flight", "-1"], "kserve_stream_max_in_flight"),
        (["--kserve-stream-queue-size", "8"], "needs kserve_grpc_port or kserve_http_port"),
    ],
)
def test_kserve_limits_out_of_range_exit_2(argv, needle, capsys):
    assert main(["--engine", "sim://tiny", *argv]) == 2
    assert needle in capsys.readouterr().err
