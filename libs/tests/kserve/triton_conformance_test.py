"""One Triton model repository (testdata/conformance) served by the real tritonserver 2.51 and by
paved's KServe server (`paved.kserve.main --model-repository`), and one case list run against
both with tritonclient (gRPC and HTTP; sync, asyncio and streaming).

Each case turns what a server answered into an observation (outputs as dtype, shape and raw
bytes, so equality is bit-equality; errors as the gRPC status and the HTTP status). Triton's
observation is checked against the case's own expectation (so a case cannot pass by both
servers being wrong the same way) and paved's must equal Triton's. Where paved deliberately
differs, the case says so in `DIFFERENCES` with the reason and compares what stays the same.

Models: add_sub (python, batched, dynamic batching), stream (python, decoupled), bls (python,
calls add_sub), raises (python, an exception and an error response), double + pipeline (an
ensemble of python models), torch_linear (TorchScript) and onnx_linear (ONNX). Triton's pip wheel
has no PyTorch or ONNX backend: those two run on paved alone, against the same model evaluated
in this process by torch / onnxruntime.

Gating: paved's backends land separately. A case runs on paved only when every backend it needs
is importable there with its `create(source)` (`paved_missing` says which is not); otherwise
its paved half is skipped naming the backend, and its Triton half still runs. A backend that
is there but whose model does not load fails the test.
"""

from __future__ import annotations

import asyncio
import importlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.triton_server import TritonUrls, paved_kserve_server, triton_server
from paved.kserve.backends import BACKEND_MODULES

REPOSITORY = Path(__file__).resolve().parent / "testdata" / "conformance"
# The backends each model needs (an ensemble needs its steps' too).
MODEL_BACKENDS = {
    "add_sub": ("python",),
    "stream": ("python",),
    "bls": ("python",),
    "raises": ("python",),
    "double": ("python",),
    "pipeline": ("ensemble", "python"),
    "torch_linear": ("pytorch",),
    "onnx_linear": ("onnxruntime",),
}
# What Triton's pip wheel can load: the python backend and ensembles.
TRITON_MODELS = tuple(m for m, b in MODEL_BACKENDS.items() if set(b) <= {"python", "ensemble"})
PAVED_ONLY = "Triton's pip wheel (nvidia-pytriton) ships no PyTorch / ONNX Runtime backend"

# Deliberate differences, by case name: what paved does instead, and why.
DIFFERENCES = {
    "config": "Triton's auto-complete fills defaults into the served config (instance_group names, "
    "optimization, default_model_filename, ...); paved answers the config as written. Compared: "
    "the fields the repository sets.",
    "error: *": "error messages are compared by the facts they must name (the input, the limit, the "
    "model's own message), not word for word; status codes must match exactly.",
    "statistics": "durations are each server's own timings and are not compared; counts are, over "
    "requests sent one at a time (so each is its own execution). Not compared: a python model's "
    "error response (InferenceResponse(error=...)), which Triton counts as a success and paved as "
    "a failure; compute_input / compute_output, which paved reports with 0 ns.",
}

# Where paved does not yet answer as Triton does (not deliberate: each is to be fixed in paved,
# owner named). The paved half of such a case is an expected failure, strict: once paved
# matches, the test fails until the entry goes.
PAVED_GAPS: dict[str, str] = {}


def paved_missing(backend: str) -> str:
    """'' when paved serves `backend` (its module imports and has create); else why not."""
    module = BACKEND_MODULES[backend]
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        return f"paved backend '{backend}' has not landed ({module}: {e})"
    if not callable(getattr(loaded, "create", None)):
        return f"paved backend '{backend}' has not landed ({module} has no create(source))"
    return ""


def _paved_gate(models: tuple[str, ...]) -> str:
    reasons = {paved_missing(b) for m in models for b in MODEL_BACKENDS[m]} - {""}
    return "; ".join(sorted(reasons))


@dataclass
class Clients:
    urls: TritonUrls
    grpc: grpcclient.InferenceServerClient
    http: httpclient.InferenceServerClient


def _wait_models(clients: Clients, models: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(models)
    while pending and time.monotonic() < deadline:
        pending = [m for m in pending if not clients.grpc.is_model_ready(m)]
        if pending:
            time.sleep(0.1)
    if pending:
        index = clients.grpc.get_model_repository_index(as_json=True)
        raise AssertionError(f"models never became ready: {pending}; index: {index}")


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    with triton_server(REPOSITORY, tmp_path_factory.mktemp("triton"), models=TRITON_MODELS) as urls:
        clients = Clients(
            urls, grpcclient.InferenceServerClient(urls.grpc), httpclient.InferenceServerClient(urls.http)
        )
        yield clients
        clients.grpc.close()
        clients.http.close()


@pytest.fixture(scope="module")
def paved(tmp_path_factory):
    with paved_kserve_server(
        REPOSITORY, tmp_path_factory.mktemp("paved"), extra_args=["--log-level", "warning"]
    ) as urls:
        clients = Clients(
            urls, grpcclient.InferenceServerClient(urls.grpc), httpclient.InferenceServerClient(urls.http)
        )
        # Every model whose backends have landed must load (a load failure is a failure here).
        _wait_models(clients, [m for m in MODEL_BACKENDS if not _paved_gate((m,))], 180)
        yield clients
        clients.grpc.close()
        clients.http.close()


# --- observations --------------------------------------------------------------------------


def _tensor(result: Any, name: str) -> tuple[str, tuple[int, ...], bytes]:
    array = result.as_numpy(name)
    return (str(array.dtype), tuple(array.shape), array.tobytes())


def _inputs(module: Any, arrays: dict[str, np.ndarray], datatypes: dict[str, str] | None = None) -> list:
    inputs = []
    for name, array in arrays.items():
        datatype = (datatypes or {}).get(name) or {np.float32: "FP32", np.int32: "INT32"}[array.dtype.type]
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _infer_both(c: Clients, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict:
    g = c.grpc.infer(model, _inputs(grpcclient, arrays))
    h = c.http.infer(model, _inputs(httpclient, arrays))
    return {
        "grpc": {n: _tensor(g, n) for n in outputs} | {"version": g.get_response().model_version},
        "http": {n: _tensor(h, n) for n in outputs} | {"version": h.get_response()["model_version"]},
    }


def _error(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except InferenceServerException as e:
        return str(e.status()), str(e.message())
    raise AssertionError("the request succeeded; an error was expected")


def _errors_both(
    c: Clients,
    model: str,
    arrays: dict[str, np.ndarray],
    version: str = "",
    datatypes: dict[str, str] | None = None,
) -> dict:
    g = _error(lambda: c.grpc.infer(model, _inputs(grpcclient, arrays, datatypes), model_version=version))
    h = _error(lambda: c.http.infer(model, _inputs(httpclient, arrays, datatypes), model_version=version))
    return {"grpc": g, "http": h}


def _f32(*shape: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32) * np.float32(0.37) + np.float32(start)).reshape(
        shape
    )


# --- cases -----------------------------------------------------------------------------------


def case_ready(c: Clients) -> dict:
    return {
        "server": (c.grpc.is_server_live(), c.http.is_server_live()),
        "add_sub": (c.grpc.is_model_ready("add_sub"), c.http.is_model_ready("add_sub")),
        "add_sub v1": (c.grpc.is_model_ready("add_sub", "1"), c.http.is_model_ready("add_sub", "1")),
        "add_sub v2": (c.grpc.is_model_ready("add_sub", "2"), c.http.is_model_ready("add_sub", "2")),
        "unknown": (c.grpc.is_model_ready("nope"), c.http.is_model_ready("nope")),
    }


def expect_ready(o: dict) -> None:
    assert o == {
        "server": (True, True),
        "add_sub": (True, True),
        "add_sub v1": (True, True),
        "add_sub v2": (False, False),
        "unknown": (False, False),
    }


def case_index(c: Clients) -> dict:
    grpc_index = {m.name: (m.version, m.state) for m in c.grpc.get_model_repository_index().models}
    http_index = {
        m["name"]: (m.get("version", ""), m.get("state", "")) for m in c.http.get_model_repository_index()
    }
    # Only the models both servers load (Triton's explicit mode lists the others unloaded).
    return {
        "grpc": {m: grpc_index.get(m) for m in TRITON_MODELS},
        "http": {m: http_index.get(m) for m in TRITON_MODELS},
    }


def expect_index(o: dict) -> None:
    assert o["grpc"] == o["http"] == {m: ("1", "READY") for m in TRITON_MODELS}


def _metadata(c: Clients, model: str) -> dict:
    g = c.grpc.get_model_metadata(model, as_json=True)
    h = c.http.get_model_metadata(model)
    for tensor in g.get("inputs", []) + g.get("outputs", []):
        tensor["shape"] = [int(d) for d in tensor["shape"]]
    keys = ("name", "versions", "platform", "inputs", "outputs")
    return {"grpc": {k: g.get(k) for k in keys}, "http": {k: h.get(k) for k in keys}}


def case_metadata(c: Clients) -> dict:
    return {m: _metadata(c, m) for m in ("add_sub", "stream", "bls", "raises", "pipeline")}


def expect_metadata(o: dict) -> None:
    for per_model in o.values():
        assert per_model["grpc"] == per_model["http"]
    add_sub = o["add_sub"]["grpc"]
    assert add_sub["platform"] == "python" and add_sub["versions"] == ["1"]
    assert add_sub["inputs"] == [
        {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [-1, 4]},
    ]
    assert o["pipeline"]["grpc"]["platform"] == "ensemble"
    assert o["stream"]["grpc"]["outputs"][1] == {"name": "OUT", "datatype": "FP32", "shape": [-1]}


def _config_subset(config: model_config_pb2.ModelConfig) -> dict:
    return {
        "name": config.name,
        "backend": config.backend,
        "platform": config.platform,
        "max_batch_size": config.max_batch_size,
        "input": [(t.name, t.data_type, list(t.dims), t.optional) for t in config.input],
        "output": [(t.name, t.data_type, list(t.dims)) for t in config.output],
        "decoupled": config.model_transaction_policy.decoupled,
        "dynamic_batching": config.HasField("dynamic_batching"),
        "max_queue_delay_us": config.dynamic_batching.max_queue_delay_microseconds,
        "steps": [
            (s.model_name, s.model_version, dict(s.input_map), dict(s.output_map))
            for s in config.ensemble_scheduling.step
        ],
    }


def case_config(c: Clients) -> dict:
    out = {}
    for model in ("add_sub", "stream", "bls", "pipeline"):
        http = json_format.ParseDict(
            c.http.get_model_config(model), model_config_pb2.ModelConfig(), ignore_unknown_fields=True
        )
        out[model] = {
            "grpc": _config_subset(c.grpc.get_model_config(model).config),
            "http": _config_subset(http),
        }
    return out


def expect_config(o: dict) -> None:
    for per_model in o.values():
        assert per_model["grpc"] == per_model["http"]
    assert o["add_sub"]["grpc"]["max_batch_size"] == 8 and o["add_sub"]["grpc"]["max_queue_delay_us"] == 500
    assert o["stream"]["grpc"]["decoupled"] is True
    assert [s[0] for s in o["pipeline"]["grpc"]["steps"]] == ["add_sub", "double"]


A = _f32(3, 4)
B = _f32(3, 4, start=-1.5)


def case_add_sub(c: Clients) -> dict:
    return _infer_both(c, "add_sub", {"INPUT0": A, "INPUT1": B}, ["OUTPUT0", "OUTPUT1"])


def expect_add_sub(o: dict) -> None:
    for transport in ("grpc", "http"):
        assert o[transport]["OUTPUT0"] == ("float32", (3, 4), (A + B).tobytes())
        assert o[transport]["OUTPUT1"] == ("float32", (3, 4), (A - B).tobytes())
        assert o[transport]["version"] == "1"


def case_add_sub_concurrent(c: Clients) -> list:
    """16 one-row requests at once (asyncio gRPC): the dynamic batcher gathers them; each
    answer must still be its own request's."""

    async def run() -> list:
        client = grpcaio.InferenceServerClient(c.urls.grpc)
        try:
            rows = [_f32(1, 4, start=float(i)) for i in range(16)]
            results = await asyncio.gather(
                *(client.infer("add_sub", _inputs(grpcaio, {"INPUT0": r, "INPUT1": r})) for r in rows)
            )
            return [_tensor(r, "OUTPUT0") for r in results]
        finally:
            await client.close()

    return asyncio.run(run())


def expect_add_sub_concurrent(o: list) -> None:
    assert o == [("float32", (1, 4), (_f32(1, 4, start=float(i)) * 2).tobytes()) for i in range(16)]


def case_bls(c: Clients) -> dict:
    return _infer_both(c, "bls", {"X": _f32(4)}, ["Y"])


def expect_bls(o: dict) -> None:
    for transport in ("grpc", "http"):
        assert o[transport]["Y"] == ("float32", (4,), ((_f32(4) + np.float32(1)) * np.float32(2)).tobytes())


def case_pipeline(c: Clients) -> dict:
    return _infer_both(c, "pipeline", {"INPUT0": A[:2], "INPUT1": B[:2]}, ["Y", "DIFF"])


def expect_pipeline(o: dict) -> None:
    for transport in ("grpc", "http"):
        assert o[transport]["Y"] == ("float32", (2, 4), ((A[:2] + B[:2]) * np.float32(2)).tobytes())
        assert o[transport]["DIFF"] == ("float32", (2, 4), (A[:2] - B[:2]).tobytes())


def _stream(c: Clients, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> list:
    """Every response of one request over ModelStreamInfer: (outputs, final flag) in order."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(c.urls.grpc)
    got = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            model, _inputs(grpcclient, arrays), request_id="c1", enable_empty_final_response=True
        )
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                got.append(("error", str(error.status())))
                break
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            tensors = {n: _tensor(result, n) for n in outputs} if response.outputs else {}
            got.append((tensors, final, response.id))
            if final:
                break
    finally:
        client.stop_stream()
        client.close()
    return got


def case_stream_decoupled(c: Clients) -> list:
    data = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    return _stream(c, "stream", {"COUNT": np.array([3], dtype=np.int32), "DATA": data}, ["INDEX", "OUT"])


def expect_stream_decoupled(o: list) -> None:
    data = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    expected = [
        (
            {
                "INDEX": ("int32", (1,), np.array([i], dtype=np.int32).tobytes()),
                "OUT": ("float32", (3,), (data * np.float32(i + 1)).tobytes()),
            },
            False,
            "c1",
        )
        for i in range(3)
    ]
    assert o == [*expected, ({}, True, "c1")]


def case_stream_non_decoupled(c: Clients) -> list:
    """A plain model over ModelStreamInfer: one response that is also the final one."""
    return _stream(c, "add_sub", {"INPUT0": A[:1], "INPUT1": B[:1]}, ["OUTPUT0"])


def expect_stream_non_decoupled(o: list) -> None:
    assert o == [({"OUTPUT0": ("float32", (1, 4), (A[:1] + B[:1]).tobytes())}, True, "c1")]


def case_stream_zero_responses(c: Clients) -> list:
    """A decoupled request answered by the final flag alone."""
    return _stream(c, "stream", {"COUNT": np.array([0], dtype=np.int32), "DATA": _f32(2)}, ["INDEX", "OUT"])


def expect_stream_zero_responses(o: list) -> None:
    assert o == [({}, True, "c1")]


# Error cases: (model, arrays, version, datatypes) -> the facts each server's message must name.
X4 = _f32(1, 4)
ERRORS: dict[str, tuple[str, dict[str, np.ndarray], str, dict[str, str], tuple[str, ...]]] = {
    "unknown model": ("nope", {"INPUT0": X4, "INPUT1": X4}, "", {}, ("nope",)),
    "unknown version": ("add_sub", {"INPUT0": X4, "INPUT1": X4}, "7", {}, ("add_sub", "7")),
    "wrong shape": ("add_sub", {"INPUT0": _f32(1, 5), "INPUT1": _f32(1, 5)}, "", {}, ("INPUT",)),
    "wrong datatype": (
        "add_sub",
        {"INPUT0": np.zeros((1, 4), dtype=np.int32), "INPUT1": X4},
        "",
        {},
        ("INPUT0", "INT32", "FP32"),
    ),
    "missing input": ("add_sub", {"INPUT0": X4}, "", {}, ("INPUT1",)),
    "unknown input": ("add_sub", {"INPUT0": X4, "INPUT1": X4, "EXTRA": X4}, "", {}, ("EXTRA",)),
    "batch over max_batch_size": ("add_sub", {"INPUT0": _f32(9, 4), "INPUT1": _f32(9, 4)}, "", {}, ("8",)),
    # The batcher joins requests input by input: differing sizes would mix requests' rows.
    "batch sizes differ across inputs": (
        "add_sub",
        {"INPUT0": _f32(1, 4), "INPUT1": _f32(2, 4)},
        "",
        {},
        ("batch size", "add_sub"),
    ),
    "model raises": (
        "raises",
        {"X": np.array([-1.0], dtype=np.float32)},
        "",
        {},
        ("negative input refused",),
    ),
    "model error response": ("raises", {"X": np.array([0.0], dtype=np.float32)}, "", {}, ("zero refused",)),
    "decoupled over unary infer": (
        "stream",
        {"COUNT": np.array([1], dtype=np.int32), "DATA": _f32(2)},
        "",
        {},
        (),
    ),
}
ERROR_STATUSES = {
    "unknown model": ("StatusCode.NOT_FOUND", "404"),
    "unknown version": ("StatusCode.NOT_FOUND", "404"),
    "wrong shape": ("StatusCode.INVALID_ARGUMENT", "400"),
    "wrong datatype": ("StatusCode.INVALID_ARGUMENT", "400"),
    "missing input": ("StatusCode.INVALID_ARGUMENT", "400"),
    "unknown input": ("StatusCode.INVALID_ARGUMENT", "400"),
    "batch over max_batch_size": ("StatusCode.INVALID_ARGUMENT", "400"),
    "batch sizes differ across inputs": ("StatusCode.INVALID_ARGUMENT", "400"),
    "model raises": ("StatusCode.INTERNAL", "500"),
    "model error response": ("StatusCode.INTERNAL", "500"),
    # Triton 2.51: "ModelInfer RPC doesn't support models with decoupled transaction policy".
    "decoupled over unary infer": ("StatusCode.UNIMPLEMENTED", "501"),
}


def _error_case(name: str) -> Callable[[Clients], tuple[str, str]]:
    def run(c: Clients) -> tuple[str, str]:
        model, arrays, version, datatypes, says = ERRORS[name]
        both = _errors_both(c, model, arrays, version, datatypes)
        for transport, (_, message) in both.items():
            missing = [fact for fact in says if fact not in message]
            assert not missing, f"{name} over {transport}: the message {message!r} does not name {missing}"
        return both["grpc"][0], both["http"][0]

    return run


def _error_expect(name: str) -> Callable[[tuple[str, str]], None]:
    def expect(observed: tuple[str, str]) -> None:
        assert observed == ERROR_STATUSES[name]

    return expect


def _keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items() if not isinstance(v, (list, dict))} | {
            k: _keys(v) for k, v in value.items() if isinstance(v, (list, dict))
        }
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return type(value).__name__


_STAT_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def _stat_counts(entry: dict) -> dict:
    """The counts of a `model_stats` entry, from HTTP's JSON or gRPC's (int64 as strings,
    zeros left out)."""
    inference = entry.get("inference_stats", {})
    return {
        "inference_count": int(entry.get("inference_count", 0)),
        "execution_count": int(entry.get("execution_count", 0)),
        **{k: int(inference.get(k, {}).get("count", 0)) for k in _STAT_KEYS},
        "batches": {
            int(b["batch_size"]): int(b.get("compute_infer", {}).get("count", 0))
            for b in entry.get("batch_stats", [])
        },
    }


def _stat_delta(after: dict, before: dict) -> dict:
    out = {k: v - before[k] for k, v in after.items() if k != "batches"}
    sizes = sorted(set(after["batches"]) | set(before["batches"]))
    changes = {s: after["batches"].get(s, 0) - before["batches"].get(s, 0) for s in sizes}
    return out | {"batches": {s: n for s, n in changes.items() if n}}


def _stats_both(c: Clients, model: str) -> tuple[dict, dict]:
    (http,) = c.http.get_inference_statistics(model)["model_stats"]
    (grpc,) = c.grpc.get_inference_statistics(model, as_json=True)["model_stats"]
    return http, grpc


def _settled_stats(c: Clients, model: str, before: dict, ended: int) -> tuple[dict, dict]:
    """Both transports' entries once `ended` more requests are recorded (a server may record a
    request just after its response went out) and two reads agree."""
    deadline = time.monotonic() + 30
    while True:
        http, grpc = _stats_both(c, model)
        counts = _stat_counts(http)
        done = counts["success"] + counts["fail"] - before["success"] - before["fail"] >= ended
        if (done and counts == _stat_counts(grpc)) or time.monotonic() > deadline:
            return http, grpc
        time.sleep(0.05)


def case_statistics(c: Clients) -> dict:
    """Counts over requests sent one at a time, the entry's shape, the listing of every model
    and the errors for an unknown model or version."""
    before_http, before_grpc = _stats_both(c, "add_sub")
    before = _stat_counts(before_http)
    assert before == _stat_counts(before_grpc)
    c.grpc.infer("add_sub", _inputs(grpcclient, {"INPUT0": _f32(3, 4), "INPUT1": _f32(3, 4)}))
    c.http.infer("add_sub", _inputs(httpclient, {"INPUT0": X4, "INPUT1": X4}))
    c.grpc.infer("add_sub", _inputs(grpcclient, {"INPUT0": _f32(2, 4), "INPUT1": _f32(2, 4)}))
    _error(lambda: c.grpc.infer("add_sub", _inputs(grpcclient, {"INPUT0": _f32(1, 5), "INPUT1": _f32(1, 5)})))
    after_http, after_grpc = _settled_stats(c, "add_sub", before, 3)

    raises_before = _stat_counts(_stats_both(c, "raises")[0])
    _error(lambda: c.grpc.infer("raises", _inputs(grpcclient, {"X": np.array([-1.0], dtype=np.float32)})))
    raises_http, raises_grpc = _settled_stats(c, "raises", raises_before, 1)

    listed = {
        "http": [
            (s["name"], s["version"])
            for s in c.http.get_inference_statistics()["model_stats"]
            if s["name"] in TRITON_MODELS
        ],
        "grpc": [
            (s.name, s.version)
            for s in c.grpc.get_inference_statistics().model_stats
            if s.name in TRITON_MODELS
        ],
    }
    errors = {}
    for label, (model, version) in {
        "unknown model": ("nope", ""),
        "unknown version": ("add_sub", "7"),
    }.items():
        errors[label] = (
            _error(lambda m=model, v=version: c.grpc.get_inference_statistics(m, v)),
            _error(lambda m=model, v=version: c.http.get_inference_statistics(m, v)),
        )
    return {
        "shape": _keys(after_http),
        "add_sub": {
            "http": _stat_delta(_stat_counts(after_http), before),
            "grpc": _stat_delta(_stat_counts(after_grpc), before),
            "last_inference moved": int(after_http["last_inference"]) > int(before_http["last_inference"]),
        },
        "raises": {
            "http": _stat_delta(_stat_counts(raises_http), raises_before),
            "grpc": _stat_delta(_stat_counts(raises_grpc), raises_before),
        },
        "listed": listed,
        "errors": errors,
    }


def expect_statistics(o: dict) -> None:
    shape = o["shape"]
    assert shape["name"] == shape["version"] == "str"
    assert set(shape["inference_stats"]) >= {*_STAT_KEYS, "cache_hit", "cache_miss"}
    assert all(v == {"count": "int", "ns": "int"} for v in shape["inference_stats"].values())
    assert shape["batch_stats"] == [
        {
            "batch_size": "int",
            "compute_input": {"count": "int", "ns": "int"},
            "compute_infer": {"count": "int", "ns": "int"},
            "compute_output": {"count": "int", "ns": "int"},
        }
    ]
    # 3 + 1 + 2 rows in three executions; the wrong shape is refused before the model.
    add_sub = {
        "inference_count": 6,
        "execution_count": 3,
        **{k: (0 if k == "fail" else 3) for k in _STAT_KEYS},
        "batches": {1: 1, 2: 1, 3: 1},
    }
    assert o["add_sub"] == {"http": add_sub, "grpc": add_sub, "last_inference moved": True}
    # An exception from execute: a failed request, and an execution.
    raises = {"inference_count": 0, "execution_count": 1, **{k: int(k == "fail") for k in _STAT_KEYS}}
    assert o["raises"] == {"http": raises | {"batches": {1: 1}}, "grpc": raises | {"batches": {1: 1}}}
    assert o["listed"]["http"] == o["listed"]["grpc"] == [(m, "1") for m in sorted(TRITON_MODELS)]
    assert o["errors"] == {
        "unknown model": (
            ("StatusCode.INVALID_ARGUMENT", "requested model 'nope' is not available"),
            ("400", "requested model 'nope' is not available"),
        ),
        "unknown version": (
            ("StatusCode.INVALID_ARGUMENT", "requested model version is not available for model 'add_sub'"),
            ("400", "requested model version is not available for model 'add_sub'"),
        ),
    }


def _linear_reference(model: str, x: np.ndarray) -> np.ndarray:
    path = REPOSITORY / model / "1"
    if model == "torch_linear":
        import torch

        module = torch.jit.load(str(path / "model.pt"))
        with torch.no_grad():
            return module(torch.from_numpy(x)).numpy()
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def case_torch_linear(c: Clients) -> dict:
    return _infer_both(c, "torch_linear", {"INPUT__0": _f32(2, 3)}, ["OUTPUT__0"])


def expect_torch_linear(o: dict) -> None:
    want = _linear_reference("torch_linear", _f32(2, 3))
    for transport in ("grpc", "http"):
        assert o[transport]["OUTPUT__0"] == ("float32", (2, 4), want.tobytes())


def case_onnx_linear(c: Clients) -> dict:
    return _infer_both(c, "onnx_linear", {"X": _f32(2, 3)}, ["Y"])


def expect_onnx_linear(o: dict) -> None:
    want = _linear_reference("onnx_linear", _f32(2, 3))
    for transport in ("grpc", "http"):
        assert o[transport]["Y"] == ("float32", (2, 4), want.tobytes())


@dataclass(frozen=True)
class Case:
    name: str
    models: tuple[str, ...]
    run: Callable[[Clients], Any]
    expect: Callable[[Any], None]
    paved_only: str = ""  # why Triton cannot run it (then paved is checked against `expect`)


CASES = [
    Case("ready", ("add_sub",), case_ready, expect_ready),
    Case("index", TRITON_MODELS, case_index, expect_index),
    Case("metadata", ("add_sub", "stream", "bls", "raises", "pipeline"), case_metadata, expect_metadata),
    Case("config", ("add_sub", "stream", "bls", "pipeline"), case_config, expect_config),
    Case("add_sub", ("add_sub",), case_add_sub, expect_add_sub),
    Case("add_sub_concurrent", ("add_sub",), case_add_sub_concurrent, expect_add_sub_concurrent),
    Case("bls", ("bls", "add_sub"), case_bls, expect_bls),
    Case("pipeline", ("pipeline", "add_sub", "double"), case_pipeline, expect_pipeline),
    Case("stream_decoupled", ("stream",), case_stream_decoupled, expect_stream_decoupled),
    Case("stream_non_decoupled", ("add_sub",), case_stream_non_decoupled, expect_stream_non_decoupled),
    Case("stream_zero_responses", ("stream",), case_stream_zero_responses, expect_stream_zero_responses),
    *(
        Case(
            f"error: {name}",
            (model,) if model in MODEL_BACKENDS else ("add_sub",),
            _error_case(name),
            _error_expect(name),
        )
        for name, (model, *_) in ERRORS.items()
    ),
    Case("statistics", ("add_sub",), case_statistics, expect_statistics),
    Case("torch_linear", ("torch_linear",), case_torch_linear, expect_torch_linear, PAVED_ONLY),
    Case("onnx_linear", ("onnx_linear",), case_onnx_linear, expect_onnx_linear, PAVED_ONLY),
]
_TRITON_SEEN: dict[str, Any] = {}


def _triton_observation(case: Case, triton: Clients) -> Any:
    if case.name not in _TRITON_SEEN:
        observed = case.run(triton)
        case.expect(observed)
        _TRITON_SEEN[case.name] = observed
    return _TRITON_SEEN[case.name]


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.paved_only], ids=lambda c: c.name.replace(" ", "_")
)
def test_triton(case: Case, triton: Clients) -> None:
    """The case's expectation holds on the real Triton (the reference paved is held to)."""
    _triton_observation(case, triton)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name.replace(" ", "_"))
def test_paved(case: Case, request: pytest.FixtureRequest) -> None:
    """paved answers what Triton answered (or, for a model Triton cannot load, what the same model
    computes in this process)."""
    gate = _paved_gate(case.models)
    if gate:
        pytest.skip(gate)
    paved: Clients = request.getfixturevalue("paved")
    gap = PAVED_GAPS.get(case.name)
    if gap:
        request.applymarker(pytest.mark.xfail(reason=gap, strict=True))
    observed = case.run(paved)
    if case.paved_only:
        case.expect(observed)
        return
    reference = _triton_observation(case, request.getfixturevalue("triton"))
    difference = DIFFERENCES.get(case.name) or (
        DIFFERENCES["error: *"] if case.name.startswith("error: ") else ""
    )
    assert observed == reference, difference
