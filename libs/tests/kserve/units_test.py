"""Unit tests of the KServe pieces that need no server: tensors, batcher, sampling mapping,
model-directory validation, the HTTP access middleware."""

import asyncio
import json
import logging
import os
import shutil
import threading
import time

import grpc
import numpy as np
import pytest

from libs.tests.kserve.kserve_fakes import xgb_model_dir
from paved.engine.protocol import (
    Constraint,
    EngineUnavailableError,
    InvalidRequestError,
    ModelCard,
    SamplingOptions,
)
from paved.kserve import batcher as batcher_module
from paved.kserve import tensors
from paved.kserve.batcher import DynamicBatcher
from paved.kserve.errors import KServeError
from paved.kserve.http_server import AccessLogMiddleware
from paved.kserve.sampling import options_from_parameters
from paved.kserve.wire import parameters_from_options
from paved.kserve.xgboost_model import ModelConfigError, XGBoostModel

CARD = ModelCard("m", "generate", 512, 0, constraint_backends=("paved", "xgrammar"), max_logprobs=5)


# ---- tensors --------------------------------------------------------------------------------------
def test_bytes_round_trip_and_truncation():
    values = np.array([b"", b"abc", "h\u00e9".encode()], dtype=object)
    raw = tensors.serialize_bytes(values)
    assert tensors.from_raw("t", "BYTES", [3], raw).tolist() == values.tolist()
    for bad in (raw[:-1], raw + b"x", raw[:2]):
        with pytest.raises(KServeError) as info:
            tensors.from_raw("t", "BYTES", [3], bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'t'" in info.value.message


def test_fixed_size_raw_and_json():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.array_equal(tensors.from_raw("x", "INT32", [2, 3], tensors.to_raw(x, "INT32")), x)
    with pytest.raises(KServeError, match="expected 24"):
        tensors.from_raw("x", "INT32", [2, 3], b"\0" * 20)
    assert np.array_equal(tensors.from_json("x", "INT32", [2, 3], [[0, 1, 2], [3, 4, 5]]), x)
    assert tensors.to_json(x, "INT32") == [0, 1, 2, 3, 4, 5]
    for data, needle in (([1, 2], "expected 6"), ([1.5] * 6, "integers"), ([True] * 6, "numbers")):
        with pytest.raises(KServeError, match=needle):
            tensors.from_json("x", "INT32", [2, 3], data)
    with pytest.raises(KServeError, match="does not fit UINT8"):
        tensors.from_json("x", "UINT8", [1], [300])
    with pytest.raises(KServeError, match="BF16"):
        tensors.from_raw("x", "BF16", [1], b"\0\0")


def test_tensor_spec_checks_batch_and_wildcards():
    spec = tensors.TensorSpec("in", "FP32", (-1, 4))
    spec.check("m", "FP32", [8, 3, 4], max_batch_size=8)
    for batch in (9, 0, -1):  # 0 and -1 once read "must be <= 8"
        with pytest.raises(KServeError, match=rf"batch-size must be between 1 and 8 .* batch size {batch}\)"):
            spec.check("m", "FP32", [batch, 3, 4], max_batch_size=8)
    with pytest.raises(KServeError, match=r"Expected \[-1, -1, 4\], got \[2, 3, 5\]"):
        spec.check("m", "FP32", [2, 3, 5], max_batch_size=8)
    with pytest.raises(KServeError, match="data-type is 'INT64'"):
        spec.check("m", "INT64", [1, 3, 4], max_batch_size=8)


# ---- batcher --------------------------------------------------------------------------------------
def test_batcher_coalesces_waiting_requests_in_order():
    calls = []
    gate = threading.Event()

    def run(batch):
        calls.append(batch[:, 0].tolist())
        gate.wait(5)
        return batch * 2

    async def main():
        batcher = DynamicBatcher(run, name="m", max_batch_size=8, max_queue_delay_s=0.0)
        first = asyncio.ensure_future(batcher.submit(np.array([[0.0]])))
        await asyncio.sleep(0.05)  # the first call is running (and blocked) now
        rest = [asyncio.ensure_future(batcher.submit(np.array([[float(i)]] * 2))) for i in range(1, 4)]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(first, *rest)
        await batcher.close()
        return results, dict(batcher.batches)

    results, batches = asyncio.run(main())
    assert calls == [[0.0], [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]]
    assert [r.ravel().tolist() for r in results] == [[0.0], [2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]
    assert batches == {1: 1, 6: 1}


def test_batcher_waits_for_the_preferred_size_up_to_the_delay():
    async def main(delay):
        batcher = DynamicBatcher(
            lambda b: b, name="m", max_batch_size=8, max_queue_delay_s=delay, preferred_batch_sizes=[4]
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        futures = []
        for i in range(4):
            futures.append(asyncio.ensure_future(batcher.submit(np.array([[i]]))))
            await asyncio.sleep(0.01)
        await asyncio.gather(*futures)
        elapsed = loop.time() - start
        await batcher.close()
        return dict(batcher.batches), elapsed

    # A delay far beyond the test's runtime: finishing at all proves the early dispatch.
    batches, elapsed = asyncio.run(main(60.0))
    assert batches == {4: 1} and elapsed < 30
    batches, _ = asyncio.run(main(0.0))
    assert sum(batches.values()) > 1  # no delay: whatever is waiting goes at once


def test_batcher_awaits_a_coroutine_run_on_the_loop():
    """A coroutine `run` (the Python backend's: its work is in a worker process) is awaited on
    the event loop's thread, never handed to a thread; concurrent requests still coalesce."""
    threads = []
    release = None

    async def run(batch):
        threads.append(threading.current_thread())
        await release.wait()
        return batch + 1

    async def main():
        nonlocal release
        release = asyncio.Event()
        batcher = DynamicBatcher(run, name="m", max_batch_size=8)
        first = asyncio.ensure_future(batcher.submit(np.array([[0]])))
        await asyncio.sleep(0.05)  # the first batch is running (awaiting `release`)
        rest = [asyncio.ensure_future(batcher.submit(np.array([[i]]))) for i in (1, 2)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(first, *rest)
        await batcher.close()
        return [r.ravel().tolist() for r in results], dict(batcher.batches)

    results, batches = asyncio.run(main())
    assert results == [[1], [2], [3]] and batches == {1: 1, 2: 1}
    assert threads == [threading.main_thread()] * 2


@pytest.mark.parametrize("turns", [batcher_module.SETTLE_TURNS, 0])
def test_batcher_takes_in_requests_already_on_their_way(monkeypatch, turns):
    """With no queue delay, requests a turn or two behind the first (a gRPC call takes a few
    turns of the loop from its arrival to submit) still join its batch."""
    monkeypatch.setattr(batcher_module, "SETTLE_TURNS", turns)

    async def main():
        batcher = DynamicBatcher(lambda b: b, name="m", max_batch_size=8)

        async def behind(i):
            for _ in range(2):
                await asyncio.sleep(0)
            return await batcher.submit(np.array([[i]]))

        first = asyncio.ensure_future(batcher.submit(np.array([[0]])))
        await asyncio.gather(first, behind(1), behind(2))
        await batcher.close()
        return dict(batcher.batches)

    assert asyncio.run(main()) == ({3: 1} if turns else {1: 1, 2: 1})


def test_batcher_delay_ends_at_its_deadline_never_before():
    """The queue delay is kept by a timer thread (asyncio's timers round up to a millisecond):
    a lone request goes when its delay is over, not before, and one that fills the preferred
    size goes at once whatever the delay."""
    dispatched = []

    def run(batch):
        dispatched.append(time.monotonic())
        return batch

    async def main():
        batcher = DynamicBatcher(
            run,
            name="m",
            max_batch_size=8,
            max_queue_delay_s=0.02,
            preferred_batch_sizes=[2],
            adaptive_delay=False,  # Triton's: every lone request waits its delay
        )
        for _ in range(5):
            enqueued = time.monotonic()
            await batcher.submit(np.array([[1]]))
            assert dispatched[-1] >= enqueued + 0.02
        await batcher.close()
        return dict(batcher.batches)

    assert asyncio.run(main()) == {1: 5}


def test_batcher_stops_waiting_where_waiting_gathers_nothing_and_probes_for_load():
    """A lone client (each request sent once the last was answered): after FRUITLESS_WAITS
    waits that gathered nothing, batches leave without the queue delay, except every
    PROBE_EVERY-th; with adaptive_delay=False (Triton's) every request waits."""
    n = 40

    async def lone(adaptive: bool) -> int:
        batcher = DynamicBatcher(
            lambda b: b, name="m", max_batch_size=8, max_queue_delay_s=0.002,
            preferred_batch_sizes=[4], adaptive_delay=adaptive,
        )  # fmt: skip
        for i in range(n):
            assert (await batcher.submit(np.array([[i]]))).tolist() == [[i]]
        await batcher.close()
        assert dict(batcher.batches) == {1: n}
        return batcher.waits

    fruitless, probe = batcher_module.FRUITLESS_WAITS, batcher_module.PROBE_EVERY
    assert asyncio.run(lone(False)) == n
    assert asyncio.run(lone(True)) == fruitless + (n - fruitless) // probe


def test_batcher_waits_again_once_a_wait_gathers_a_request():
    """In the no-wait state, the probe's wait gathers a second request: both go as one batch,
    and the next lone request waits its delay again."""

    async def main():
        batcher = DynamicBatcher(
            lambda b: b, name="m", max_batch_size=8, max_queue_delay_s=60.0, preferred_batch_sizes=[2]
        )
        batcher._fruitless = batcher_module.FRUITLESS_WAITS  # as after that many fruitless waits
        batcher._unwaited = batcher_module.PROBE_EVERY - 1  # the next batch is a probe
        first = asyncio.ensure_future(batcher.submit(np.array([[1]])))
        await asyncio.sleep(0.05)  # the probe waits (60 s: only the second request ends it)
        second = await batcher.submit(np.array([[2]]))
        assert (await first).tolist() == [[1]] and second.tolist() == [[2]]
        assert dict(batcher.batches) == {2: 1} and batcher.waits == 1 and batcher._fruitless == 0
        third = asyncio.ensure_future(batcher.submit(np.array([[3]])))
        await asyncio.sleep(0.05)
        assert not third.done() and batcher.waits == 2  # waiting again, for its 60 s
        await batcher.submit(np.array([[4]]))
        await third
        await batcher.close()

    asyncio.run(main())


def test_batcher_waits_again_once_requests_overlap():
    """In the no-wait state, a request arriving while another executes is concurrency: the
    batch it forms waits its delay again (and gathers the third)."""
    release = None

    async def run(batch):
        await release.wait()
        return batch

    async def main():
        nonlocal release
        release = asyncio.Event()
        batcher = DynamicBatcher(
            run, name="m", max_batch_size=8, max_queue_delay_s=60.0, preferred_batch_sizes=[2]
        )
        batcher._fruitless = batcher_module.FRUITLESS_WAITS  # as after that many fruitless waits
        first = asyncio.ensure_future(batcher.submit(np.array([[1]])))
        await asyncio.sleep(0.05)
        assert batcher.waits == 0 and dict(batcher.batches) == {1: 1}  # left at once, executing
        second = asyncio.ensure_future(batcher.submit(np.array([[2]])))  # while the first runs
        release.set()
        await first
        await asyncio.sleep(0.05)
        assert not second.done() and batcher.waits == 1  # waiting (60 s) for company
        await batcher.submit(np.array([[3]]))
        await second
        assert dict(batcher.batches) == {1: 1, 2: 1}
        await batcher.close()

    asyncio.run(main())


def test_adaptive_queue_delay_parameter(tmp_path):
    """`paved_adaptive_queue_delay` "false" keeps Triton's always-wait; anything but
    true/false fails the load with the reason."""
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig(name="m", max_batch_size=8)
    config.dynamic_batching.max_queue_delay_microseconds = 100
    assert DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1).adaptive_delay
    config.parameters[batcher_module.ADAPTIVE_DELAY_PARAMETER].string_value = "false"
    assert not DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1).adaptive_delay
    config.parameters[batcher_module.ADAPTIVE_DELAY_PARAMETER].string_value = "sometimes"
    with pytest.raises(ModelConfigError, match="paved_adaptive_queue_delay"):
        DynamicBatcher.for_config(lambda b: b, config, name="m", instances=1)


def test_a_queue_delay_of_centuries_keeps_the_timer_thread():
    """max_queue_delay_microseconds is a uint64: a delay past what a timed wait takes ended the
    timer thread with an OverflowError; the wait is capped and the thread stays."""

    async def main():
        batcher = DynamicBatcher(
            lambda b: b, name="m", max_batch_size=8, max_queue_delay_s=(2**64 - 1) / 1e6,
            preferred_batch_sizes=[2], adaptive_delay=False,
        )  # fmt: skip
        for _ in range(2):
            first = asyncio.ensure_future(batcher.submit(np.array([[1]])))
            await asyncio.sleep(0.05)  # waiting, the timer thread armed with the deadline
            await batcher.submit(np.array([[2]]))
            await first
        assert batcher._timer is not None and batcher._timer._thread.is_alive()
        await batcher.close()

    asyncio.run(main())


def test_deadline_timer_fires_at_the_deadline_and_not_once_disarmed():
    from paved.kserve.batcher import _DeadlineTimer

    async def main():
        event = asyncio.Event()
        timer = _DeadlineTimer(event, "m")
        try:
            deadline = time.monotonic() + 0.01
            timer.arm(deadline)
            await asyncio.wait_for(event.wait(), 10)
            fired = time.monotonic()
            event.clear()
            timer.arm(time.monotonic() + 0.05)
            timer.disarm()
            await asyncio.sleep(0.2)  # well past the dropped deadline
            return fired >= deadline, event.is_set()
        finally:
            timer.close()

    assert asyncio.run(main()) == (True, False)


def test_batcher_queue_limit_and_cancellation():
    gate = threading.Event()

    def run(batch):
        gate.wait(5)
        return batch

    async def main():
        batcher = DynamicBatcher(run, name="m", max_batch_size=1, max_queue_size=2)
        running = asyncio.ensure_future(batcher.submit(np.array([[0]])))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(batcher.submit(np.array([[i]]))) for i in (1, 2)]
        await asyncio.sleep(0.01)
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.array([[3]]))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "queue" in info.value.message
        queued[0].cancel()
        await asyncio.sleep(0.01)
        gate.set()
        assert (await queued[1]).tolist() == [[2]] and (await running).tolist() == [[0]]
        await batcher.close()
        return dict(batcher.batches)

    assert asyncio.run(main()) == {1: 2}  # the cancelled request never ran


# ---- sampling mapping -----------------------------------------------------------------------------
def test_vllm_backend_parameters_map_onto_sampling_options():
    options = options_from_parameters(
        {
            "temperature": "0.7",
            "top_p": 0.9,
            "top_k": "-1",
            "max_tokens": "12",
            "stop": ["\n"],
            "seed": 3,
            "ignore_eos": "false",
            "logit_bias": {"5": -1},
            "logprobs": 2,
            "skip_special_tokens": "True",  # the backend's text form of a flag
        },
        CARD,
        "sampling_parameters",
    )
    assert options == SamplingOptions(
        max_tokens=12,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        seed=3,
        stop=["\n"],
        logit_bias={5: -1.0},
        logprobs=2,
    )
    assert options_from_parameters({}, CARD, "p").max_tokens == 16  # vLLM's default
    assert options_from_parameters({"max_tokens": None}, CARD, "p").max_tokens is None
    with pytest.raises(KServeError, match=r"p.logprobs must be in \[0, 5\]"):
        options_from_parameters({"logprobs": 6}, CARD, "p")


def test_parameters_from_options_round_trip():
    for constraint in (
        Constraint("xgrammar", "json_schema", {"type": "object"}),
        Constraint("xgrammar", "json_object"),
        Constraint("xgrammar", "choice", ["a", "b"]),
        Constraint("xgrammar", "grammar", 'root ::= "a"'),
        Constraint("paved", "paved", {"type": "regex", "pattern": "[0-9]+"}),
    ):
        options = SamplingOptions(max_tokens=5, temperature=0.5, stop=("x",), seed=1, constraint=constraint)
        params = json.loads(json.dumps(parameters_from_options(options)))
        if constraint.backend == "xgrammar":
            # The form Triton's vLLM backend parses: JSON text for StructuredOutputsParams(**...).
            assert isinstance(params["structured_outputs"], str)
        back = options_from_parameters(params, CARD, "p")
        assert (back.max_tokens, back.temperature, tuple(back.stop), back.seed) == (5, 0.5, ("x",), 1)
        assert back.constraint is not None
        if constraint.backend == "paved" or constraint.kind in ("choice", "grammar"):
            assert back.constraint == constraint
    with pytest.raises(InvalidRequestError):
        parameters_from_options(SamplingOptions(prompt_logprobs=1))


# ---- model directories ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, needle",
    [
        ({"backend": "onnxruntime"}, "backend must be 'xgboost'"),
        ({"input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [32]}]}, "TYPE_FP32"),
        ({"parameters": {"colour": {"string_value": "red"}}}, "colour"),
        ({"dynamic_batching": None, "sequence_batching": {}}, "sequence_batching"),
        ({"dynamic_batching": {"preferred_batch_size": [128]}}, "preferred_batch_size"),
        ({"bogus_field": 1}, "bogus_field"),
    ],
)
def test_bad_model_configs_fail_with_the_reason(tmp_path, change, needle):
    source = xgb_model_dir()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    shutil.copy(os.path.join(source, "model.ubj"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=needle):
        XGBoostModel.from_directory(str(tmp_path))


def test_dynamic_batching_with_max_batch_size_0_runs_each_request_alone(tmp_path):
    """Triton loads `dynamic_batching` on a model with max_batch_size 0 and runs each request
    alone (paved refused the load); its queue bound still applies."""
    from paved.kserve.model import InferRequest

    source = xgb_model_dir()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.update(
        max_batch_size=0,
        input=[{"name": "input__0", "data_type": "TYPE_FP32", "dims": [-1, 32]}],
        output=[{"name": "output__0", "data_type": "TYPE_FP32", "dims": [-1, 3]}],
    )
    config["dynamic_batching"] = {
        "max_queue_delay_microseconds": 500,
        "default_queue_policy": {"max_queue_size": 7},
    }
    shutil.copy(os.path.join(source, "model.ubj"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = XGBoostModel.from_directory(str(tmp_path))

    async def main():
        await model.load()
        x = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
        requests = [InferRequest(model_name=model.name, inputs={"input__0": x[i : i + 1]}) for i in (0, 1)]
        answers = await asyncio.gather(*(model.infer(r) for r in requests))
        rows = [[r.outputs["output__0"].shape async for r in a] for a in answers]
        batcher = model.batcher
        await model.close()
        return rows, batcher

    rows, batcher = asyncio.run(main())
    assert rows == [[(1, 3)], [(1, 3)]]
    assert not batcher.coalesce and dict(batcher.batches) == {1: 2} and batcher.max_queue_size == 7


def test_output_dims_are_checked_against_the_booster_at_load(tmp_path):
    source = xgb_model_dir()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["output"][0]["dims"] = [4]
    shutil.copy(os.path.join(source, "model.ubj"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = XGBoostModel.from_directory(str(tmp_path))
    with pytest.raises(ModelConfigError, match="3 score"):
        asyncio.run(model.load())
    state, reason = model.state()
    assert state == "UNAVAILABLE" and "3 score" in reason


@pytest.mark.parametrize(
    "key, value", [("paved_max_queue_bytes", "0"), ("paved_adaptive_queue_delay", "maybe")]
)
def test_a_bad_batching_parameter_fails_the_load_with_its_reason(tmp_path, key, value):
    """Not a model left LOADING with no reason (the batcher is built inside the load)."""
    source = xgb_model_dir()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.setdefault("parameters", {})[key] = {"string_value": value}
    shutil.copy(os.path.join(source, "model.ubj"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = XGBoostModel.from_directory(str(tmp_path))
    with pytest.raises(ModelConfigError, match=key):
        asyncio.run(model.load())
    state, reason = model.state()
    assert state == "UNAVAILABLE" and reason.startswith("load failed: ") and key in reason, reason


def test_transports_count_a_requests_bytes_where_they_decode_it():
    """gRPC and HTTP set InferRequest.input_bytes in their decoding (off the loop when large),
    so the batcher's byte bound reads a number instead of walking BYTES elements on the loop."""
    from tritonclient.grpc import service_pb2

    from paved.kserve import grpc_server, http_server

    model = XGBoostModel.from_directory(xgb_model_dir())
    asyncio.run(model.load())

    class Repository:
        def get_ready(self, name, version=""):
            return model

    x = np.ones((2, 32), np.float32)
    request = service_pb2.ModelInferRequest(model_name=model.name)
    request.inputs.add(name="input__0", datatype="FP32", shape=[2, 32])
    request.raw_input_contents.append(x.tobytes())
    _, decoded = grpc_server.decode_request(Repository(), request, decoupled=False)
    assert decoded.input_bytes == x.nbytes == 256
    body = json.dumps(
        {"inputs": [{"name": "input__0", "datatype": "FP32", "shape": [2, 32], "data": x.ravel().tolist()}]}
    ).encode()
    decoded, _, _ = http_server._decode_infer(model, body, None)
    assert decoded.input_bytes == 256
    asyncio.run(model.close())


def test_server_readiness_follows_the_owners_draining_flag():
    from libs.tests.kserve.kserve_fakes import FakeEngine
    from paved.kserve.repository import ModelRepository

    draining = False
    repository = ModelRepository([FakeEngine()], draining=lambda: draining)
    assert repository.ready()
    draining = True
    assert not repository.ready()


# ---- the HTTP access line -------------------------------------------------------------------------
def test_http_access_line_status_of_an_error_escaping_the_app(caplog):
    """Before any response, an escaping error is answered by Starlette's catch-all outside the
    middleware, so the line names the status its KServe mapping answers (503 here, not 500);
    after the response started, the started status stands. Both answer the request id."""
    caplog.set_level(logging.INFO, logger="paved.kserve.access")
    sent: list[dict] = []

    async def app(scope, receive, send):
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise EngineUnavailableError("down")

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    middleware = AccessLogMiddleware(app)
    for name in ("early", "late"):
        scope = {
            "type": "http",
            "method": "POST",
            "path": f"/{name}",
            "headers": [(b"x-request-id", name.encode())],
        }
        with pytest.raises(EngineUnavailableError):
            asyncio.run(middleware(scope, receive, send))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "paved.kserve.access"]
    assert [(line["request_id"], line["protocol"], line["status"]) for line in lines] == [
        ("early", "kserve-http", 503),
        ("late", "kserve-http", 200),
    ]
    assert [dict(m["headers"])[b"x-request-id"] for m in sent] == [b"late"]


def test_sampling_parameters_past_a_megabyte_are_refused_before_parsing():
    from paved.kserve.sampling import MAX_PARAMETERS_BYTES, parse_parameters

    bias = {str(i): 0 for i in range(200_000)}
    text = json.dumps({"logit_bias": bias}).encode()
    assert len(text) > MAX_PARAMETERS_BYTES
    with pytest.raises(KServeError) as info:
        parse_parameters(text, "sampling_parameters")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "at most" in info.value.message
    assert parse_parameters(b'{"temperature": 0}', "sampling_parameters") == {"temperature": 0}


def test_a_request_naming_an_input_many_times_is_refused_in_linear_time():
    """Half a million copies of one name (a 1 MB gRPC request): counted once, not once per
    name (that was quadratic: minutes of CPU for one request)."""
    model = XGBoostModel.from_directory(xgb_model_dir())
    started = time.process_time()
    with pytest.raises(KServeError) as info:
        model.check_required(["input__0"] * 500_000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in info.value.message
    assert time.process_time() - started < 30  # a bound on a hang, not a timing claim


def test_huge_dimensions_and_impossible_bytes_counts_are_invalid_argument():
    """A 0 beside a huge dimension counts 0 elements, and numpy then refused the shape (an
    INTERNAL); a BYTES count its payload cannot hold is refused before the per-element loop."""
    for shape in ([0, 2**62], [0, 2**63 - 1], [2**32, 0]):
        with pytest.raises(KServeError) as info:
            tensors.from_json("x", "FP32", shape, [])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in info.value.message
        with pytest.raises(KServeError) as info:
            tensors.from_raw("x", "FP32", shape, b"")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Every dimension in range, their product (without the 0) past what numpy can shape.
    for shape in ([0, 3, 2**31 - 1, 2**31 - 1], [0, 2**31 - 1, 2**30]):
        for decode, payload in ((tensors.from_json, []), (tensors.from_raw, b"")):
            with pytest.raises(KServeError) as info:
                decode("x", "FP64", shape, payload)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "too large" in info.value.message
    assert tensors.from_raw("x", "UINT8", [0, 2**31 - 1, 2**27], b"").shape == (0, 2**31 - 1, 2**27)
    with pytest.raises(KServeError) as info:
        tensors.deserialize_bytes(b"\0" * 40, 11, "s")
    assert "cannot hold 11 BYTES elements" in info.value.message
    assert list(tensors.deserialize_bytes(b"\0" * 40, 10, "s")) == [b""] * 10


def test_large_grpc_requests_are_decoded_off_the_event_loop(monkeypatch):
    """Decoding is Python loops over a request's elements (seconds for tens of MB): past
    OFF_LOOP_BYTES it runs in a worker thread, so the loop keeps serving the others."""
    from tritonclient.grpc import service_pb2

    from paved.http.off_loop import OFF_LOOP_BYTES
    from paved.kserve import grpc_server

    threads: list[threading.Thread] = []

    def decode(repository, request, *, decoupled):
        threads.append(threading.current_thread())
        return "model", "request"

    monkeypatch.setattr(grpc_server, "decode_request", decode)
    small = service_pb2.ModelInferRequest(model_name="m")
    big = service_pb2.ModelInferRequest(model_name="m")
    big.raw_input_contents.append(b"\0" * (OFF_LOOP_BYTES + 1))
    for request in (small, big):
        decoded = asyncio.run(grpc_server.decode_off_loop(None, request, decoupled=False))
        assert decoded == ("model", "request")
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()
