"""Triton's ModelStatistics on paved's KServe server (paved.kserve.statistics): the entry shape
tritonclient reads, counts recorded per model version by the repository and the batcher, and
the errors for a model or version that is not there.

The server runs the //models/xgb XGBoost model (dynamic batching) and a scripted LLM; two
in-process models cover what the transports cannot provoke (a batched execution that fails,
a model without a batcher). Counts are compared as differences across requests this module
sends one at a time, so each request is its own execution.
"""

import asyncio
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import (
    EMBED,
    LLM,
    XGB,
    FakeEngine,
    llm_inputs,
    loopback_server,
    serving,
    stream,
    tensor,
    wait_for,
)
from paved.kserve.batcher import DynamicBatcher
from paved.kserve.errors import KServeError
from paved.kserve.repository import InferRequest, InferResponse, ModelRepository, ServedModel
from paved.kserve.tensors import TensorSpec

# Every key of a `model_stats` entry as Triton 2.51 writes it over HTTP (checked against the
# real server by triton_conformance_test).
ENTRY_KEYS = {
    "name",
    "version",
    "last_inference",
    "inference_count",
    "execution_count",
    "inference_stats",
    "response_stats",
    "batch_stats",
    "memory_usage",
}
INFERENCE_KEYS = {
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
}


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(loop, engine):
    with serving(loop, loopback_server([engine])) as server:
        yield server


def rows(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 32)).astype(np.float32)


def stats(hc, name: str, version: str = "") -> dict:
    (entry,) = hc.get_inference_statistics(name, version)["model_stats"]
    return entry


def counts(entry: dict) -> dict:
    """The deterministic part of an entry: every count, batch sizes with their executions."""
    inference = entry["inference_stats"]
    return {
        "inference_count": entry["inference_count"],
        "execution_count": entry["execution_count"],
        **{key: inference[key]["count"] for key in sorted(INFERENCE_KEYS)},
        "batches": {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]},
    }


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in after if k != "batches"}
    sizes = set(after["batches"]) | set(before["batches"])
    out["batches"] = {
        s: after["batches"].get(s, 0) - before["batches"].get(s, 0)
        for s in sorted(sizes)
        if after["batches"].get(s, 0) != before["batches"].get(s, 0)
    }
    return out


def test_entry_has_tritons_shape_on_both_transports(gc, hc):
    http = stats(hc, XGB)
    assert set(http) == ENTRY_KEYS and set(http["inference_stats"]) == INFERENCE_KEYS
    for duration in http["inference_stats"].values():
        assert set(duration) == {"count", "ns"} and all(isinstance(v, int) for v in duration.values())
    assert (http["name"], http["version"]) == (XGB, "1")
    assert http["response_stats"] == {} and http["memory_usage"] == []
    # The gRPC answer is the same message (no request ran in between).
    http_message = json_format.ParseDict(
        hc.get_inference_statistics(XGB), service_pb2.ModelStatisticsResponse()
    )
    assert gc.get_inference_statistics(XGB) == http_message


def test_batched_requests_count_rows_executions_and_batch_sizes(gc, hc):
    before = counts(stats(hc, XGB))
    first_ms = stats(hc, XGB)["last_inference"]
    gc.infer(XGB, [tensor(grpcclient, "input__0", rows(3), "FP32")])
    hc.infer(XGB, [tensor(httpclient, "input__0", rows(1), "FP32")])
    gc.infer(XGB, [tensor(grpcclient, "input__0", rows(3), "FP32")], model_version="1")
    after_entry = stats(hc, XGB, "1")
    assert delta(counts(after_entry), before) == {
        "inference_count": 7,
        "execution_count": 3,
        "success": 3,
        "fail": 0,
        "queue": 3,
        "compute_input": 3,
        "compute_infer": 3,
        "compute_output": 3,
        "cache_hit": 0,
        "cache_miss": 0,
        "batches": {1: 1, 3: 2},
    }
    assert after_entry["last_inference"] > first_ms
    inference = after_entry["inference_stats"]
    # A request's queue and compute time lie inside its duration.
    assert inference["success"]["ns"] >= inference["queue"]["ns"] + inference["compute_infer"]["ns"]
    assert inference["compute_infer"]["ns"] > 0


def test_refused_requests_are_not_counted(gc, hc):
    before = counts(stats(hc, XGB))
    with pytest.raises(InferenceServerException):  # wrong shape: refused before the model
        gc.infer(XGB, [tensor(grpcclient, "input__0", np.zeros((1, 5), np.float32), "FP32")])
    with pytest.raises(InferenceServerException):  # wrong datatype
        hc.infer(XGB, [tensor(httpclient, "input__0", np.zeros((1, 32), np.int32), "INT32")])
    with pytest.raises(InferenceServerException):  # refused by the model itself, before its batcher
        gc.infer(XGB, [tensor(grpcclient, "input__0", rows(1), "FP32")], parameters={"unknown": 1})
    assert delta(counts(stats(hc, XGB)), before)["batches"] == {}
    assert all(v == 0 for k, v in delta(counts(stats(hc, XGB)), before).items() if k != "batches")


def test_streamed_llm_request_is_one_execution(gc, hc):
    before = counts(stats(hc, LLM))
    out = stream(gc, [(llm_inputs(grpcclient, "hi", stream=True, params={"max_tokens": 3}), {})])
    assert all(error is None for _, error in out)
    assert delta(counts(stats(hc, LLM)), before) == {
        "inference_count": 1,
        "execution_count": 1,
        "success": 1,
        "fail": 0,
        "queue": 1,
        "compute_input": 1,
        "compute_infer": 1,
        "compute_output": 1,
        "cache_hit": 0,
        "cache_miss": 0,
        "batches": {1: 1},
    }


def test_cancelled_request_is_neither_success_nor_failure(gc, hc, engine):
    before = counts(stats(hc, LLM))
    with pytest.raises(InferenceServerException) as info:
        gc.infer(LLM, llm_inputs(grpcclient, "hang"), client_timeout=2)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    admitted = engine.requests[-1].request_id
    assert wait_for(lambda: admitted in engine.aborted), engine.aborted
    changed = delta(counts(stats(hc, LLM)), before)
    assert changed["success"] == changed["fail"] == changed["execution_count"] == 0


def test_all_models_and_errors(gc, hc):
    names = [(s["name"], s["version"]) for s in hc.get_inference_statistics()["model_stats"]]
    assert names == sorted([(EMBED, "1"), (LLM, "1"), (XGB, "1")])
    assert [(s.name, s.version) for s in gc.get_inference_statistics().model_stats] == names
    for name, version, message in (
        ("nope", "", "requested model 'nope' is not available"),
        (XGB, "7", f"requested model version is not available for model '{XGB}'"),
    ):
        for client, status in ((gc, "StatusCode.INVALID_ARGUMENT"), (hc, "400")):
            with pytest.raises(InferenceServerException) as info:
                client.get_inference_statistics(name, version)
            assert (info.value.status(), info.value.message()) == (status, message)


# ---- in-process: what the transports cannot provoke ------------------------------------------
class _Batched(ServedModel):
    """A batched model whose executions fail when the first row is negative."""

    name, max_batch_size = "batched", 8
    inputs = (TensorSpec("X", "FP32", (1,)),)
    outputs = (TensorSpec("Y", "FP32", (1,)),)

    def __init__(self):
        self.batcher: DynamicBatcher | None = None

    def state(self):
        return "READY", ""

    async def load(self):
        self.batcher = DynamicBatcher(type(self)._run, name=self.name, max_batch_size=8, coalesce=False)

    async def close(self):
        if self.batcher is not None:
            await self.batcher.close()

    # A first row of 5 holds its execution until the test opens this.
    gate = threading.Event()

    @classmethod
    def _run(cls, x: np.ndarray) -> np.ndarray:
        if x[0, 0] == 5:
            cls.gate.wait(30)
        if x[0, 0] < 0:
            raise KServeError(grpc.StatusCode.INTERNAL, "negative row")
        return x * 2

    async def infer(self, request):
        assert self.batcher is not None
        y = await self.batcher.submit(request.inputs["X"])

        async def one():
            yield InferResponse({"Y": y})

        return one()


class _Unbatched(ServedModel):
    """Answers without a batcher (like an ensemble or an LLM); fails on a negative input."""

    name = "unbatched"
    inputs = (TensorSpec("X", "FP32", (1,)),)
    outputs = (TensorSpec("Y", "FP32", (1,)),)

    def state(self):
        return "READY", ""

    async def infer(self, request):
        x = request.inputs["X"]

        async def one():
            if x[0] < 0:
                raise KServeError(grpc.StatusCode.INTERNAL, "negative input")
            yield InferResponse({"Y": x})

        return one()


async def _run(repository: ModelRepository, model: ServedModel, x: np.ndarray) -> bool:
    try:
        responses = await repository.infer(model, InferRequest(model.name, inputs={"X": x}))
        async for _ in responses:
            pass
    except KServeError:
        return False
    return True


def test_failed_executions_and_models_without_a_batcher():
    async def scenario():
        batched, unbatched = _Batched(), _Unbatched()
        repository = ModelRepository(classic=[batched, unbatched])
        repository.start_loading()
        await repository.wait_loaded()
        try:
            ok = np.ones((2, 1), np.float32)
            results = [
                await _run(repository, batched, ok),
                await _run(repository, batched, -ok),
                await _run(repository, unbatched, np.ones(1, np.float32)),
                await _run(repository, unbatched, -np.ones(1, np.float32)),
            ]
            return results, repository.statistics("batched"), repository.statistics("unbatched")
        finally:
            await repository.close()

    results, (b,), (u,) = asyncio.run(scenario())
    assert results == [True, False, True, False]
    # The failed batch is an execution (as in Triton) whose rows are not inferences.
    assert counts(b) | {"batches": b["batch_stats"][0]["batch_size"]} == {
        "inference_count": 2,
        "execution_count": 2,
        "success": 1,
        "fail": 1,
        "queue": 1,
        "compute_input": 1,
        "compute_infer": 1,
        "compute_output": 1,
        "cache_hit": 0,
        "cache_miss": 0,
        "batches": 2,
    }
    assert b["batch_stats"][0]["compute_infer"]["count"] == 2
    # Without a batcher a request is its own execution: no queue time, compute is its duration.
    u_inference = u["inference_stats"]
    assert (u["execution_count"], u_inference["success"]["count"], u_inference["fail"]["count"]) == (2, 1, 1)
    assert u_inference["queue"]["ns"] == 0
    assert u_inference["compute_infer"]["ns"] == u_inference["success"]["ns"] > 0


def test_request_cancelled_during_its_execution_is_not_counted():
    async def scenario():
        batched = _Batched()
        repository = ModelRepository(classic=[batched])
        repository.start_loading()
        await repository.wait_loaded()
        try:
            task = asyncio.create_task(_run(repository, batched, np.full((1, 1), 5, np.float32)))
            while batched.batcher is None or not batched.batcher.batches:  # until it is dispatched
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            _Batched.gate.set()
            await _run(repository, batched, np.ones((1, 1), np.float32))  # after the held execution
            return repository.statistics("batched")[0]
        finally:
            _Batched.gate.set()
            await repository.close()

    entry = asyncio.run(scenario())
    # Both executions ran; only the second request ended, and it succeeded.
    assert (entry["execution_count"], counts(entry)["success"], counts(entry)["fail"]) == (2, 1, 0)
