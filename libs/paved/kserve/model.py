"""A model as the KServe server sees it, and the request and response that reach it.

A `ServedModel` declares its tensors (Triton config semantics: `max_batch_size`, dims without
the batch dimension, optional inputs) and serves `infer`. Transports decode wire tensors into
numpy after `check_input`, so datatype / shape / missing-input errors are the same whether the
request came over gRPC or HTTP. The kinds of models (paved.kserve.llm, paved.kserve.xgboost_model)
build on this module; the repository that holds them (paved.kserve.repository) imports them.

A `ServedModel` is one version of a named model: `version` is its version folder in a Triton
model repository ("1", "2", ... as `version_policy` selects them), "1" for a model that has
only one (an engine's LLM, a lone model directory); the repository (paved.kserve.repository)
holds every version and resolves a request's. Each version keeps its own inference
`statistics` (paved.kserve.statistics), recorded by the repository and the batcher.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.kserve.errors import invalid_argument
from paved.kserve.statistics import ModelStatistics
from paved.kserve.tensors import TensorSpec, config_type

# The version of a model that has only one (an engine's LLM, a lone model directory).
MODEL_VERSION = "1"
ModelState = Literal["READY", "LOADING", "UNAVAILABLE"]

# Request parameters Triton itself interprets (tritonclient refuses to send them as custom
# parameters). paved implements none of the features behind them, so a request that sets
# them gets INVALID_ARGUMENT instead of having its sequence / priority / timeout ignored.
_UNSUPPORTED_RESERVED = {
    "sequence_id": "sequence batching",
    "sequence_start": "sequence batching",
    "sequence_end": "sequence batching",
    "priority": "request priorities",
    "timeout": "per-request queue timeouts",
}
# Consumed by a transport before the model sees the request.
TRANSPORT_PARAMETERS = {"binary_data_output", "triton_enable_empty_final_response", "headers"}


@dataclass
class InferRequest:
    model_name: str
    id: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    # Custom request parameters (transport and reserved ones already removed).
    parameters: dict[str, Any] = field(default_factory=dict)
    # Requested outputs; None: all the model produces.
    outputs: list[str] | None = None
    # True on the decoupled paths (ModelStreamInfer, HTTP generate_stream) that can carry
    # any number of responses per request.
    decoupled: bool = False

    # Bytes its input tensors hold, counted by the transport's decoding (off the event loop
    # for a large request, as the decoding is); None: counted when `size` is read.
    input_bytes: int | None = None

    @property
    def size(self) -> int:
        """Bytes its input tensors hold: a BYTES element counts its length (what a queue bound
        must see of a text input), any other object its pointer."""
        if self.input_bytes is None:
            self.input_bytes = inputs_bytes(self.inputs)
        return self.input_bytes


@dataclass
class InferResponse:
    outputs: dict[str, np.ndarray]
    # Last response of the request (decoupled models send several).
    final: bool = True

    @property
    def size(self) -> int:
        """About what encoding it costs, in bytes (an object element counts as its pointer: a
        BYTES output is at least that long)."""
        return sum(array.nbytes for array in self.outputs.values())


def tensor_bytes(array: np.ndarray) -> int:
    if array.dtype != object:
        return array.nbytes
    try:
        return sum(map(len, array.flat))  # BYTES elements: bytes, at C speed
    except TypeError:
        return sum(len(x) if isinstance(x, bytes | str) else 8 for x in array.flat)


def inputs_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    """What `InferRequest.size` counts; a transport calls it where it decodes the tensors."""
    return sum(tensor_bytes(array) for array in inputs.values())


def custom_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """Request parameters minus those a transport consumed; reserved ones paved does not
    implement are rejected rather than ignored."""
    out = {}
    for key, value in parameters.items():
        if key in TRANSPORT_PARAMETERS:
            continue
        if key in _UNSUPPORTED_RESERVED:
            if key in ("sequence_id", "priority") and not value:
                continue  # the "not set" value some clients send explicitly
            raise invalid_argument(
                f"request parameter '{key}': {_UNSUPPORTED_RESERVED[key]} is not supported by this server"
            )
        if key.startswith("triton_"):
            raise invalid_argument(f"request parameter '{key}' is not supported by this server")
        out[key] = value
    return out


class ServedModel(abc.ABC):
    """One model on the KServe interface."""

    name: str
    # The version folder this model was loaded from ("1", "2", ...); "" only for the stand-in
    # of a model whose config could not be read (paved.kserve.repository.UnavailableModel).
    version: str = MODEL_VERSION
    platform: str = ""
    backend: str = ""
    max_batch_size: int = 0
    inputs: Sequence[TensorSpec] = ()
    outputs: Sequence[TensorSpec] = ()
    # Decoupled models may send zero or many responses per request (Triton's transaction policy).
    decoupled: bool = False

    # ---- state ---------------------------------------------------------------------------
    @abc.abstractmethod
    def state(self) -> tuple[ModelState, str]:
        """(state, reason); reason explains anything but READY."""

    def ready(self) -> bool:
        return self.state()[0] == "READY"

    @property
    def statistics(self) -> ModelStatistics:
        """This version's inference statistics since it was created (made on first use, so
        subclasses need not call an __init__ here)."""
        stats = self.__dict__.get("_statistics")
        if stats is None:
            stats = self.__dict__["_statistics"] = ModelStatistics()
        return stats

    async def load(self) -> None:  # noqa: B027 - optional hook
        """Load the model (default: nothing to load, e.g. the engine owns it)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; in-flight requests may fail."""

    # ---- description ---------------------------------------------------------------------
    def config_parameters(self) -> dict[str, str]:
        return {}

    def config(self) -> model_config_pb2.ModelConfig:
        config = model_config_pb2.ModelConfig(
            name=self.name, platform=self.platform, backend=self.backend, max_batch_size=self.max_batch_size
        )
        for spec in self.inputs:
            config.input.add(
                name=spec.name, data_type=config_type(spec.datatype), dims=spec.dims, optional=spec.optional
            )
        for spec in self.outputs:
            config.output.add(name=spec.name, data_type=config_type(spec.datatype), dims=spec.dims)
        config.model_transaction_policy.decoupled = self.decoupled
        for key, value in self.config_parameters().items():
            config.parameters[key].string_value = value
        return config

    # ---- validation ----------------------------------------------------------------------
    def check_input(self, name: str, datatype: str, shape: Sequence[int]) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                spec.check(self.name, datatype, shape, self.max_batch_size)
                return spec
        raise invalid_argument(f"unexpected inference input '{name}' for model '{self.name}'")

    def check_required(self, names: Iterable[str]) -> None:
        given = list(names)
        if len(given) != len(set(given)):
            # Counted once (a request may name hundreds of thousands of inputs: count() per
            # name was quadratic, minutes of CPU for one request).
            dup = sorted(n for n, k in collections.Counter(given).items() if k > 1)
            raise invalid_argument(f"input(s) {dup} given more than once for model '{self.name}'")
        known = {s.name for s in self.inputs}
        for name in given:
            if name not in known:
                raise invalid_argument(f"unexpected inference input '{name}' for model '{self.name}'")
        missing = [s.name for s in self.inputs if not s.optional and s.name not in given]
        if missing:
            raise invalid_argument(
                f"expected {sum(not s.optional for s in self.inputs)} required input(s) but got "
                f"{len(given)} input(s) for model '{self.name}'. Got input(s) {given}, but missing "
                f"required input(s) {missing}. Please provide all required input(s)."
            )

    def check_batch(self, inputs: Mapping[str, Any]) -> None:
        """Every input of a batched model (max_batch_size > 0) has the same batch size, its
        first dimension: the batcher joins requests input by input, so inputs of different
        sizes would hand one request's rows to another (Triton refuses them alike)."""
        if self.max_batch_size <= 0:
            return
        sizes = {name: int(array.shape[0]) for name, array in inputs.items() if np.ndim(array) > 0}
        if len(set(sizes.values())) > 1:
            first, *rest = sizes.items()
            name, size = next((n, s) for n, s in rest if s != first[1])
            raise invalid_argument(
                f"input '{name}' batch size ({size}) does not match other inputs "
                f"('{first[0]}': {first[1]}) for '{self.name}'"
            )

    def check_outputs(self, names: Iterable[str]) -> None:
        known = {s.name for s in self.outputs}
        for name in names:
            if name not in known:
                raise invalid_argument(f"unexpected inference output '{name}' for model '{self.name}'")

    def output_spec(self, name: str) -> TensorSpec:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    # ---- inference -----------------------------------------------------------------------
    @abc.abstractmethod
    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Admit `request` and return its responses (exactly one unless `decoupled`).

        Request errors raise here, before any response; closing the returned iterator
        cancels the request.
        """


class Ticket(Protocol):
    def release(self) -> None: ...


# Admission control shared with another frontend: (model id, sequences) -> a ticket released
# when the request ends, or EngineOverloadedError (-> UNAVAILABLE / 503).
Admission = Callable[[str, int], Ticket]
