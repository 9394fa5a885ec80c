"""Triton's PyTorch (LibTorch) backend: a TorchScript model on CPU, dynamically batched.

A model directory (backend "pytorch" or platform "pytorch_libtorch"):
  config.pbtxt   inputs, outputs, max_batch_size, dynamic_batching, instance_group, parameters
  <version>/model.pt   a TorchScript module (torch.jit.script / torch.jit.trace, then save);
                 `default_model_filename` names another file.
The module is loaded with torch.jit.load on CPU in `load()` and called from the batcher's
worker threads (one per instance; the instances share the module, which TorchScript allows)
under torch.inference_mode.

TorchScript keeps no tensor names, so the config's names say where a tensor goes, as in
Triton: inputs are named either after the arguments of `forward` (all of them, any order) or
`<name>__<index>` with index the argument's position (`INPUT__0`, `INPUT__1`, ...); outputs
are `<name>__<index>`, index being the position in the tuple `forward` returns (0 for a lone
tensor). An optional input a request leaves out is passed as None (forward must declare it
`Optional[Tensor]`).

Parameters (Triton's names, string values):
  INFERENCE_MODE               "true" (default): torch.inference_mode; "false": torch.no_grad
  DISABLE_OPTIMIZED_EXECUTION  "true": TorchScript's graph optimizer off (per worker thread)
  INTRA_OP_THREAD_COUNT        torch.set_num_threads; torch's pool is process-wide, so the last
                               model to load sets it for all (default: torch's, one per core)
  INTER_OP_THREAD_COUNT        torch.set_num_interop_threads; can be set once per process, so
                               a later model asking for another count fails its load
Not supported (refused at create): TYPE_STRING / TYPE_BF16 / unsigned types above 8 bits,
dictionary inputs, GPU instances, the other Triton parameters (ENABLE_JIT_*, DISABLE_CUDNN,
ENABLE_WEIGHT_SHARING, ENABLE_CACHE_CLEANING: GPU- or executor-specific).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np

from paved.kserve.backends import ModelConfigError, ModelSource
from paved.kserve.model import ServedModel
from paved.kserve.model_config import ConfigTensorSpec, bool_parameter
from paved.kserve.tensor_model import TensorModel, int_parameter, internal

PARAMETERS = frozenset(
    {"INFERENCE_MODE", "DISABLE_OPTIMIZED_EXECUTION", "INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT"}
)
_SUPPORTED_TYPES = frozenset({"BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"})
_INDEXED = re.compile(r"^(.+)__(\d+)$")


def create(source: ModelSource) -> ServedModel:
    return TorchModel(source)


class TorchModel(TensorModel):
    backend = "pytorch"
    platform = "pytorch_libtorch"
    default_file = "model.pt"

    def __init__(self, source: ModelSource):
        super().__init__(source, parameters=PARAMETERS)
        for spec in (*self.inputs, *self.outputs):
            if spec.datatype not in _SUPPORTED_TYPES:
                raise ModelConfigError(
                    f"model '{self.name}': tensor '{spec.name}': {spec.datatype} is not supported by the "
                    f"pytorch backend of this server (supported: {sorted(_SUPPORTED_TYPES)})"
                )
        self._output_index: dict[str, int] = {}
        for spec in self.outputs:
            match = _INDEXED.match(spec.name)
            if match is None:
                raise ModelConfigError(
                    f"model '{self.name}': output '{spec.name}' must be named <name>__<index>, the "
                    "index being its position in what forward returns (e.g. OUTPUT__0)"
                )
            self._output_index[spec.name] = int(match.group(2))
        if len(set(self._output_index.values())) != len(self._output_index):
            raise ModelConfigError(f"model '{self.name}': two outputs name the same index")
        config = source.config
        self.inference_mode = bool_parameter(config, "INFERENCE_MODE", True)
        self.optimized_execution = not bool_parameter(config, "DISABLE_OPTIMIZED_EXECUTION", False)
        self.intra_op_threads = int_parameter(config, "INTRA_OP_THREAD_COUNT", minimum=1)
        self.inter_op_threads = int_parameter(config, "INTER_OP_THREAD_COUNT", minimum=1)
        self._module: Any = None  # a torch.jit.ScriptModule once loaded
        self._input_index: dict[str, int] = {}
        self._arity = 0
        self._thread = threading.local()

    # ---- loading ---------------------------------------------------------------------------
    def _load_runtime(self) -> None:
        import torch

        if self.inter_op_threads is not None and torch.get_num_interop_threads() != self.inter_op_threads:
            try:
                torch.set_num_interop_threads(self.inter_op_threads)
            except RuntimeError:
                raise ModelConfigError(
                    f"INTER_OP_THREAD_COUNT {self.inter_op_threads}: torch's inter-op pool is "
                    f"process-wide and already runs {torch.get_num_interop_threads()} thread(s)"
                ) from None
        if self.intra_op_threads is not None:
            torch.set_num_threads(self.intra_op_threads)
        try:
            module = torch.jit.load(self.model_file, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError / ValueError kinds for bad files
            raise ModelConfigError(f"{self.model_file} is not a TorchScript model: {e}") from None
        module.eval()
        forward = getattr(module, "forward", None)
        schema = getattr(forward, "schema", None)
        if schema is None:
            raise ModelConfigError(f"{self.model_file}: the TorchScript module has no forward method")
        arguments = [a.name for a in schema.arguments[1:]]  # [0] is self
        self._input_index = self._map_inputs(arguments)
        self._arity = max(self._input_index.values()) + 1
        self._module = module

    def _map_inputs(self, arguments: list[str]) -> dict[str, int]:
        names = [s.name for s in self.inputs]
        if all(n in arguments for n in names):
            index = {n: arguments.index(n) for n in names}
        elif all(_INDEXED.match(n) for n in names):
            index = {n: int(_INDEXED.match(n).group(2)) for n in names}  # type: ignore[union-attr]
            if len(set(index.values())) != len(index):
                raise ModelConfigError("two inputs name the same forward argument index")
            late = [n for n, i in index.items() if i >= len(arguments)]
            if late:
                raise ModelConfigError(
                    f"input(s) {late} name argument indexes beyond forward's {len(arguments)} argument(s) "
                    f"{arguments}"
                )
        else:
            raise ModelConfigError(
                f"input names {names} neither match forward's arguments {arguments} nor all follow "
                "<name>__<index> (e.g. INPUT__0)"
            )
        missing = [arguments[i] for i in range(max(index.values()) + 1) if i not in index.values()]
        if missing:
            raise ModelConfigError(f"forward argument(s) {missing} have no input in the config")
        return index

    # ---- execution -------------------------------------------------------------------------
    def _setup_thread(self) -> None:
        import torch

        if getattr(self._thread, "ready", False):
            return
        # The graph executor switch is thread-local in torch, hence once per worker thread.
        torch._C._set_graph_executor_optimize(self.optimized_execution)
        self._thread.ready = True

    def _execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        self._setup_thread()
        args: list[Any] = [None] * self._arity
        for name, value in inputs.items():
            if not value.flags.writeable:  # torch.from_numpy warns on (and may not share) read-only memory
                value = value.copy()
            args[self._input_index[name]] = torch.from_numpy(np.ascontiguousarray(value))
        with torch.inference_mode() if self.inference_mode else torch.no_grad():
            result = self._module(*args)
            produced = list(result) if isinstance(result, tuple | list) else [result]
            outputs = {}
            for spec in self.outputs:
                outputs[spec.name] = self._output(spec, produced)
        return outputs

    def _output(self, spec: ConfigTensorSpec, produced: list[Any]) -> np.ndarray:
        import torch

        index = self._output_index[spec.name]
        if index >= len(produced):
            raise internal(
                f"model '{self.name}': output '{spec.name}' takes element {index} of what forward returns, "
                f"which has {len(produced)}"
            )
        value = produced[index]
        if not isinstance(value, torch.Tensor):
            raise internal(
                f"model '{self.name}': output '{spec.name}': forward returned {type(value).__name__} at "
                f"index {index}, not a tensor"
            )
        return value.detach().cpu().numpy()
