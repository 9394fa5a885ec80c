"""KServe v2 tensors <-> numpy, for the server's transports and the remote engine alike.

Wire facts this module encodes (KServe v2 protocol + Triton's extensions):
  * datatypes are the v2 names (FP32, BYTES, ...); model configs use Triton's TYPE_* names;
  * raw tensor data is little-endian, row-major; a BYTES element is a 4-byte little-endian
    length followed by its bytes;
  * in JSON, BYTES elements are strings and `data` may be nested or flat (row-major);
  * responses carry BYTES as raw contents, never typed `bytes_contents`: tritonclient's
    `as_numpy` cannot decode the typed form under numpy 2.
Every validation failure names the tensor, because that is what a client needs to fix.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paved.engine import text
from paved.kserve.errors import invalid_argument, unsupported

# v2 datatype -> numpy dtype (little-endian). BF16 has no numpy dtype and is rejected.
_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
DATATYPES = (*_NUMPY, "BF16")

# Typed `InferTensorContents` field per datatype (FP16/BF16 exist only as raw contents).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LEN = struct.Struct("<I")


def config_datatype(config_type: str) -> str:
    """Triton config `TYPE_FP32` -> v2 `FP32` (`TYPE_STRING` is v2 `BYTES`)."""
    name = config_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def config_type(datatype: str) -> str:
    """v2 `FP32` -> Triton config `TYPE_FP32`."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def numpy_dtype(datatype: str, tensor: str) -> np.dtype:
    if datatype == "BF16":
        raise unsupported(f"tensor '{tensor}': datatype BF16 is not supported by this server")
    try:
        return _NUMPY[datatype]
    except KeyError:
        raise invalid_argument(f"tensor '{tensor}': unknown datatype {datatype!r}") from None


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype of a numpy array (object / bytes / str arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    for name, dtype in _NUMPY.items():
        if dtype != np.dtype(object) and array.dtype == dtype.newbyteorder("="):
            return name
    raise TypeError(f"no KServe v2 datatype for numpy dtype {array.dtype}")


# No tensor dimension is larger (numpy refuses dimensions past 2**63 - 1, and a product of
# the others can overflow it even when one dimension is 0 and the count is 0).
MAX_DIMENSION = 2**31 - 1


def element_count(shape: Sequence[int], tensor: str) -> int:
    if any(d < 0 for d in shape):
        raise invalid_argument(f"tensor '{tensor}': shape {list(shape)} has a negative dimension")
    if any(d > MAX_DIMENSION for d in shape):
        raise invalid_argument(
            f"tensor '{tensor}': shape {list(shape)} has a dimension larger than {MAX_DIMENSION}"
        )
    # numpy refuses a shape whose non-zero dimensions times the item size pass 2**63 - 1, even
    # with no element at all ([0, 3, 2**31-1, 2**31-1]): refused here, a 400, not its 500.
    if math.prod(d for d in shape if d) > _MAX_EXTENT:
        raise invalid_argument(f"tensor '{tensor}': shape {list(shape)} is too large")
    return math.prod(shape)


# The largest product of a shape's non-zero dimensions: numpy's limit over the widest item (16).
_MAX_EXTENT = (2**63 - 1) // 16


# ---------------------------------------------------------------------------------------------
# BYTES serialization.
# ---------------------------------------------------------------------------------------------
def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, np.bytes_ | bytearray | memoryview):
        return bytes(value)
    return str(value).encode()


def serialize_bytes(array: np.ndarray) -> bytes:
    """Row-major BYTES elements, each as a 4-byte little-endian length plus its bytes."""
    parts = []
    for value in np.asarray(array, dtype=object).ravel(order="C"):
        data = _as_bytes(value)
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int, tensor: str) -> np.ndarray:
    view = memoryview(buffer)
    if 4 * count > len(view):  # refused before the per-element loop, however large `count`
        raise invalid_argument(
            f"tensor '{tensor}': {len(view)} bytes cannot hold {count} BYTES elements "
            "(each has a 4-byte length prefix)"
        )
    values = []
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise invalid_argument(
                f"tensor '{tensor}': BYTES data ends after {i} of {count} elements (truncated length prefix)"
            )
        (size,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + size > len(view):
            raise invalid_argument(
                f"tensor '{tensor}': element {i} claims {size} bytes but the data ends first"
            )
        values.append(bytes(view[offset : offset + size]))
        offset += size
    if offset != len(view):
        raise invalid_argument(
            f"tensor '{tensor}': {len(view) - offset} bytes left over after {count} BYTES elements"
        )
    out = np.empty(count, dtype=object)
    out[:] = values
    return out


# ---------------------------------------------------------------------------------------------
# Decoding request tensors.
# ---------------------------------------------------------------------------------------------
def from_raw(tensor: str, datatype: str, shape: Sequence[int], raw: bytes | memoryview) -> np.ndarray:
    dtype = numpy_dtype(datatype, tensor)
    count = element_count(shape, tensor)
    if datatype == "BYTES":
        return deserialize_bytes(raw, count, tensor).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise invalid_argument(
            f"tensor '{tensor}': {len(raw)} bytes of {datatype} data for shape {list(shape)}, "
            f"expected {expected}"
        )
    # Writable copy: models may normalise inputs in place, and the request buffer is not ours.
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def from_contents(tensor: str, datatype: str, shape: Sequence[int], contents: Any) -> np.ndarray:
    """Decode gRPC typed contents (`InferTensorContents`)."""
    dtype = numpy_dtype(datatype, tensor)
    count = element_count(shape, tensor)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise invalid_argument(f"tensor '{tensor}': {datatype} data must be sent as raw contents")
    for other in set(_CONTENTS_FIELD.values()) - {field}:
        if len(getattr(contents, other)):
            raise invalid_argument(f"tensor '{tensor}': datatype {datatype} but data given in '{other}'")
    values = getattr(contents, field)
    if len(values) != count:
        raise invalid_argument(
            f"tensor '{tensor}': {len(values)} elements of data for shape {list(shape)}, expected {count}"
        )
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        out[:] = list(values)
        return out.reshape(shape)
    return _checked_array(tensor, datatype, list(values), dtype).reshape(shape)


def _flatten(data: Any, out: list) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def from_json(tensor: str, datatype: str, shape: Sequence[int], data: Any) -> np.ndarray:
    """Decode the `data` of an HTTP/JSON input (nested or flat, row-major)."""
    dtype = numpy_dtype(datatype, tensor)
    count = element_count(shape, tensor)
    if datatype == "FP16":
        raise invalid_argument(f"tensor '{tensor}': FP16 data must use the binary tensor extension")
    flat: list = []
    _flatten(data, flat)
    if len(flat) != count:
        raise invalid_argument(
            f"tensor '{tensor}': {len(flat)} elements of data for shape {list(shape)}, expected {count}"
        )
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise invalid_argument(f"tensor '{tensor}': BYTES data in JSON must be strings")
        out = np.empty(count, dtype=object)
        try:
            out[:] = [v.encode() for v in flat]
        except UnicodeEncodeError:
            raise invalid_argument(f"tensor '{tensor}': {text.message('data')}") from None
        return out.reshape(shape)
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise invalid_argument(f"tensor '{tensor}': BOOL data must be true/false")
    elif any(isinstance(v, bool) or not isinstance(v, int | float) for v in flat):
        raise invalid_argument(f"tensor '{tensor}': {datatype} data must be numbers")
    elif dtype.kind in "iu" and any(isinstance(v, float) for v in flat):
        raise invalid_argument(f"tensor '{tensor}': {datatype} data must be integers")
    return _checked_array(tensor, datatype, flat, dtype).reshape(shape)


def _checked_array(tensor: str, datatype: str, values: list, dtype: np.dtype) -> np.ndarray:
    try:
        array = np.array(values, dtype=dtype)
    except (OverflowError, ValueError, TypeError) as e:
        raise invalid_argument(f"tensor '{tensor}': data does not fit {datatype}: {e}") from e
    if dtype.kind in "iu" and values and array.tolist() != values:
        raise invalid_argument(f"tensor '{tensor}': a value is out of range for {datatype}")
    return array


# ---------------------------------------------------------------------------------------------
# Encoding response tensors.
# ---------------------------------------------------------------------------------------------
def to_raw(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes(array)
    return np.ascontiguousarray(array, dtype=_NUMPY[datatype]).tobytes()


def to_json(array: np.ndarray, datatype: str) -> list:
    """Flat, row-major JSON data; BYTES elements must be UTF-8 (else ask for binary output)."""
    flat = np.asarray(array).ravel(order="C")
    if datatype == "BYTES":
        try:
            return [_as_bytes(v).decode() for v in flat]
        except UnicodeDecodeError:
            raise invalid_argument(
                "an output holds bytes that are not UTF-8; request it with binary_data: true"
            ) from None
    if datatype == "FP16":
        return flat.astype(np.float32).tolist()
    return flat.tolist()


# ---------------------------------------------------------------------------------------------
# Tensor specs (a model's declared inputs and outputs).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # v2 name
    dims: tuple[int, ...]  # without the batch dimension; -1 is "any size"
    optional: bool = False

    def full_shape(self, max_batch_size: int) -> list[int]:
        """Shape as model metadata reports it: -1 leads when the model batches."""
        return ([-1] if max_batch_size > 0 else []) + list(self.dims)

    def check(self, model: str, datatype: str, shape: Sequence[int], max_batch_size: int) -> None:
        """Raise INVALID_ARGUMENT (Triton's wording) unless datatype and shape fit this spec."""
        if datatype != self.datatype:
            raise invalid_argument(
                f"inference input '{self.name}' data-type is '{datatype}', but model '{model}' "
                f"expects '{self.datatype}'"
            )
        dims = list(shape)
        if max_batch_size > 0:
            if not dims:
                raise invalid_argument(
                    f"input '{self.name}' for model '{model}' needs a batch dimension; "
                    f"expected shape {self.full_shape(max_batch_size)}, got []"
                )
            if dims[0] < 1 or dims[0] > max_batch_size:
                raise invalid_argument(
                    f"inference request batch-size must be between 1 and {max_batch_size} for "
                    f"'{model}' (input '{self.name}' has batch size {dims[0]})"
                )
            dims = dims[1:]
        if len(dims) != len(self.dims) or any(
            w != -1 and w != d for w, d in zip(self.dims, dims, strict=True)
        ):
            raise invalid_argument(
                f"unexpected shape for input '{self.name}' for model '{model}'. "
                f"Expected {self.full_shape(max_batch_size)}, got {list(shape)}"
            )
