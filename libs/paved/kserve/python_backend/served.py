"""A Triton Python-backend model (`<model>/<version>/model.py` defining TritonPythonModel) as
a ServedModel.

`create` checks the config; `load` starts one worker process per instance (instance_group
count, 1 by default; paved.kserve.python_backend.worker), runs the class's
auto_complete_config in the first one, then initialize(args) in each. Requests are scheduled
by the DynamicBatcher like the other classic models: with `dynamic_batching` the requests of a
batch reach one execute(requests) call together, each with its own tensors (Triton does not
concatenate them for Python models); without it each request is its own execute call.

Responses: a model that is not decoupled returns one InferenceResponse per request from
execute (or sends exactly one through a response sender); a decoupled one
(model_transaction_policy { decoupled: true }) sends any number through
`request.get_response_sender()` and ends with TRITONSERVER_RESPONSE_COMPLETE_FINAL, and those
become the request's InferResponses (ModelStreamInfer, generate_stream).

Errors as Triton reports them: an exception from execute fails every request of the batch
with INTERNAL "Failed to process the request(s) for model '<instance>', message: <Type>:
<text>" and the model's frames ("At: ..."); an InferenceResponse's TritonError fails its
request with the error's code (INVALID_ARG -> INVALID_ARGUMENT, ...). A worker that dies or
goes silent for `paved_execute_timeout_s` (config parameter, seconds, default
DEFAULT_EXECUTE_TIMEOUT_S) fails what it had in flight with INTERNAL "Stub process '<instance>'
is not healthy: <reason>" (Triton's words) and, unlike Triton, is restarted; a request whose
execute() returned without its final response fails after the same time without one. A
decoupled model refuses unary requests with UNIMPLEMENTED, as Triton does.

BLS: a worker's `InferenceRequest(model_name=...).exec()` arrives here and runs on any model
of the same repository (source.repository), validated as a client's request would be. When
every request of an execute() in progress has ended on the server's side (its clients gone or
past their deadlines), the BLS calls its worker is waiting on are cancelled and the model gets
a CANCELLED error for each: nobody waits for their answers, and a model calling itself with no
instance free (it waits on its own queue) would otherwise hold its instance forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from paved.engine.streams import Closing, aclose
from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.batcher import DynamicBatcher
from paved.kserve.errors import KServeError, from_exception, invalid_argument, unavailable, unsupported
from paved.kserve.metrics import batch_rows
from paved.kserve.model import (
    InferRequest,
    InferResponse,
    ModelState,
    ServedModel,
    custom_parameters,
)
from paved.kserve.model_config import config_to_dict, specs_from_config
from paved.kserve.python_backend.worker import Worker
from paved.kserve.tensors import TensorSpec, datatype_of

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "model.py"
TIMEOUT_PARAMETER = "paved_execute_timeout_s"
DEFAULT_EXECUTE_TIMEOUT_S = 300.0
INITIALIZE_TIMEOUT_S = 600.0
# Responses a decoupled model sent for one request that its client has not read yet. A model's
# send() cannot wait for the client (Triton's does not either), so past this the request is
# failed and cancelled in the model rather than held in memory without end.
MAX_HELD_RESPONSES = 4096
# Triton's TRITONSERVER_Error codes (pb_utils.TritonError.*) <-> gRPC status codes.
_TRITON_TO_GRPC = {
    0: grpc.StatusCode.UNKNOWN,
    1: grpc.StatusCode.INTERNAL,
    2: grpc.StatusCode.NOT_FOUND,
    3: grpc.StatusCode.INVALID_ARGUMENT,
    4: grpc.StatusCode.UNAVAILABLE,
    5: grpc.StatusCode.UNIMPLEMENTED,
    6: grpc.StatusCode.ALREADY_EXISTS,
    7: grpc.StatusCode.CANCELLED,
}
_GRPC_TO_TRITON = {v: k for k, v in _TRITON_TO_GRPC.items()}
_FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Parameters of Triton's Python backend that ask for what this server does not do.
_UNSUPPORTED_PARAMETERS = {
    "EXECUTION_ENV_PATH": "custom execution environments (conda-pack) are not supported",
}


def create(source: ModelSource) -> PythonModel:
    return PythonModel(source)


def _specs(config: model_config_pb2.ModelConfig) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The config's tensors (model_config.specs_from_config), minus what a Python model cannot
    be given: BF16 (numpy has no such type), ragged batches, shape tensors, non-linear formats."""
    inputs, outputs = specs_from_config(config)
    where = f"model '{config.name}'"
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for t in tensors:
            if t.data_type == model_config_pb2.TYPE_BF16:
                raise ModelConfigError(f"{where}: {kind} '{t.name}': data_type TYPE_BF16 is not supported")
            if kind == "input" and (t.allow_ragged_batch or t.is_shape_tensor or t.is_non_linear_format_io):
                raise ModelConfigError(
                    f"{where}: input '{t.name}': ragged batches, shape tensors and non-linear formats "
                    "are not supported"
                )
    return inputs, outputs


def _validate(c: model_config_pb2.ModelConfig) -> None:
    where = f"model '{c.name}'"
    if c.backend != "python" or c.platform:
        raise ModelConfigError(f'{where}: the python backend serves backend: "python" (no platform)')
    if c.max_batch_size < 0:
        raise ModelConfigError(f"{where}: max_batch_size must be >= 0")
    if c.HasField("dynamic_batching"):
        # With max_batch_size 0 it is accepted and each request runs alone, as in Triton.
        db = c.dynamic_batching
        if db.priority_levels or db.priority_queue_policy or db.preserve_ordering:
            raise ModelConfigError(f"{where}: priority levels and preserve_ordering are not supported")
        policy = db.default_queue_policy
        if policy.default_timeout_microseconds or policy.allow_timeout_override or policy.timeout_action:
            raise ModelConfigError(f"{where}: queue timeouts are not supported (max_queue_size is)")
        if any(not 1 <= p <= c.max_batch_size for p in db.preferred_batch_size):
            raise ModelConfigError(f"{where}: preferred_batch_size entries must be in [1, max_batch_size]")
    for group in c.instance_group:
        if group.kind not in (
            model_config_pb2.ModelInstanceGroup.KIND_AUTO,
            model_config_pb2.ModelInstanceGroup.KIND_CPU,
        ):
            raise ModelConfigError(f"{where}: instance_group kind must be KIND_CPU (this server has no GPUs)")
        if group.count < 0:
            raise ModelConfigError(f"{where}: instance_group count must be >= 0")
    for name in ("sequence_batching", "ensemble_scheduling"):
        if c.HasField(name):
            raise ModelConfigError(f"{where}: {name} is not supported")
    if c.HasField("response_cache") and c.response_cache.enable:
        raise ModelConfigError(f"{where}: response_cache is not supported")
    for name in ("model_warmup", "batch_input", "batch_output"):
        if len(getattr(c, name)):
            raise ModelConfigError(f"{where}: {name} is not supported")
    for key, why in _UNSUPPORTED_PARAMETERS.items():
        if key in c.parameters:
            raise ModelConfigError(f"{where}: parameter {key}: {why}")
    _execute_timeout(c)
    _specs(c)


def _execute_timeout(c: model_config_pb2.ModelConfig) -> float:
    if TIMEOUT_PARAMETER not in c.parameters:
        return DEFAULT_EXECUTE_TIMEOUT_S
    raw = c.parameters[TIMEOUT_PARAMETER].string_value
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or value > 86400:
        raise ModelConfigError(
            f"model '{c.name}': parameter {TIMEOUT_PARAMETER} must be seconds in (0, 86400], got {raw!r}"
        )
    return value


def config_json(config: model_config_pb2.ModelConfig) -> str:
    """The config as Triton gives it to a Python model: proto field names, defaults included,
    int64s as numbers."""
    return json.dumps(config_to_dict(config, defaults=True))


_EXECUTED = object()  # queued once execute() returned for the request's batch


@dataclass(eq=False)
class _Request:
    key: int
    request: InferRequest
    wire: dict
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: Worker | None = None
    finished: bool = False

    def put(self, item: Any) -> None:
        if not self.finished:
            self.queue.put_nowait(item)

    def end(self, item: Any) -> None:
        """Put `item`, the request's last: the worker holds nothing more of the request, so
        nothing is left to cancel there (a cancel would stay in the worker for good)."""
        self.put(item)
        self.finished = True


class PythonModel(ServedModel):
    backend = "python"

    def __init__(self, source: ModelSource):
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(source.config)
        self.name = config.name
        self.version = source.version
        self.source = source
        filename = config.default_model_filename or DEFAULT_MODEL_FILE
        self.model_file = os.path.join(source.version_dir, filename)
        _validate(config)
        if not os.path.isfile(self.model_file):
            raise ModelConfigError(f"model '{self.name}': {self.model_file} does not exist")
        self._set_config(config)
        self._state: ModelState = "LOADING"
        self._reason = "not loaded yet"
        self._workers: list[Worker] = []
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        # The batch each busy worker is executing, and the BLS calls cancelled for want of a
        # request to answer (see the module docstring).
        self._executing: dict[Worker, list[_Request]] = {}
        self._abandoned: set[asyncio.Task] = set()
        self._batcher: DynamicBatcher | None = None
        self._requests: dict[int, _Request] = {}
        self._keys = itertools.count(1)
        self._closing = False

    def _set_config(self, config: model_config_pb2.ModelConfig) -> None:
        self._config = config
        self.max_batch_size = config.max_batch_size
        self.inputs, self.outputs = _specs(config)
        self.decoupled = config.model_transaction_policy.decoupled
        self.execute_timeout_s = _execute_timeout(config)
        self._reshape = {
            t.name: tuple(t.reshape.shape) for t in (*config.input, *config.output) if t.HasField("reshape")
        }

    def config(self) -> model_config_pb2.ModelConfig:
        """The configuration as loaded (after auto_complete_config)."""
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(self._config)
        return config

    def state(self) -> tuple[ModelState, str]:
        return self._state, self._reason

    # ---- lifecycle -----------------------------------------------------------------------------
    def _worker(self, name: str, kind: str) -> Worker:
        args = {
            "model_config": "",  # filled once the config is complete
            "model_instance_kind": kind,
            "model_instance_name": name,
            "model_instance_device_id": "0",
            "model_repository": self.source.directory,
            "model_version": self.version,
            "model_name": self.name,
            "_model_file": self.model_file,
        }
        return Worker(
            model=self.name,
            name=name,
            cwd=self.source.version_dir,
            args=args,
            execute_timeout_s=self.execute_timeout_s,
            initialize_timeout_s=INITIALIZE_TIMEOUT_S,
            on_message=self._on_message,
            on_bls=self._bls,
            on_death=self._on_death,
        )

    def _instance_names(self, config: model_config_pb2.ModelConfig) -> list[str]:
        # Triton's naming: group "<model>_<group index>" unless named; an instance is its
        # group's name when the group has one, "<group>_<i>" otherwise.
        out: list[str] = []
        groups = list(config.instance_group) or [model_config_pb2.ModelInstanceGroup(count=1)]
        for g, group in enumerate(groups):
            name = group.name or f"{self.name}_{g}"
            count = group.count or 1
            out += [name] if count == 1 else [f"{name}_{i}" for i in range(count)]
        return out

    async def load(self) -> None:
        try:
            await self._load()
        except Exception as e:
            self._state, self._reason = "UNAVAILABLE", f"load failed: {e}"
            await self._stop_workers()
            raise
        self._state, self._reason = "READY", ""

    async def _load(self) -> None:
        names = self._instance_names(self._config)
        first = self._worker(names[0], "CPU")
        self._workers.append(first)
        await first.start()
        completed = await first.auto_complete(self.model_file, config_json(self._config))
        config = model_config_pb2.ModelConfig()
        try:
            json_format.Parse(completed, config)
        except json_format.ParseError as e:
            raise ModelConfigError(
                f"model '{self.name}': auto_complete_config gave an invalid config: {e}"
            ) from e
        config.name = self.name
        _validate(config)
        self._set_config(config)
        first.execute_timeout_s = self.execute_timeout_s
        names = self._instance_names(config)
        self._workers += [self._worker(name, "CPU") for name in names[1:]]
        await asyncio.gather(*(w.start() for w in self._workers[1:]))
        text = config_json(config)
        for w in self._workers:
            w.args["model_config"] = text
        await asyncio.gather(*(w.initialize() for w in self._workers))
        for w in self._workers:
            self._idle.put_nowait(w)
        self._batcher = DynamicBatcher.for_config(
            self._run_batch, config, name=self.name, instances=len(self._workers)
        )

    async def close(self) -> None:
        self._closing = True
        self._state, self._reason = "UNAVAILABLE", "unloaded"
        await self._stop_workers()
        if self._batcher is not None:
            await self._batcher.close()
        error = unavailable(f"model '{self.name}' is shutting down")
        for request in list(self._requests.values()):
            request.put(error)

    async def _stop_workers(self) -> None:
        await asyncio.gather(*(w.stop() for w in self._workers), return_exceptions=True)

    # ---- from the workers ---------------------------------------------------------------------
    def _on_message(self, worker: Worker, message: tuple) -> None:
        if message[0] != "send":
            logger.warning("model %s instance %s sent unknown %r", self.name, worker.name, message[0])
            return
        _, key, outputs, error, flags = message
        request = self._requests.get(key)
        if request is None or request.finished:
            return  # finished or abandoned: the model may still send, nobody listens
        final = bool(flags & _FINAL)
        if not final and request.queue.qsize() >= MAX_HELD_RESPONSES:
            request.end(
                KServeError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model '{self.name}' sent {MAX_HELD_RESPONSES} responses its client has not read; "
                    "the request is cancelled",
                )
            )
            worker.cancel(key)
            self._abandon_bls_if_unwanted(worker)
            return
        try:
            item: Any = self._response(request, outputs, error, final)
        except KServeError as e:
            item = e
        if final:
            request.end(item)
        else:
            request.put(item)

    def _on_death(self, worker: Worker, error: KServeError) -> None:
        # Requests whose execute() returned but which still stream from this worker.
        for request in list(self._requests.values()):
            if request.worker is worker:
                request.end(error)

    def _response(
        self, request: _Request, outputs: list | None, error: tuple[str, int] | None, final: bool
    ) -> InferResponse:
        if error is not None:
            message, code = error
            raise KServeError(_TRITON_TO_GRPC.get(code, grpc.StatusCode.UNKNOWN), str(message))
        arrays = {}
        wanted = request.wire["outputs"]
        for name, array in outputs or []:
            if name not in wanted:
                continue  # as Triton: only requested outputs are sent (undeclared ones never are)
            try:
                spec = self.output_spec(name)
            except KeyError:
                raise KServeError(
                    grpc.StatusCode.INTERNAL,
                    f"model '{self.name}' returned output '{name}', which its configuration does not declare",
                ) from None
            array = np.asarray(array)
            try:
                datatype = datatype_of(array)
            except TypeError as e:
                raise KServeError(
                    grpc.StatusCode.INTERNAL, f"model '{self.name}' output '{name}': {e}"
                ) from None
            if datatype != spec.datatype:
                raise KServeError(
                    grpc.StatusCode.INTERNAL,
                    f"model '{self.name}' returned output '{name}' as {datatype}, but its configuration "
                    f"declares {spec.datatype}",
                )
            if name in self._reshape:
                # The model produced the reshape shape; the client is told `dims`.
                lead = array.shape[:1] if self.max_batch_size > 0 else ()
                with contextlib.suppress(ValueError):
                    array = array.reshape(*lead, *spec.dims)
            arrays[name] = array
        return InferResponse(arrays, final=final)

    # ---- inference ----------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if self._batcher is None or self._state != "READY":
            raise unavailable(f"model '{self.name}' is not loaded")
        if self.decoupled and not request.decoupled:
            # Triton's words for ModelInfer (its HTTP infer says "HTTP end point" instead).
            raise unsupported(
                f"ModelInfer RPC doesn't support models with decoupled transaction policy ('{self.name}' is "
                "decoupled: use ModelStreamInfer, generate_stream, or exec(decoupled=True) in BLS)"
            )
        # One batch size across the inputs: checked by ModelRepository.infer (check_batch).
        rows = batch_rows(self.max_batch_size, request.inputs)
        key = next(self._keys)
        inputs = []
        for name, array in request.inputs.items():
            if name in self._reshape:
                lead = array.shape[:1] if self.max_batch_size > 0 else ()
                try:
                    array = array.reshape(*lead, *self._reshape[name])
                except ValueError:
                    raise invalid_argument(
                        f"input '{name}' of shape {list(array.shape)} does not fit the model's reshape "
                        f"{list(self._reshape[name])} for '{self.name}'"
                    ) from None
            inputs.append((name, array))
        pending = _Request(
            key,
            request,
            {
                "key": key,
                "id": request.id,
                "inputs": inputs,
                # Triton: no requested outputs means all of them.
                "outputs": list(request.outputs or [])
                if request.outputs is not None
                else [s.name for s in self.outputs],
                "parameters": json.dumps(request.parameters),
                "model": self.name,
            },
        )
        self._requests[key] = pending
        marker = np.empty(rows, dtype=object)
        marker[0] = pending
        submit = asyncio.create_task(self._submit(pending, marker), name=f"pb-{self.name}-{key}")

        def finish() -> None:
            if not pending.finished:
                pending.finished = True
                if pending.worker is not None:
                    pending.worker.cancel(key)
                    self._abandon_bls_if_unwanted(pending.worker)
            self._requests.pop(key, None)
            submit.cancel()

        responses = Closing(self._responses(pending), finish)
        if self.decoupled:
            return responses
        try:
            first = await responses.__anext__()
        except StopAsyncIteration:
            raise KServeError(grpc.StatusCode.INTERNAL, f"model '{self.name}' sent no response") from None
        finally:
            await aclose(responses)
        return _one(first)

    async def _submit(self, pending: _Request, marker: np.ndarray) -> None:
        try:
            if self._batcher is None:
                raise unavailable(f"model '{self.name}' is not loaded")
            await self._batcher.submit(marker, pending.request.size)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the request's error, for its reader
            pending.end(from_exception(e))
            return
        pending.put(_EXECUTED)

    async def _responses(self, pending: _Request) -> AsyncIterator[InferResponse]:
        executed = False
        while True:
            try:
                async with asyncio.timeout(self.execute_timeout_s if executed else None):
                    item = await pending.queue.get()
            except TimeoutError:
                raise unavailable(
                    f"model '{self.name}': no response for {self.execute_timeout_s:g} s after execute() "
                    f"returned ({TIMEOUT_PARAMETER})"
                ) from None
            if item is _EXECUTED:
                executed = True
                continue
            if isinstance(item, KServeError):
                raise item
            if item.final:
                pending.finished = True
            yield item
            if item.final:
                return

    async def _run_batch(self, marker: np.ndarray) -> np.ndarray:
        """The DynamicBatcher's run, on the event loop (the work happens in a worker process):
        one execute() on a free instance."""
        await self._execute([p for p in marker if p is not None])
        return marker

    async def _execute(self, batch: list[_Request]) -> None:
        worker = await self._idle.get()
        try:
            for pending in batch:
                pending.worker = worker
            self._executing[worker] = batch
            responses, error = await worker.execute([p.wire for p in batch])
        finally:
            self._executing.pop(worker, None)
            self._idle.put_nowait(worker)
        if error is not None:
            failure = KServeError(
                grpc.StatusCode.INTERNAL,
                f"Failed to process the request(s) for model '{worker.name}', message: {error}",
            )
            for pending in batch:
                if self.decoupled:  # its threads may still send for it: they are told it ended
                    pending.put(failure)
                else:
                    pending.end(failure)
            return
        if responses is None:
            return
        for pending, (outputs, response_error) in zip(batch, responses, strict=True):
            try:
                item: Any = self._response(pending, outputs, response_error, True)
            except KServeError as e:
                item = e
            pending.end(item)

    # ---- BLS ----------------------------------------------------------------------------------
    def _abandon_bls_if_unwanted(self, worker: Worker) -> None:
        """Cancel the BLS calls `worker` waits on once every request of its execute() ended."""
        batch = self._executing.get(worker)
        if batch is None or not all(p.finished for p in batch):
            return
        for task in worker.bls_tasks:
            if task not in self._abandoned:
                self._abandoned.add(task)
                task.add_done_callback(self._abandoned.discard)
                task.cancel()

    async def _bls(self, body: dict, reply: Callable[[tuple], Awaitable[None]]) -> None:
        """Run a worker's BLS request on the repository and reply (outputs, error, final) until
        a final reply; every failure becomes an error reply."""
        final_sent = False
        try:
            timeout_s = body["timeout_us"] / 1e6 if body["timeout_us"] > 0 else None
            async with asyncio.timeout(timeout_s):
                model, request = self._bls_request(body)
                # ModelRepository.infer is a coroutine (RepositoryView's annotation says otherwise).
                started: Any = self.source.repository.infer(model, request)
                responses = await started
                try:
                    if body["decoupled"]:
                        async for response in responses:
                            final_sent = response.final
                            await reply((list(response.outputs.items()), None, response.final))
                            if response.final:
                                break
                        if not final_sent:
                            final_sent = True
                            await reply(([], None, True))
                    else:
                        results = [r async for r in responses]
                        if len(results) != 1:
                            raise invalid_argument(
                                f"model '{model.name}' sent {len(results)} responses to a BLS request; "
                                "use exec(decoupled=True)"
                            )
                        final_sent = True
                        await reply((list(results[0].outputs.items()), None, True))
                finally:
                    await aclose(responses)
        except TimeoutError:
            if not final_sent:
                expired = ("Request timeout expired", _GRPC_TO_TRITON[grpc.StatusCode.UNAVAILABLE])
                await reply(([], expired, True))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task not in self._abandoned:
                raise
            task.uncancel()  # ours: the model is told, and the call ends here
            if not final_sent:
                cancelled = (
                    "BLS request cancelled: every request of the execute() that made it has ended",
                    _GRPC_TO_TRITON[grpc.StatusCode.CANCELLED],
                )
                with contextlib.suppress(KServeError):  # the worker is gone: nobody to tell
                    await reply(([], cancelled, True))
        except Exception as e:  # noqa: BLE001 - the model gets the error in its response
            if not final_sent:
                error = from_exception(e)
                await reply(([], (error.message, _GRPC_TO_TRITON.get(error.code, 0)), True))

    def _bls_request(self, body: dict) -> tuple[ServedModel, InferRequest]:
        version = body["model_version"]
        version = "" if version in (-1, None, "") else str(version)
        model = self.source.repository.get_ready(body["model_name"], version)
        names = [name for name, _ in body["inputs"]]
        model.check_required(names)
        inputs = {}
        for name, value in body["inputs"]:
            array = np.asarray(value)
            try:
                datatype = datatype_of(array)
            except TypeError as e:
                raise invalid_argument(f"BLS input '{name}': {e}") from None
            model.check_input(name, datatype, array.shape)
            inputs[name] = array
        try:
            parameters = json.loads(body["parameters"] or "{}")
        except json.JSONDecodeError as e:
            raise invalid_argument(f"BLS request parameters are not JSON: {e}") from None
        if not isinstance(parameters, dict):
            raise invalid_argument("BLS request parameters must be a JSON object")
        request = InferRequest(
            model_name=model.name,
            id=str(body["request_id"]),
            inputs=inputs,
            parameters=custom_parameters(parameters),
            outputs=list(body["outputs"]) or None,
            decoupled=bool(body["decoupled"]),
        )
        return model, request


async def _one(response: InferResponse) -> AsyncIterator[InferResponse]:
    yield response
