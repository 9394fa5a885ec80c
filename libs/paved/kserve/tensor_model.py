"""The part the framework backends share (paved.kserve.torch_model, paved.kserve.onnx_model): a
model of named tensors in and named tensors out, dynamically batched like XGBoost.

A subclass loads its runtime (`_load_runtime`, in a thread) and runs one execution
(`_execute`, in one of the batcher's worker threads: one per instance of the config's
`instance_group`). Everything else is here, so both backends read a config and batch alike:
- `create`-time checks: check_config (Triton's rules, unknown fields refused), the backend's
  `parameters`, at least one input and one output; the model file is
  `<version>/<default_model_filename or the backend's default>`.
- Requests go through paved.kserve.batcher.DynamicBatcher. The batcher moves one array of
  rows per request; here each request is an "envelope": an object array of its batch size
  whose first row holds the request's tensors, so a batch is any number of whole requests.
  An execution concatenates the requests whose tensors agree in every dimension but the
  batch one (dtype and shape; requests that differ run as separate executions in the same
  batch, as Triton batches only like-shaped requests), runs the model once per such group and
  hands every request its own rows of every output.
- Inputs reach the model in `reshape`'s shape when the config sets one, outputs go back in
  `dims`; every output is checked against its config (datatype, shape, batch rows) before a
  client sees it: a model that disagrees with its config fails the request with INTERNAL
  naming the tensor, never sends a tensor of another type or shape.
- A failing execution fails only the requests of its group, with the framework's message; a
  request whose own tensors the runtime cannot take (`_prepare`) fails alone.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.batcher import ADAPTIVE_DELAY_PARAMETER, QUEUE_BYTES_PARAMETER, DynamicBatcher
from paved.kserve.errors import KServeError, invalid_argument, unavailable
from paved.kserve.model import InferRequest, InferResponse, ModelState, ServedModel
from paved.kserve.model_config import (
    ConfigTensorSpec,
    check_config,
    check_parameters,
    instance_count,
    specs_from_config,
)
from paved.kserve.tensors import numpy_dtype

logger = logging.getLogger(__name__)

# Top-level config fields every framework backend implements (beyond the common ones).
SUPPORTED_FIELDS = frozenset({"dynamic_batching", "instance_group", "parameters", "default_model_filename"})
# Framework messages are relayed to clients; a pathological one is cut.
_MAX_MESSAGE = 1000


def internal(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.INTERNAL, message)


def int_parameter(config: model_config_pb2.ModelConfig, key: str, *, minimum: int = 0) -> int | None:
    """A non-negative integer parameter (None when absent); ModelConfigError otherwise."""
    if key not in config.parameters:
        return None
    raw = config.parameters[key].string_value.strip()
    if not raw.isdigit() or int(raw) < minimum:
        raise ModelConfigError(
            f"model '{config.name}': parameter {key} must be an integer >= {minimum}, got {raw!r}"
        )
    return int(raw)


@dataclass
class _Envelope:
    """One request's tensors (model-side shapes) travelling through the batcher as its first row."""

    inputs: dict[str, np.ndarray]
    rows: int
    # Set by the execution: the request's outputs (model-side shapes) or what failed it.
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None


class TensorModel(ServedModel):
    """A framework model; subclasses set `backend`, `platform`, `default_file` and implement
    `_load_runtime` and `_execute`."""

    default_file: str = ""

    def __init__(self, source: ModelSource, *, parameters: Collection[str] = (), auto_complete: bool = False):
        """`auto_complete`: a config without inputs and outputs is accepted (the subclass fills
        them in from the model at load, as Triton's auto-complete does)."""
        config = source.config
        check_config(config, SUPPORTED_FIELDS, backend=self.backend)
        check_parameters(
            config, {*parameters, ADAPTIVE_DELAY_PARAMETER, QUEUE_BYTES_PARAMETER}, backend=self.backend
        )
        self.auto_complete = auto_complete and not config.input and not config.output
        if not self.auto_complete and (not config.input or not config.output):
            raise ModelConfigError(
                f"model '{config.name}': the {self.backend} backend needs inputs and outputs"
            )
        self._config = config
        self.name = config.name
        self.version = source.version
        self.max_batch_size = config.max_batch_size
        inputs, outputs = specs_from_config(config)
        self.inputs: tuple[ConfigTensorSpec, ...] = inputs
        self.outputs: tuple[ConfigTensorSpec, ...] = outputs
        for spec in (*inputs, *outputs):
            if spec.datatype == "BF16":  # numpy has no bfloat16, so no tensor of it can be decoded
                raise ModelConfigError(
                    f"model '{self.name}': tensor '{spec.name}': TYPE_BF16 is not supported"
                )
        self.instances = instance_count(config)
        self.model_file = os.path.join(source.version_dir, config.default_model_filename or self.default_file)
        self._state: ModelState = "LOADING"
        self._reason = "not loaded yet"
        self.batcher: DynamicBatcher | None = None

    def model_shape(self, spec: ConfigTensorSpec) -> tuple[int, ...]:
        """The shape the framework sees for `spec`, without the batch dimension."""
        return spec.reshape if spec.reshape is not None else spec.dims

    def _load(self) -> None:
        if not os.path.isfile(self.model_file):
            raise ModelConfigError(f"model file {self.model_file} does not exist")
        self._load_runtime()

    # ---- subclass hooks --------------------------------------------------------------------
    @abc.abstractmethod
    def _load_runtime(self) -> None:
        """Load the model file and check it against the config (ModelConfigError); runs in a thread."""

    def _prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's model-side tensors as the runtime takes them (KServeError when it
        cannot); runs in a batcher worker thread. Default: unchanged."""
        return inputs

    @abc.abstractmethod
    def _execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One execution: model-side input tensors (batch dimension first when batching) ->
        every configured output. Runs in a batcher worker thread."""

    # ---- description -----------------------------------------------------------------------
    def config(self) -> model_config_pb2.ModelConfig:
        """The configuration as loaded (batching, instances and parameters included)."""
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(self._config)
        return config

    # ---- lifecycle -------------------------------------------------------------------------
    def state(self) -> tuple[ModelState, str]:
        return self._state, self._reason

    async def load(self) -> None:
        try:
            await asyncio.to_thread(self._load)
            # Inside: a bad batching parameter is a failed load with its reason, as in Triton.
            self.batcher = DynamicBatcher.for_config(
                self._run, self._config, name=self.name, instances=self.instances
            )
        except Exception as e:
            self._state, self._reason = "UNAVAILABLE", f"load failed: {e}"
            raise
        self._state, self._reason = "READY", ""

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        self._state, self._reason = "UNAVAILABLE", "unloaded"

    # ---- inference -------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if request.parameters:
            raise invalid_argument(
                f"model '{self.name}' takes no request parameters, got {sorted(request.parameters)}"
            )
        if self.batcher is None:
            raise unavailable(f"model '{self.name}' is not loaded")
        inputs = {}
        for spec in self.inputs:
            value = request.inputs.get(spec.name)
            if value is not None:
                inputs[spec.name] = spec.to_model(value, self.max_batch_size)
        rows = len(next(iter(request.inputs.values()))) if self.max_batch_size > 0 and request.inputs else 1
        envelope = _Envelope(inputs, rows)
        carrier = np.empty(rows, dtype=object)
        carrier[0] = envelope
        await self.batcher.submit(carrier, request.size)
        if envelope.error is not None:
            raise envelope.error
        if envelope.outputs is None:  # every envelope of a batch gets outputs or an error
            raise internal(f"model '{self.name}': the execution returned no result")
        outputs = {
            spec.name: spec.from_model(envelope.outputs[spec.name], self.max_batch_size)
            for spec in self.outputs
        }
        return _one(InferResponse(outputs))

    def _run(self, batch: np.ndarray) -> np.ndarray:
        """The batcher's execution: whole envelopes in, the same rows back (results are set on
        the envelopes, which the requests hold)."""
        envelopes: list[_Envelope] = []
        i = 0
        while i < len(batch):
            envelope = batch[i]
            envelopes.append(envelope)
            i += envelope.rows
        group: list[_Envelope] = []
        for envelope in envelopes:
            # Per request, before any joining: a request whose tensors the runtime cannot take
            # fails alone, not with the requests batched beside it.
            try:
                envelope.inputs = self._prepare(envelope.inputs)
            except KServeError as e:
                envelope.error = e
                continue
            if group and _signature(group[0]) != _signature(envelope):
                self._run_group(group)
                group = []
            group.append(envelope)
        if group:
            self._run_group(group)
        return batch

    def _run_group(self, group: list[_Envelope]) -> None:
        try:
            if len(group) == 1:
                inputs = group[0].inputs
            else:
                inputs = {name: np.concatenate([e.inputs[name] for e in group]) for name in group[0].inputs}
            rows = sum(e.rows for e in group)
            try:
                outputs = self._execute(inputs)
            except KServeError:
                raise
            except Exception as e:  # noqa: BLE001 - any framework failure fails its requests, not the server
                # TorchScript puts its interpreter traceback first and the error itself last.
                lines = [line for line in str(e).splitlines() if line.strip()]
                reason = lines[-1].strip() if lines else type(e).__name__
                logger.warning("model %s: %s execution failed: %s", self.name, self.backend, reason)
                raise internal(
                    f"model '{self.name}': {self.backend} execution failed: {reason[:_MAX_MESSAGE]}"
                ) from None
            for spec in self.outputs:
                self._check_output(spec, outputs.get(spec.name), rows)
            offset = 0
            for envelope in group:
                if len(group) == 1:
                    envelope.outputs = outputs
                else:
                    envelope.outputs = {n: v[offset : offset + envelope.rows] for n, v in outputs.items()}
                offset += envelope.rows
        except KServeError as e:
            for envelope in group:
                envelope.error = e

    def _check_output(self, spec: ConfigTensorSpec, value: np.ndarray | None, rows: int) -> None:
        where = f"model '{self.name}': output '{spec.name}'"
        if value is None:
            raise internal(f"{where} was not produced by the model")
        expected = numpy_dtype(spec.datatype, spec.name)
        ok = (
            value.dtype.kind in "OSU"
            if spec.datatype == "BYTES"
            else value.dtype == expected.newbyteorder("=")
        )
        if not ok:
            raise internal(f"{where} is {value.dtype} from the model but the config says {spec.datatype}")
        shape = list(value.shape)
        declared = list(self.model_shape(spec))
        if self.max_batch_size > 0:
            if not shape or shape[0] != rows:
                raise internal(
                    f"{where} has shape {shape} from the model; expected {rows} batch rows first "
                    f"(the batch dimension, max_batch_size {self.max_batch_size})"
                )
            shape = shape[1:]
        if len(shape) != len(declared) or any(
            d != -1 and d != s for d, s in zip(declared, shape, strict=True)
        ):
            raise internal(
                f"{where} has shape {list(value.shape)} from the model, which does not fit its "
                f"config ({'reshape' if spec.reshape is not None else 'dims'} {declared}"
                f"{', plus the batch dimension' if self.max_batch_size > 0 else ''})"
            )


def _signature(envelope: _Envelope) -> tuple:
    return tuple((name, value.dtype.str, value.shape[1:]) for name, value in sorted(envelope.inputs.items()))


async def _one(response: InferResponse) -> AsyncIterator[InferResponse]:
    yield response
