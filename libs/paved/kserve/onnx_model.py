"""Triton's ONNX Runtime backend: an ONNX model on onnxruntime's CPU provider, dynamically batched.

A model directory (backend "onnxruntime" or platform "onnxruntime_onnx"):
  config.pbtxt   inputs, outputs, max_batch_size, dynamic_batching, instance_group, parameters
  <version>/model.onnx   `default_model_filename` names another file.
TensorFlow (and other) models are served here once exported to ONNX (tf2onnx,
torch.onnx.export): paved has no TensorFlow backend.

`load()` opens one onnxruntime.InferenceSession (CPUExecutionProvider) and checks the config
against it, as Triton does: every config input is a model input and every model input is in
the config; every config output is a model output (a subset may be declared); datatypes
agree; with max_batch_size > 0 the model's first dimension is variable (the batch) and the
others fit `dims` (or `reshape`). The instances of `instance_group` are worker threads sharing
that session (onnxruntime runs one session from several threads; Triton opens a session per
instance). BYTES tensors are onnxruntime string tensors (UTF-8).

Parameters (Triton's onnxruntime backend names, string values):
  intra_op_thread_count   threads of the session's intra-op pool (default: onnxruntime's, one per core)
  inter_op_thread_count   threads of the inter-op pool (used with execution_mode 1)
  execution_mode          0 sequential (default), 1 parallel
  enable_mem_arena        "1"/"0" (default 1): onnxruntime's CPU memory arena
  enable_mem_pattern      "1"/"0" (default 1)
The pool's threads do not spin waiting for work (onnxruntime's default does): on a machine
with few cores shared with the server's other work, spinning costs more than it saves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.errors import invalid_argument
from paved.kserve.model import ServedModel
from paved.kserve.model_config import specs_from_config
from paved.kserve.tensor_model import TensorModel, int_parameter
from paved.kserve.tensors import config_type

PARAMETERS = frozenset(
    {
        "intra_op_thread_count",
        "inter_op_thread_count",
        "execution_mode",
        "enable_mem_arena",
        "enable_mem_pattern",
    }
)
# onnxruntime's type strings -> v2 datatypes.
_ORT_TYPES = {
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(float16)": "FP16",
    "tensor(bool)": "BOOL",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(string)": "BYTES",
}


def create(source: ModelSource) -> ServedModel:
    return OnnxModel(source)


def _flag(model: str, key: str, value: int | None, default: bool) -> bool:
    if value is None:
        return default
    if value not in (0, 1):
        raise ModelConfigError(f"model '{model}': parameter {key} must be 0 or 1, got {value}")
    return bool(value)


class OnnxModel(TensorModel):
    backend = "onnxruntime"
    platform = "onnxruntime_onnx"
    default_file = "model.onnx"

    def __init__(self, source: ModelSource):
        super().__init__(source, parameters=PARAMETERS, auto_complete=True)
        config = source.config
        self.intra_op_threads = int_parameter(config, "intra_op_thread_count")
        self.inter_op_threads = int_parameter(config, "inter_op_thread_count")
        self.parallel = _flag(self.name, "execution_mode", int_parameter(config, "execution_mode"), False)
        self.mem_arena = _flag(self.name, "enable_mem_arena", int_parameter(config, "enable_mem_arena"), True)
        self.mem_pattern = _flag(
            self.name, "enable_mem_pattern", int_parameter(config, "enable_mem_pattern"), True
        )
        self._session: Any = None  # an onnxruntime.InferenceSession once loaded
        self._output_names = [s.name for s in self.outputs]
        self._bytes_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}

    # ---- loading ---------------------------------------------------------------------------
    def _load_runtime(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if self.intra_op_threads:
            options.intra_op_num_threads = self.intra_op_threads
        if self.inter_op_threads:
            options.inter_op_num_threads = self.inter_op_threads
        options.execution_mode = (
            ort.ExecutionMode.ORT_PARALLEL if self.parallel else ort.ExecutionMode.ORT_SEQUENTIAL
        )
        options.enable_cpu_mem_arena = self.mem_arena
        options.enable_mem_pattern = self.mem_pattern
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(self.model_file, options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail / InvalidGraph / ... types
            raise ModelConfigError(f"{self.model_file} cannot be loaded by onnxruntime: {e}") from None
        if self.auto_complete:
            self._complete_config(session)
        self._check_against(session)
        self._output_names = [s.name for s in self.outputs]
        self._bytes_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}
        self._session = session

    def _complete_config(self, session: Any) -> None:
        """Inputs and outputs from the model (Triton's auto-complete): every model input and
        output, variable dimensions as -1, the batch dimension dropped when max_batch_size > 0."""
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(self._config)
        for tensors, target in ((session.get_inputs(), config.input), (session.get_outputs(), config.output)):
            for tensor in tensors:
                datatype = _ORT_TYPES.get(tensor.type)
                if datatype is None:
                    raise ModelConfigError(
                        f"'{tensor.name}' of the model is {tensor.type}, which this server cannot serve"
                    )
                shape = [d if isinstance(d, int) and d >= 0 else -1 for d in tensor.shape]
                if self.max_batch_size > 0:
                    if not shape or shape[0] != -1:
                        raise ModelConfigError(
                            f"'{tensor.name}' has shape {list(tensor.shape)} in the model: with "
                            "max_batch_size > 0 its first dimension must be variable (the batch)"
                        )
                    shape = shape[1:]
                target.add(
                    name=tensor.name,
                    data_type=model_config_pb2.DataType.Value(config_type(datatype)),
                    dims=shape,
                )
        self.inputs, self.outputs = specs_from_config(config)
        self._config = config

    def _check_against(self, session: Any) -> None:
        model_inputs = {t.name: t for t in session.get_inputs()}
        model_outputs = {t.name: t for t in session.get_outputs()}
        configured = {s.name for s in self.inputs}
        unknown = sorted(configured - set(model_inputs))
        if unknown:
            raise ModelConfigError(
                f"config input(s) {unknown} are not inputs of the model; it has {sorted(model_inputs)}"
            )
        missing = sorted(set(model_inputs) - configured)
        if missing:
            raise ModelConfigError(f"model input(s) {missing} are not in the config")
        unknown = sorted({s.name for s in self.outputs} - set(model_outputs))
        if unknown:
            raise ModelConfigError(
                f"config output(s) {unknown} are not outputs of the model; it has {sorted(model_outputs)}"
            )
        for kind, specs, tensors in (
            ("input", self.inputs, model_inputs),
            ("output", self.outputs, model_outputs),
        ):
            for spec in specs:
                tensor = tensors[spec.name]
                datatype = _ORT_TYPES.get(tensor.type)
                if datatype != spec.datatype:
                    raise ModelConfigError(
                        f"{kind} '{spec.name}' is {tensor.type} in the model "
                        f"but {spec.datatype} in the config"
                    )
                self._check_shape(kind, spec.name, list(tensor.shape), list(self.model_shape(spec)))

    def _check_shape(self, kind: str, name: str, model: list, declared: list[int]) -> None:
        where = f"{kind} '{name}'"
        if self.max_batch_size > 0:
            if not model or isinstance(model[0], int):
                raise ModelConfigError(
                    f"{where} has shape {model} in the model: with max_batch_size > 0 its first "
                    "dimension must be variable (the batch); use max_batch_size 0 for a fixed shape"
                )
            model = model[1:]
        fits = len(model) == len(declared) and all(
            not isinstance(m, int) or m < 0 or d == -1 or m == d for m, d in zip(model, declared, strict=True)
        )
        if not fits:
            raise ModelConfigError(
                f"{where} has shape {model} in the model (after the batch dimension, if any), "
                f"which does not fit the config's {declared}"
            )

    # ---- execution -------------------------------------------------------------------------
    def _prepare(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: _strings(n, v) if n in self._bytes_inputs else v for n, v in inputs.items()}

    def _execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        produced = self._session.run(self._output_names, inputs)
        return dict(zip(self._output_names, produced, strict=True))


def _strings(name: str, value: np.ndarray) -> np.ndarray:
    """BYTES elements as the str onnxruntime's string tensors hold."""
    out = np.empty(value.shape, dtype=object)
    try:
        out.ravel()[:] = [v.decode() if isinstance(v, bytes) else str(v) for v in value.ravel()]
    except UnicodeDecodeError:
        raise invalid_argument(f"input '{name}': the onnxruntime backend takes BYTES as UTF-8 text") from None
    return out
