"""A classic model on the KServe interface: XGBoost on CPU, dynamically batched.

Two layouts hold one (configs in protobuf text `config.pbtxt` or protobuf JSON `config.json`,
read by paved.kserve.model_config):
  * a model of a Triton model repository: `<name>/config.pbtxt` and `<name>/<version>/model.ubj`
    (the repository loader calls `create(source)` once per version);
  * a lone model directory (`--model-dir`): its config and `model.ubj` side by side (or, with
    no model file beside the config, the latest version folder's), named by the config.
A config, e.g. (config.json form; the pbtxt form has the same fields):
                 {"name": "iris", "backend": "xgboost", "max_batch_size": 64,
                  "input":  [{"name": "input__0",  "data_type": "TYPE_FP32", "dims": [4]}],
                  "output": [{"name": "output__0", "data_type": "TYPE_FP32", "dims": [3]}],
                  "dynamic_batching": {"max_queue_delay_microseconds": 200,
                                       "preferred_batch_size": [32, 64]},
                  "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
                  "parameters": {"predict_type": {"string_value": "value"}}}
`model.ubj` is the booster (any format xgboost.Booster loads; `default_model_filename` names
another file). One FP32 input of shape [batch, features] and one FP32 output [batch, *dims]
with the booster's scores: predict_type "value" (transformed, e.g. class probabilities) or
"margin" (raw). Without `dynamic_batching` each request is its own predict call (Triton's
default scheduler); `instance_group` counts are summed into that many predict workers.
Parsing is strict (unknown config fields and unsupported features fail the load with the
reason in RepositoryIndex), so a config never means something here it would not mean in Triton.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.kserve.backends import ModelConfigError as ModelConfigError
from paved.kserve.backends import ModelSource
from paved.kserve.batcher import ADAPTIVE_DELAY_PARAMETER, QUEUE_BYTES_PARAMETER, DynamicBatcher
from paved.kserve.errors import invalid_argument, unavailable
from paved.kserve.model_config import (
    check_config,
    check_parameters,
    instance_count,
    read_model_config,
    specs_from_config,
    versions_to_load,
)
from paved.kserve.repository import InferRequest, InferResponse, ModelState, ServedModel

DEFAULT_MODEL_FILE = "model.ubj"
_PREDICT_TYPES = ("value", "margin")
_PARAMETERS = {"predict_type", "nthread", ADAPTIVE_DELAY_PARAMETER, QUEUE_BYTES_PARAMETER}
# The ModelConfig fields this backend implements beyond the loader's own (model_config.COMMON_FIELDS).
SUPPORTED_FIELDS = frozenset({"dynamic_batching", "instance_group", "parameters", "default_model_filename"})


def create(source: ModelSource) -> XGBoostModel:
    """The backend entry point (paved.kserve.backends): one version of a repository's model."""
    return XGBoostModel(source.version_dir, source.config, version=source.version)


class XGBoostModel(ServedModel):
    backend = "xgboost"

    def __init__(self, directory: str, config: model_config_pb2.ModelConfig, *, version: str = "1"):
        """`directory` holds the booster file; `config` is the parsed config, name set."""
        self.directory = directory
        self._config = config
        self.name = config.name
        self.version = version
        self.max_batch_size = config.max_batch_size
        self._validate_config(config)
        self.inputs, self.outputs = specs_from_config(config)
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
        """A lone model directory: its config names the model; the booster lies beside the
        config, or when it does not, in the latest version folder `version_policy` selects."""
        config = read_model_config(directory, in_repository=False)
        filename = config.default_model_filename or DEFAULT_MODEL_FILE
        if os.path.isfile(os.path.join(directory, filename)):
            return cls(directory, config)
        version = versions_to_load(directory, config)[-1]
        return cls(os.path.join(directory, version), config, version=version)

    def _validate_config(self, c: model_config_pb2.ModelConfig) -> None:
        where = f"model '{c.name}'"
        if c.backend != "xgboost":
            raise ModelConfigError(f"{where}: backend must be 'xgboost', got {c.backend!r}")
        if c.platform:
            raise ModelConfigError(f"{where}: 'platform' is not used by the xgboost backend")
        check_config(c, SUPPORTED_FIELDS, backend="xgboost")
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
        check_parameters(c, _PARAMETERS, backend="xgboost")
        predict_type = (
            c.parameters["predict_type"].string_value if "predict_type" in c.parameters else "value"
        )
        if predict_type not in _PREDICT_TYPES:
            raise ModelConfigError(f"{where}: predict_type must be one of {_PREDICT_TYPES}")
        if "nthread" in c.parameters and not c.parameters["nthread"].string_value.isdigit():
            raise ModelConfigError(f"{where}: nthread must be a non-negative integer")

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
            # Inside: a bad batching parameter is a failed load with its reason, as in Triton.
            self.batcher = DynamicBatcher.for_config(
                self._predict, self._config, name=self.name, instances=instance_count(self._config)
            )
        except Exception as e:
            self._state, self._reason = "UNAVAILABLE", f"load failed: {e}"
            raise
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
