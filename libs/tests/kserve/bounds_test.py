"""Every KServe edge is bounded: each test holds a bound's worth of work and shows that one more
is refused with an error naming the limit (states, not timings)."""

import asyncio
import json
import queue
import struct
import threading

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import EMBED, LLM, FakeEngine, llm_inputs, tensor, wait_for
from paved.engine.protocol import ChoiceDelta, GenerateOutput
from paved.kserve import model as model_module
from paved.kserve.batcher import (
    DEFAULT_MAX_QUEUE_BYTES,
    DEFAULT_MAX_QUEUE_ROWS,
    QUEUE_BYTES_PARAMETER,
    DynamicBatcher,
)
from paved.kserve.errors import KServeError
from paved.kserve.grpc_server import KServeServicer
from paved.kserve.main import _parser as main_parser
from paved.kserve.main import main, start_server
from paved.kserve.model import InferRequest
from paved.kserve.model_config import ModelConfigError
from paved.kserve.repository import ModelRepository


# ---- DynamicBatcher: the queue bound counts rows ---------------------------------------------------
async def busy_batcher(gate: threading.Event, **kw) -> tuple[DynamicBatcher, asyncio.Future]:
    """A batcher of one instance, busy with a first request (`running`) until `gate` is set."""

    def run(batch):
        gate.wait(10)
        return batch

    batcher = DynamicBatcher(run, name="m", **kw)
    running = asyncio.ensure_future(batcher.submit(np.zeros((1, 1))))
    while not batcher.batches:
        await asyncio.sleep(0.01)
    return batcher, running


def test_batcher_queue_bound_counts_rows_not_requests():
    gate = threading.Event()

    async def main():
        batcher, running = await busy_batcher(gate, max_batch_size=4, max_queue_size=6)
        # Two requests of 3 rows fill the 6-row queue (two requests: a request count would not).
        queued = [asyncio.ensure_future(batcher.submit(np.full((3, 1), i))) for i in (1, 2)]
        await asyncio.sleep(0)
        assert batcher._pending_rows == 6
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.zeros((1, 1)))
        gate.set()
        results = await asyncio.gather(running, *queued)
        # Drained: the same request is admitted now.
        again = await batcher.submit(np.zeros((1, 1)))
        await batcher.close()
        return info.value, results, again

    error, results, again = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "Exceeds maximum queue size" in error.message and "6 rows" in error.message
    assert [r.shape[0] for r in results] == [1, 3, 3] and again.shape == (1, 1)


def test_batcher_default_bound_and_an_oversized_request_alone():
    gate = threading.Event()

    def run(batch):
        gate.wait(10)
        return batch

    async def main():
        batcher = DynamicBatcher(run, name="m", max_batch_size=8)
        assert batcher.max_queue_size == DEFAULT_MAX_QUEUE_ROWS
        running = asyncio.ensure_future(batcher.submit(np.zeros((1, 1))))
        while not batcher.batches:
            await asyncio.sleep(0.01)
        # Larger than the bound, but the queue is empty: it waits alone rather than never running.
        big = asyncio.ensure_future(batcher.submit(np.zeros((DEFAULT_MAX_QUEUE_ROWS + 1, 1))))
        await asyncio.sleep(0)
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.zeros((1, 1)))
        gate.set()
        await asyncio.gather(running, big)
        await batcher.close()
        return info.value

    assert f"limit is {DEFAULT_MAX_QUEUE_ROWS} rows" in asyncio.run(main()).message
    with pytest.raises(ValueError):
        DynamicBatcher(lambda b: b, name="m", max_batch_size=1, max_queue_size=-1)


def test_batcher_queue_bound_counts_bytes_too():
    """Rows are not alike: two 1-row requests of 64 bytes fill a 128-byte queue; a caller's
    `nbytes` (an envelope carrying its tensors) counts instead of the carrier's; a request
    leaving the queue gives its bytes back; a request over the bound still runs alone."""
    gate = threading.Event()

    async def main():
        batcher, running = await busy_batcher(gate, max_batch_size=8, max_queue_bytes=128)
        first = asyncio.ensure_future(batcher.submit(np.zeros((1, 8))))  # 64 bytes
        carrier = np.empty(1, dtype=object)
        second = asyncio.ensure_future(batcher.submit(carrier, 64))  # 8 bytes as a carrier
        await asyncio.sleep(0)
        assert (batcher._pending_rows, batcher._pending_bytes) == (2, 128)
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.zeros((1, 1)))
        second.cancel()
        await asyncio.sleep(0)
        assert batcher._pending_bytes == 64
        third = asyncio.ensure_future(batcher.submit(np.zeros((1, 8))))  # fits again
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(running, first, third)
        assert batcher._pending_bytes == 0
        # Over the bound on its own, into an empty queue: admitted.
        big = await batcher.submit(np.zeros((1, 32)))
        await batcher.close()
        return info.value, big

    error, big = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.retry_after_s == 1
    assert "Exceeds maximum queue size" in error.message and "limit is 128 bytes" in error.message
    assert "paved_max_queue_bytes" in error.message and big.shape == (1, 32)
    with pytest.raises(ValueError):
        DynamicBatcher(lambda b: b, name="m", max_batch_size=1, max_queue_bytes=0)


def test_a_cancelled_request_leaves_a_queue_of_multi_element_tensors():
    """A client leaving while requests of more than one element wait: its request leaves the
    queue (the queue compared requests by their arrays, whose truth numpy refuses: the leaving
    request raised ValueError and its rows stayed counted for good)."""
    gate = threading.Event()

    async def main():
        batcher, running = await busy_batcher(gate, max_batch_size=8, max_queue_size=4)
        ahead = asyncio.ensure_future(batcher.submit(np.zeros((2, 3))))
        leaving = asyncio.ensure_future(batcher.submit(np.ones((2, 3))))
        await asyncio.sleep(0)
        assert batcher._pending_rows == 4
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert batcher._pending_rows == 2 and len(batcher._pending) == 1
        gate.set()
        await asyncio.gather(running, ahead)
        await batcher.close()

    asyncio.run(main())


@pytest.mark.parametrize("value", ["0", "-1", "1e9", "lots", "", "9" * 19, "١٢"])
def test_queue_bytes_parameter_is_a_positive_integer(value):
    config = model_config_pb2.ModelConfig(name="m", max_batch_size=8)
    config.dynamic_batching.SetInParent()
    assert DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1).max_queue_bytes == (
        DEFAULT_MAX_QUEUE_BYTES
    )
    config.parameters[QUEUE_BYTES_PARAMETER].string_value = " 4096 "
    assert DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1).max_queue_bytes == 4096
    config.max_batch_size = 0  # Triton's default scheduler keeps the bound too
    assert DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1).max_queue_bytes == 4096
    config.parameters[QUEUE_BYTES_PARAMETER].string_value = value
    with pytest.raises(ModelConfigError, match="paved_max_queue_bytes must be a positive integer"):
        DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1)


def test_a_requests_size_counts_bytes_elements_by_length(monkeypatch):
    text = np.array([b"x" * 1000, "y" * 10, 5], dtype=object)
    request = InferRequest("m", inputs={"a": np.zeros((2, 4), np.float32), "t": text})
    assert request.size == 32 + 1000 + 10 + 8
    # A transport counts where it decodes (off the loop for a large request): read, not walked.
    monkeypatch.setattr(model_module, "tensor_bytes", lambda array: pytest.fail("walked on the loop"))
    assert InferRequest("m", inputs={"t": text}, input_bytes=1018).size == 1018
    assert request.size == 1050  # counted once


# ---- admission: the frontend's ModelRegistry bounds the standalone server too ---------------------
class HoldingEngine(FakeEngine):
    """Embeddings wait until released, so a test can hold them in flight."""

    def __init__(self):
        super().__init__()
        self.release_embeddings: asyncio.Event | None = None

    async def embed(self, request):
        self.embed_requests.append(request)
        await self.release_embeddings.wait()
        return await super().embed(request)


@pytest.fixture(scope="module")
def held(loop):
    """The standalone main's server (start_server) with small admission bounds."""
    engine = HoldingEngine()
    args = main_parser().parse_args(
        ["--grpc-port", "0", "--http-port", "0", "--host", "127.0.0.1", "--stream-max-in-flight", "2"]
    )

    async def start():
        engine.release_embeddings = asyncio.Event()
        registry, server = await start_server(args, [engine], {LLM: 2, EMBED: 1})
        await registry.start()
        return registry, server

    registry, server = loop.run(start())
    yield engine, registry, server
    loop.loop.call_soon_threadsafe(engine.release_embeddings.set)
    loop.run(server.stop(grace_s=1))


def _queued(registry, model):
    return next(m for m in registry.served() if m.card.id == model).queued_sequences


def _hang(url):
    """An HTTP generate_stream request that holds one sequence until closed."""
    client = httpx.Client(timeout=10)
    body = {"text_input": "hang", "stream": True, "exclude_input_in_output": True}
    cm = client.stream("POST", f"{url}/v2/models/{LLM}/generate_stream", json=body)
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
    line = next(lines)  # the first event: admitted and running
    assert "error" not in line, line
    return client, cm, lines


def test_standalone_llm_admission_is_bounded(held):
    _, registry, server = held
    url = f"http://127.0.0.1:{server.http_port}"
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    holders = [_hang(url), _hang(url)]
    try:
        assert _queued(registry, LLM) == 2
        # Two sequences held: the third is refused on both transports, naming the bound.
        refused = httpx.post(f"{url}/v2/models/{LLM}/generate", json={"text_input": "hi"}, timeout=10)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "at capacity (2 sequences in flight)" in refused.json()["error"]
        with pytest.raises(InferenceServerException) as info:
            gc.infer(LLM, llm_inputs(grpcclient, "hi"))
        assert info.value.status() == "StatusCode.UNAVAILABLE" and "at capacity" in info.value.message()
        # n=3 can never fit a bound of 2: a client error, not a retry.
        with pytest.raises(InferenceServerException) as info:
            gc.infer(LLM, llm_inputs(grpcclient, "hi", params={"n": 3}))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        client, cm, _ = holders.pop()
        cm.__exit__(None, None, None)
        client.close()
        assert wait_for(lambda: _queued(registry, LLM) == 1)
        result = gc.infer(LLM, llm_inputs(grpcclient, "hi", params={"max_tokens": 2}))
        assert result.as_numpy("text_output")[0] == b"hiw0 w1 "
    finally:
        for client, cm, _ in holders:
            cm.__exit__(None, None, None)
            client.close()
        gc.close()
    assert wait_for(lambda: _queued(registry, LLM) == 0)


def test_standalone_embedding_admission_is_bounded(loop, held):
    engine, registry, server = held
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    body = np.array([json.dumps({"input": "a b"}).encode()], dtype=object)
    inputs = lambda: [tensor(grpcclient, "embedding_request", body, "BYTES")]  # noqa: E731
    results: queue.Queue = queue.Queue()
    before = len(engine.embed_requests)
    first = threading.Thread(target=lambda: results.put(gc.infer(EMBED, inputs())))
    first.start()
    try:
        assert wait_for(lambda: len(engine.embed_requests) == before + 1)  # held in the engine
        assert _queued(registry, EMBED) == 1
        with pytest.raises(InferenceServerException) as info:
            gc.infer(EMBED, inputs())
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert "at capacity (1 sequences in flight)" in info.value.message()
    finally:
        loop.loop.call_soon_threadsafe(engine.release_embeddings.set)
        first.join(10)
    assert json.loads(results.get(timeout=10).as_numpy("text_output")[0])[0] == 3.0
    assert _queued(registry, EMBED) == 0
    gc.close()


# ---- ModelStreamInfer: requests in flight and responses waiting, per stream -----------------------
def test_stream_in_flight_bound_is_in_band_and_keeps_the_stream(held):
    _, registry, server = held
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    gc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(2):
            gc.async_stream_infer(
                LLM, llm_inputs(grpcclient, "hang", stream=True, exclude=True), request_id=f"h{i}"
            )
        seen = set()
        while seen != {"h0", "h1"}:  # both are running (each sent a response)
            result, error = results.get(timeout=10)
            assert error is None
            seen.add(result.get_response().id)
        gc.async_stream_infer(LLM, llm_inputs(grpcclient, "hi", exclude=True), request_id="third")
        while True:
            result, error = results.get(timeout=10)
            if error is not None:
                break
        assert "stream_max_in_flight=2" in str(error)
        # The stream lives on: its two requests still stream.
        ids = {results.get(timeout=10)[0].get_response().id for _ in range(4)}
        assert ids <= {"h0", "h1"}
    finally:
        gc.stop_stream(cancel_requests=True)
        gc.close()
    assert wait_for(lambda: _queued(registry, LLM) == 0)


class FloodEngine(FakeEngine):
    """The prompt "flood" streams without end and without waiting, counting what it produced."""

    def __init__(self):
        super().__init__()
        self.produced = 0

    async def _stream(self, request, prompt):
        if prompt != "flood":
            async for out in super()._stream(request, prompt):
                yield out
            return
        try:
            while True:
                self.produced += 1
                yield GenerateOutput(
                    [ChoiceDelta(0, "x ", [1])], prompt_tokens=1 if self.produced == 1 else None
                )
                await asyncio.sleep(0)
        finally:
            self.aborted.append(request.request_id)


def _stream_request(text: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=LLM, id="f")
    for name, datatype, raw in (
        ("text_input", "BYTES", struct.pack("<I", len(text)) + text.encode()),
        ("stream", "BOOL", b"\x01"),
        ("exclude_input_in_output", "BOOL", b"\x01"),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


def test_stream_response_queue_is_bounded():
    async def run():
        engine = FloodEngine()
        servicer = KServeServicer(ModelRepository([engine]), stream_queue_size=4)
        closed = asyncio.Event()

        async def requests():
            yield _stream_request("flood")
            await closed.wait()

        responses = servicer.ModelStreamInfer(requests(), None)
        first = await responses.__anext__()
        for _ in range(500):
            await asyncio.sleep(0)
        # The client read one response: 4 wait in the queue, the request holds one more.
        held = engine.produced
        more = [await responses.__anext__() for _ in range(10)]
        for _ in range(500):
            await asyncio.sleep(0)
        after = engine.produced
        closed.set()
        await responses.aclose()
        return first, held, more, after, engine

    first, held, more, after, engine = asyncio.run(run())
    assert first.infer_response.id == "f" and all(not m.error_message for m in more)
    assert held <= 1 + 4 + 1, held
    assert after <= held + 10, (held, after)
    assert engine.aborted  # closing the call aborted the endless request


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--stream-max-in-flight", "0"], "--stream-max-in-flight must be at least 1"),
        (["--stream-queue-size", "-3"], "--stream-queue-size must be at least 1"),
        (["--max-message-bytes", "10"], "--max-message-bytes must be at least 1024"),
    ],
)
def test_bad_bound_flags_exit_2(tmp_path, capsys, flags, needle):
    assert main(["--model-dir", str(tmp_path), *flags]) == 2
    assert needle in capsys.readouterr().err
