"""paved's `triton_python_backend_utils`: what a Triton Python-backend model imports as `pb_utils`.

The API is Triton's (python_backend's README and its utils module), written anew for paved's
worker process (paved.kserve.python_backend.stub), which registers this module under the name
`triton_python_backend_utils` before it imports a model's `model.py`:

  Tensor                 name + numpy array; as_numpy(), name(), shape(), triton_dtype(),
                         is_cpu(), to_dlpack() / Tensor.from_dlpack(), __dlpack__
  InferenceRequest       a request given to execute() (inputs(), request_id(), parameters() as
                         JSON text, requested_output_names(), get_response_sender(),
                         is_cancelled()), or a BLS request a model builds
                         (InferenceRequest(model_name=..., inputs=[...],
                         requested_output_names=[...]).exec() / async_exec(), decoupled=True
                         for a stream of responses)
  InferenceResponse      output_tensors + optional TritonError
  TritonError            message + code (TritonError.INTERNAL, INVALID_ARG, ...)
  TritonModelException   raised by this module for misuse (and by models, to fail a batch)
  ModelConfig            what auto_complete_config(auto_complete_model_config) receives
  Logger / LogLevel      lines in the server's log, with the model instance's name
  helpers                get_input_tensor_by_name, get_output_tensor_by_name,
                         get_input_config_by_name, get_output_config_by_name,
                         triton_string_to_numpy, triton_to_numpy_type, numpy_to_triton_type,
                         serialize_byte_tensor, deserialize_bytes_tensor,
                         using_decoupled_model_transaction_policy
  flags                  TRITONSERVER_RESPONSE_COMPLETE_FINAL, TRITONSERVER_REQUEST_FLAG_*

Tensors live in the worker's memory (numpy, CPU). Everything that needs the server (sending a
response, a BLS call, a log line, whether a request was cancelled) goes through the worker's
runtime, set by the stub; outside a worker those calls raise TritonModelException.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# Triton's TRITONSERVER_DataType numbering (what model configs' TYPE_* enumerate).
_TYPE_NUMBERS = {
    "TYPE_BOOL": 1,
    "TYPE_UINT8": 2,
    "TYPE_UINT16": 3,
    "TYPE_UINT32": 4,
    "TYPE_UINT64": 5,
    "TYPE_INT8": 6,
    "TYPE_INT16": 7,
    "TYPE_INT32": 8,
    "TYPE_INT64": 9,
    "TYPE_FP16": 10,
    "TYPE_FP32": 11,
    "TYPE_FP64": 12,
    "TYPE_STRING": 13,
}
_NUMPY_OF_TYPE: dict[int, type] = {
    1: np.bool_,
    2: np.uint8,
    3: np.uint16,
    4: np.uint32,
    5: np.uint64,
    6: np.int8,
    7: np.int16,
    8: np.int32,
    9: np.int64,
    10: np.float16,
    11: np.float32,
    12: np.float64,
    13: np.object_,
}
TRITON_STRING_TO_NUMPY = {name: _NUMPY_OF_TYPE[n] for name, n in _TYPE_NUMBERS.items()}


def triton_to_numpy_type(data_type: int) -> Any:
    return _NUMPY_OF_TYPE.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type in (np.object_, np.bytes_) or np.dtype(data_type).kind in "OS":
        return 13
    for number, numpy_type in _NUMPY_OF_TYPE.items():
        if number != 13 and np.dtype(data_type) == np.dtype(numpy_type):
            return number
    return None


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """BYTES elements in C order, each as a 4-byte little-endian length plus its bytes, as a
    flat uint8 array (None for a tensor that is not BYTES)."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.uint8)
    if input_tensor.dtype.kind not in "OS":
        return None
    parts = []
    for item in input_tensor.reshape(-1, order="C"):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += [struct.pack("<I", len(data)), data]
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    raw = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else bytes(encoded_tensor)
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        items.append(raw[offset : offset + size])
        offset += size
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


# ---------------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------------
class TritonError:
    """An error a response carries (not an exception: models put it in InferenceResponse)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL):
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class TritonModelException(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self._message = message

    def message(self) -> str:
        return self._message


# ---------------------------------------------------------------------------------------------
# The worker's side of the server (set by the stub).
# ---------------------------------------------------------------------------------------------
class Runtime(Protocol):
    def send(self, key: int, response: InferenceResponse | None, flags: int) -> None: ...

    def is_cancelled(self, key: int) -> bool: ...

    def bls(self, request: InferenceRequest, decoupled: bool) -> Any:
        """A handle whose `responses()` iterates the BLS responses and `wait_async()` awaits
        the one response of a non-decoupled call."""
        ...

    def log(self, level: int, message: str) -> None: ...


_runtime: Runtime | None = None


def _set_runtime(runtime: Runtime | None) -> None:
    global _runtime
    _runtime = runtime


def _the_runtime() -> Runtime:
    if _runtime is None:
        raise TritonModelException("this call needs the server: it works only inside a model's worker")
    return _runtime


# ---------------------------------------------------------------------------------------------
# Tensors.
# ---------------------------------------------------------------------------------------------
class _Capsule:
    """A bare DLPack capsule offered to numpy (which asks for the __dlpack__ protocol)."""

    def __init__(self, capsule: Any):
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: this backend's tensors are host memory


class Tensor:
    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None):
        array = np.asarray(numpy_array)
        if array.dtype.kind == "U" or array.dtype.kind == "V":
            raise TritonModelException(
                "Tensor dtype used for numpy_array is not supported by the Python backend. "
                "Please use np.object_ instead."
            )
        if array.dtype.kind == "S":
            converted = np.empty(array.shape, dtype=np.object_)
            converted[...] = array
            array = converted
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is None:
                raise TritonModelException(f"unknown triton_dtype {triton_dtype}")
            if array.dtype != np.dtype(wanted):
                array = array.view(wanted)
        number = numpy_to_triton_type(array.dtype)
        if number is None:
            raise TritonModelException(f"tensor '{name}': numpy dtype {array.dtype} has no Triton type")
        self._name = name
        self._array = array
        self._triton_dtype = number

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return self._triton_dtype

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        if self._array.dtype == np.object_:
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors have no DLPack form")
        return self._array.__dlpack__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor over a DLPack capsule or any object with __dlpack__ (torch, numpy, ...).
        Only host memory is accepted: model instances here run on the CPU."""
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        try:
            array = np.from_dlpack(source)
        except (BufferError, RuntimeError, TypeError) as e:
            raise TritonModelException(f"tensor '{name}': cannot take this DLPack tensor: {e}") from e
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


# ---------------------------------------------------------------------------------------------
# Requests and responses.
# ---------------------------------------------------------------------------------------------
class InferenceResponse:
    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict | str | None = None,
    ):
        tensors = [] if output_tensors is None else output_tensors
        if not isinstance(tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException('"error" must be a TritonError or None.')
        self._tensors = tensors
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Sends a request's responses (decoupled models: any number, then the final flag)."""

    def __init__(self, key: int):
        self._key = key
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if response is None and not flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise TritonModelException("a response is needed unless the final flag is set")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException("send() takes an InferenceResponse")
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        _the_runtime().send(self._key, response, flags)

    def is_cancelled(self) -> bool:
        return _the_runtime().is_cancelled(self._key)


class InferenceRequest:
    """A request execute() receives, or a BLS request a model sends to another model."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        *,
        # Required, as in Triton's constructor (a model written here must load there too).
        inputs: list[Tensor],
        requested_output_names: list[str],
        model_name: str,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict | str | None = None,
    ):
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs)
        self._requested_output_names = list(requested_output_names)
        self._model_name = model_name
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout  # microseconds, as Triton's
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, str):
            parameters = json.dumps(parameters)
        self._parameters = parameters
        self._key: int | None = None  # set on requests the server gave to execute()
        self._sender: InferenceResponseSender | None = None

    @classmethod
    def _received(
        cls, key: int, request_id: str, inputs: list[Tensor], outputs: list[str], parameters: str, model: str
    ) -> InferenceRequest:
        request = cls(
            request_id=request_id,
            inputs=inputs,
            requested_output_names=outputs,
            model_name=model,
            parameters=parameters,
        )
        request._key = key
        return request

    # ---- what execute() reads ------------------------------------------------------------
    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def parameters(self) -> str:
        """The request's parameters as JSON text (Triton's form)."""
        return self._parameters

    def flags(self) -> int:
        return self._flags

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def timeout(self) -> int:
        return self._timeout

    def get_response_sender(self) -> InferenceResponseSender:
        if self._key is None:
            raise TritonModelException("only a request given to execute() has a response sender")
        if self._sender is None:
            self._sender = InferenceResponseSender(self._key)
        return self._sender

    def is_cancelled(self) -> bool:
        if self._key is None:
            return False
        return _the_runtime().is_cancelled(self._key)

    # ---- BLS ------------------------------------------------------------------------------
    def _check_bls(self) -> None:
        if not self._model_name:
            raise TritonModelException("a BLS request needs model_name")
        for tensor in self._inputs:
            if not isinstance(tensor, Tensor):
                raise TritonModelException("BLS inputs must be pb_utils.Tensor objects")

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model of the server: its response (errors in it, not
        raised), or with decoupled=True an iterator over its responses."""
        self._check_bls()
        call = _the_runtime().bls(self, decoupled)
        if decoupled:
            return call.responses()
        return next(iter(call.responses()))

    def async_exec(self, decoupled: bool = False) -> Any:
        """An awaitable of exec()'s result (from an `async def execute`)."""
        self._check_bls()
        call = _the_runtime().bls(self, decoupled)
        return call.wait_async(decoupled)


# ---------------------------------------------------------------------------------------------
# Helpers over requests, responses and configs.
# ---------------------------------------------------------------------------------------------
def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("input", []) if c.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("output", []) if c.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The configuration auto_complete_config may complete (Triton's rules: a value the file
    sets must agree with what the model says)."""

    def __init__(self, model_config: str | dict):
        self._config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict:
        return self._config

    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model_transaction_policy has no field(s) {sorted(unknown)}")
        current = self._config.get("model_transaction_policy")
        wanted = bool(transaction_policy_dict.get("decoupled", False))
        if current and "decoupled" in current and bool(current["decoupled"]) != wanted:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._name()}', which is already set to {current['decoupled']}"
            )
        self._config["model_transaction_policy"] = {"decoupled": wanted}

    def add_model_warmup(self, model_warmup: dict) -> None:
        self._config.setdefault("model_warmup", []).append(model_warmup)

    def _add_tensor(self, kind: str, tensor: dict) -> None:
        valid = {"name", "data_type", "dims"} | ({"optional"} if kind == "input" else set())
        name = tensor.get("name")
        unknown = set(tensor) - valid
        if unknown:
            raise ValueError(
                f"{kind} '{name}' in auto-complete-config function for model '{self._name()}' "
                f"contains property other than {sorted(valid)}: {sorted(unknown)}"
            )
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise ValueError(
                    f"{kind} '{name}' in auto-complete-config function for model '{self._name()}' "
                    f"is missing '{required}' property."
                )
        for current in self._config[kind]:
            if current.get("name") != name:
                continue
            declared = current.get("data_type", "TYPE_INVALID")
            if declared != "TYPE_INVALID" and declared != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype "
                    f"{declared} for {kind} '{name}', model provides {tensor['data_type']}"
                )
            dims = [int(d) for d in current.get("dims", [])]
            if dims and dims != [int(d) for d in tensor["dims"]]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{name}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims {dims}"
                )
            current["data_type"] = tensor["data_type"]
            current["dims"] = list(tensor["dims"])
            if "optional" in tensor:
                current["optional"] = tensor["optional"]
            return
        self._config[kind].append(dict(tensor))

    def add_input(self, input: dict) -> None:  # Triton's parameter name
        self._add_tensor("input", input)

    def add_output(self, output: dict) -> None:
        self._add_tensor("output", output)


# ---------------------------------------------------------------------------------------------
# Logging.
# ---------------------------------------------------------------------------------------------
class LogLevel:
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    """Lines in the server's log, tagged with the model instance."""

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        if _runtime is None:  # imported outside a worker (a unit test): plain stderr
            import sys

            print(message, file=sys.stderr)
            return
        _runtime.log(level, str(message))

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)
