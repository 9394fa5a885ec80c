"""A classic model on the KServe interface: XGBoost on CPU, dynamically batched.

A model directory holds
  config.json  Triton's ModelConfig in its protobuf-JSON form (what `ModelConfig` returns), e.g.
                 {"name": "iris", "backend": "xgboost", "max_batch_size": 64,
                  "input":  [{"name": "input__0",  "data_type": "TYPE_FP32", "dims": [4]}],
                  "output": [{"name": "output__0", "data_type": "TYPE_FP32", "dims": [3]}],
                  "dynamic_batching": {"max_queue_delay_microseconds": 200,
                                       "preferred_batch_size": [32, 64]},
                  "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
                  "parameters": {"predict_type": {"string_value": "value"}}}
  model.ubj    the booster (any format xgboost.Booster loads; `default_model_filename` names
               another file).
One FP32 input of shape [batch, features] and one FP32 output [batch, *dims] with the booster's
scores: predict_type "value" (transformed, e.g. class probabilities) or "margin" (raw).
Without `dynamic_batching` each request is its own predict call (Triton's default scheduler).
Parsing is strict (unknown config fields and unsupported features fail the load with the
reason in RepositoryIndex), so a config never means something here it would not mean in Triton.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from paved.kserve.batcher import DynamicBatcher
from paved.kserve.errors import invalid_argument, unavailable
from paved.kserve.repository import InferRequest, InferResponse, ModelState, ServedModel
from paved.kserve.tensors import TensorSpec, config_datatype

CONFIG_FILE = "config.json"
DEFAULT_MODEL_FILE = "model.ubj"
_PREDICT_TYPES = ("value", "margin")
_PARAMETERS = {"predict_type", "nthread"}


class ModelConfigError(ValueError):
    """The model directory cannot be served as configured."""


def read_config(directory: str) -> model_config_pb2.ModelConfig:
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path) as f:
            raw = f.read()
    except OSError as e:
        raise ModelConfigError(f"cannot read {path}: {e}") from e
    config = model_config_pb2.ModelConfig()
    try:
        json_format.Parse(raw, config)
    except json_format.ParseError as e:
        raise ModelConfigError(f"{path}: {e}") from e
    if not config.name:
        config.name = os.path.basename(os.path.normpath(directory))
    return config


class XGBoostModel(ServedModel):
    backend = "xgboost"

    def __init__(self, directory: str, config: model_config_pb2.ModelConfig):
        self.directory = directory
        self._config = config
        self.name = config.name
        self.max_batch_size = config.max_batch_size
        self._validate_config(config)
        (inp,) = config.input
        (out,) = config.output
        self.inputs = (
            TensorSpec(
                inp.name, config_datatype(model_config_pb2.DataType.Name(inp.data_type)), tuple(inp.dims)
            ),
        )
        self.outputs = (
            TensorSpec(
                out.name, config_datatype(model_config_pb2.DataType.Name(out.data_type)), tuple(out.dims)
            ),
        )
        params = {k: v.string_value for k, v in config.parameters.items()}
        self.predict_type = params.get("predict_type", "value")
        self.nthread = int(params.get("nthread", "0"))
        self.model_file = os.path.join(directory, config.default_model_filename or DEFAULT_MODEL_FILE)
        self._state: ModelState = "LOADING"
        self._reason = "not loaded yet"
        self._booster: Any = None  # an xgboost.Booster once loaded (xgboost ships no types)
        self.batcher: DynamicBatcher | None = None

    @classmethod
    def from_directory(cls, directory: str) -> XGBoostModel:
        return cls(directory, read_config(directory))

    def _validate_config(self, c: model_config_pb2.ModelConfig) -> None:
        where = f"model '{c.name}'"
        if c.backend != "xgboost":
            raise ModelConfigError(f"{where}: backend must be 'xgboost', got {c.backend!r}")
        if c.platform:
            raise ModelConfigError(f"{where}: 'platform' is not used by the xgboost backend")
        if c.max_batch_size < 0:
            raise ModelConfigError(f"{where}: max_batch_size must be >= 0")
        if len(c.input) != 1 or len(c.output) != 1:
            raise ModelConfigError(f"{where}: needs exactly one input and one output")
        (inp,), (out,) = c.input, c.output
        for tensor, kind in ((inp, "input"), (out, "output")):
            if tensor.data_type != model_config_pb2.TYPE_FP32:
                raise ModelConfigError(f"{where}: {kind} '{tensor.name}' must be TYPE_FP32")
            if tensor.HasField("reshape"):
                raise ModelConfigError(f"{where}: {kind} '{tensor.name}': reshape is not supported")
        feature_dims = list(inp.dims) if c.max_batch_size > 0 else list(inp.dims)[1:]
        if len(feature_dims) != 1 or feature_dims[0] < 1 or (c.max_batch_size == 0 and len(inp.dims) != 2):
            raise ModelConfigError(
                f"{where}: input '{inp.name}' dims must be [features] "
                "(or [-1, features] with max_batch_size 0)"
            )
        if inp.optional:
            raise ModelConfigError(f"{where}: the input cannot be optional")
        if c.HasField("dynamic_batching"):
            if c.max_batch_size == 0:
                raise ModelConfigError(f"{where}: dynamic_batching needs max_batch_size > 0")
            db = c.dynamic_batching
            if db.priority_levels or db.priority_queue_policy or db.preserve_ordering:
                raise ModelConfigError(f"{where}: priority levels and preserve_ordering are not supported")
            policy = db.default_queue_policy
            if policy.default_timeout_microseconds or policy.allow_timeout_override or policy.timeout_action:
                raise ModelConfigError(f"{where}: queue timeouts are not supported (max_queue_size is)")
            if any(not 1 <= p <= c.max_batch_size for p in db.preferred_batch_size):
                raise ModelConfigError(
                    f"{where}: preferred_batch_size entries must be in [1, max_batch_size]"
                )
        for group in c.instance_group:
            if group.kind not in (
                model_config_pb2.ModelInstanceGroup.KIND_AUTO,
                model_config_pb2.ModelInstanceGroup.KIND_CPU,
            ):
                raise ModelConfigError(f"{where}: only KIND_CPU instances are supported")
        unknown = sorted(set(c.parameters) - _PARAMETERS)
        if unknown:
            raise ModelConfigError(f"{where}: unknown parameter(s) {unknown}; known: {sorted(_PARAMETERS)}")
        predict_type = (
            c.parameters["predict_type"].string_value if "predict_type" in c.parameters else "value"
        )
        if predict_type not in _PREDICT_TYPES:
            raise ModelConfigError(f"{where}: predict_type must be one of {_PREDICT_TYPES}")
        if "nthread" in c.parameters and not c.parameters["nthread"].string_value.isdigit():
            raise ModelConfigError(f"{where}: nthread must be a non-negative integer")
        for name in ("sequence_batching", "ensemble_scheduling", "response_cache"):
            if c.HasField(name):
                raise ModelConfigError(f"{where}: {name} is not supported")
        for name in ("model_warmup", "batch_input", "batch_output"):
            if len(getattr(c, name)):
                raise ModelConfigError(f"{where}: {name} is not supported")

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
            self._booster = await asyncio.to_thread(self._load_booster)
        except Exception as e:
            self._state, self._reason = "UNAVAILABLE", f"load failed: {e}"
            raise
        c = self._config
        instances = sum(g.count or 1 for g in c.instance_group) or 1
        if c.HasField("dynamic_batching"):
            db = c.dynamic_batching
            self.batcher = DynamicBatcher(
                self._predict,
                name=self.name,
                max_batch_size=c.max_batch_size,
                max_queue_delay_s=db.max_queue_delay_microseconds / 1e6,
                preferred_batch_sizes=list(db.preferred_batch_size),
                max_queue_size=db.default_queue_policy.max_queue_size,
                instances=instances,
            )
        else:
            self.batcher = DynamicBatcher(
                self._predict,
                name=self.name,
                max_batch_size=max(c.max_batch_size, 1),
                instances=instances,
                coalesce=False,
            )
        self._state, self._reason = "READY", ""

    def _load_booster(self) -> Any:
        import xgboost

        if not os.path.isfile(self.model_file):
            raise ModelConfigError(f"model file {self.model_file} does not exist")
        booster = xgboost.Booster(model_file=self.model_file)
        if self.nthread:
            booster.set_param({"nthread": self.nthread})
        features = self.inputs[0].dims[-1]
        if booster.num_features() != features:
            raise ModelConfigError(
                f"input '{self.inputs[0].name}' has {features} features but the booster expects "
                f"{booster.num_features()}"
            )
        # Prove the configured output shape now rather than on the first request.
        probe = booster.inplace_predict(np.zeros((2, features), np.float32), predict_type=self.predict_type)
        self._check_output(np.asarray(probe), 2)
        return booster

    def _check_output(self, prediction: np.ndarray, rows: int) -> tuple[int, ...]:
        dims = list(self.outputs[0].dims)
        if self.max_batch_size == 0:
            dims = dims[1:]
        width = int(np.prod(prediction.shape[1:])) if prediction.ndim > 1 else 1
        known = int(np.prod([d for d in dims if d != -1])) if dims else 1
        if -1 not in dims and width != known:
            raise ModelConfigError(
                f"output '{self.outputs[0].name}' dims {list(self.outputs[0].dims)} do not fit the booster's "
                f"{width} score(s) per row"
            )
        return (rows, *[width // known if d == -1 else d for d in dims])

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        self._state, self._reason = "UNAVAILABLE", "unloaded"

    # ---- inference -------------------------------------------------------------------------
    def _predict(self, batch: np.ndarray) -> np.ndarray:
        prediction = np.asarray(
            self._booster.inplace_predict(batch, predict_type=self.predict_type), np.float32
        )
        return prediction.reshape(self._check_output(prediction, len(batch)))

    async def infer(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        if request.parameters:
            raise invalid_argument(
                f"model '{self.name}' takes no request parameters, got {sorted(request.parameters)}"
            )
        if self.batcher is None:
            raise unavailable(f"model '{self.name}' is not loaded")
        scores = await self.batcher.submit(request.inputs[self.inputs[0].name])
        return _one(InferResponse({self.outputs[0].name: scores}))


async def _one(response: InferResponse) -> AsyncIterator[InferResponse]:
    yield response
