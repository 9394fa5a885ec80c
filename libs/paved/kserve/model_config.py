"""Triton model configurations: reading a model directory's config, its versions, its tensors,
and the strict check every backend runs so a config never means something here it would not
mean in Triton.

A model directory (Triton's layout):

    <name>/config.pbtxt      ModelConfig in protobuf text (what Triton reads), or
    <name>/config.json       the same in protobuf JSON (paved's earlier form, still accepted)
    <name>/<version>/...     numeric version folders ("1", "2", ...) with the backend's files

Invariants callers rely on:
- `read_model_config` returns a config whose `name` is set. In a repository the name is the
  directory's (an empty `name` takes it; another name is an error, as in Triton). Both files
  present is accepted only when they parse to the same config (Triton would read only the
  pbtxt and silently ignore the JSON; paved refuses the ambiguity instead).
- `versions_to_load` returns version folder names, ascending by number, never empty (an empty
  selection is a ModelConfigError naming the policy).
- `check_config` raises ModelConfigError naming every field the backend does not implement, and
  the Triton validation rules every backend shares (dims, batching, instance kinds); backends
  call it from `create` so the reason reaches the repository index.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2

from paved.kserve.backends import ModelConfigError
from paved.kserve.tensors import TensorSpec, config_datatype

CONFIG_PBTXT = "config.pbtxt"
CONFIG_JSON = "config.json"
CONFIG_FILES = (CONFIG_PBTXT, CONFIG_JSON)
# A config file larger than this is not a config (refused before parsing).
MAX_CONFIG_BYTES = 4 << 20

# Fields the loader itself handles for every backend (naming, versions, tensors).
COMMON_FIELDS = frozenset(
    {"name", "platform", "backend", "version_policy", "max_batch_size", "input", "output"}
)
# What paved implements inside the sub-messages it accepts; anything else set there fails.
_INPUT_FIELDS = frozenset({"name", "data_type", "format", "dims", "reshape", "optional"})
_OUTPUT_FIELDS = frozenset({"name", "data_type", "dims", "reshape"})
_DYNAMIC_BATCHING_FIELDS = frozenset(
    {"preferred_batch_size", "max_queue_delay_microseconds", "default_queue_policy"}
)
_QUEUE_POLICY_FIELDS = frozenset({"max_queue_size"})
_INSTANCE_GROUP_FIELDS = frozenset({"name", "kind", "count"})
KIND_AUTO = model_config_pb2.ModelInstanceGroup.KIND_AUTO
KIND_CPU = model_config_pb2.ModelInstanceGroup.KIND_CPU
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU


# A model folder without a config is completed from its model file, as Triton's auto-complete
# does for backends whose file says what the model takes (not TorchScript: it does not).
AUTO_COMPLETE_FILES = {"model.onnx": "onnxruntime", "model.py": "python"}


def _backend_from_files(directory: str) -> str | None:
    """The backend the model files of `directory`'s version folders name; None when none
    does; ModelConfigError when they name more than one."""
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            version = os.path.join(directory, entry)
            if entry.isdigit() and os.path.isdir(version):
                found |= {
                    b for f, b in AUTO_COMPLETE_FILES.items() if os.path.isfile(os.path.join(version, f))
                }
    if len(found) > 1:
        raise ModelConfigError(
            f"model '{os.path.basename(os.path.normpath(directory))}': no config, and its version "
            f"folders hold model files of several backends ({', '.join(sorted(found))}): add a "
            f"{CONFIG_PBTXT} naming one"
        )
    return found.pop() if found else None


def find_config(directory: str) -> str | None:
    """The config file of a model directory (config.pbtxt first), or None when it has none."""
    for name in CONFIG_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"cannot read {path}: {e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
    return raw


def parse_config(path: str) -> model_config_pb2.ModelConfig:
    """One config file (by its extension: .pbtxt is protobuf text, .json protobuf JSON)."""
    raw = _read(path)
    config = model_config_pb2.ModelConfig()
    try:
        if path.endswith(".json"):
            json_format.Parse(raw, config)
        else:
            text_format.Parse(raw, config)
    except (json_format.ParseError, text_format.ParseError) as e:
        raise ModelConfigError(f"{path}: {e}") from None
    return config


def read_model_config(directory: str, *, in_repository: bool = True) -> model_config_pb2.ModelConfig:
    """The config of the model directory `directory`, `name` filled in.

    `in_repository`: the directory is a model of a repository, so its name is the directory's
    (Triton's rule); False for a lone model directory (`--model-dir`), whose config names it.
    """
    dirname = os.path.basename(os.path.normpath(directory))
    present = [os.path.join(directory, n) for n in CONFIG_FILES if os.path.isfile(os.path.join(directory, n))]
    if not present:
        backend = _backend_from_files(directory) if in_repository else None
        if backend is None:
            raise ModelConfigError(
                f"model '{dirname}': no {CONFIG_PBTXT} or {CONFIG_JSON} in {directory}, and no model "
                f"file a config is completed from ({', '.join(sorted(AUTO_COMPLETE_FILES))} in a "
                "version folder)"
            )
        # Triton's auto-complete: the backend from the model file's name, the rest from the
        # model (ONNX: its inputs and outputs; Python: its auto_complete_config).
        return model_config_pb2.ModelConfig(name=dirname, backend=backend)
    configs = [parse_config(p) for p in present]
    config = configs[0]
    if len(configs) == 2 and configs[0] != configs[1]:
        raise ModelConfigError(
            f"model '{dirname}': {CONFIG_PBTXT} and {CONFIG_JSON} are both present and differ; "
            f"keep one (Triton reads only {CONFIG_PBTXT})"
        )
    if not config.name:
        config.name = dirname
    elif in_repository and config.name != dirname:
        raise ModelConfigError(
            f"model '{dirname}': the config names the model '{config.name}'; in a model repository "
            "the name must be the directory's (or left out)"
        )
    return config


def _version_folders(directory: str) -> list[int]:
    out = []
    try:
        entries = os.listdir(directory)
    except OSError as e:
        raise ModelConfigError(f"cannot list {directory}: {e}") from None
    for entry in entries:
        # Triton's rule: decimal digits, no leading zero (a "01" folder is skipped, not version 1).
        numeric = entry.isdigit() and entry.isascii() and (entry == "0" or not entry.startswith("0"))
        if numeric and os.path.isdir(os.path.join(directory, entry)):
            out.append(int(entry))
    return sorted(out)


def versions_to_load(directory: str, config: model_config_pb2.ModelConfig) -> list[str]:
    """The version folders `config.version_policy` selects (default: the latest one), ascending.

    Specific versions without a folder are skipped (Triton logs them and loads the rest); a
    policy selecting nothing is a ModelConfigError.
    """
    present = _version_folders(directory)
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        chosen = present
        described = "all"
    elif which == "specific":
        chosen = [v for v in present if v in set(policy.specific.versions)]
        described = f"specific {sorted(policy.specific.versions)}"
    else:
        n = policy.latest.num_versions if which == "latest" else 1
        chosen = present[-n:] if n > 0 else []
        described = f"latest {n}"
    if not chosen:
        raise ModelConfigError(
            f"model '{config.name}': version_policy {described} selects no version; version folders "
            f"present: {[str(v) for v in present] or 'none'}"
        )
    return [str(v) for v in chosen]


# ---- tensors --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigTensorSpec(TensorSpec):
    """A tensor as its config declares it: clients send and receive `dims`; the model sees
    `reshape` when set (Triton's `reshape`), both without the batch dimension."""

    reshape: tuple[int, ...] | None = None

    def to_model(self, array: np.ndarray, max_batch_size: int) -> np.ndarray:
        """A client tensor (checked against `dims`) in the shape the model takes."""
        if self.reshape is None:
            return array
        lead = array.shape[:1] if max_batch_size > 0 else ()
        return array.reshape((*lead, *self.reshape))

    def from_model(self, array: np.ndarray, max_batch_size: int) -> np.ndarray:
        """A model's output (in `reshape`'s shape) in the shape clients are told (`dims`)."""
        if self.reshape is None:
            return array
        lead = array.shape[:1] if max_batch_size > 0 else ()
        return array.reshape((*lead, *self.dims))


def _dims_ok(dims: Sequence[int], *, allow_empty: bool) -> bool:
    return (allow_empty or len(dims) > 0) and all(d == -1 or d >= 1 for d in dims)


def _pieces(shape: Sequence[int]) -> list[int]:
    """Element counts of the runs of fixed dimensions between the variable-size (-1) ones."""
    out = [1]
    for d in shape:
        if d == -1:
            out.append(1)
        else:
            out[-1] *= d
    return out


def _spec(
    tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput, kind: str, model: str
) -> ConfigTensorSpec:
    where = f"model '{model}': {kind} '{tensor.name}'"
    if not tensor.name:
        raise ModelConfigError(f"model '{model}': an {kind} has no name")
    if tensor.data_type == model_config_pb2.TYPE_INVALID:
        raise ModelConfigError(f"{where}: data_type must be set")
    if not _dims_ok(tensor.dims, allow_empty=False):
        raise ModelConfigError(f"{where}: dims {list(tensor.dims)} must be non-empty, each -1 or >= 1")
    reshape = None
    if tensor.HasField("reshape"):
        reshape = tuple(tensor.reshape.shape)
        if not _dims_ok(reshape, allow_empty=True):
            raise ModelConfigError(f"{where}: reshape {list(reshape)} dims must each be -1 or >= 1")
        # Triton's rule: split at the variable-size dimensions, dims and reshape have the same
        # pieces (element counts); else some request could not be reshaped.
        if _pieces(tensor.dims) != _pieces(reshape):
            if -1 not in tensor.dims and -1 not in reshape:
                raise ModelConfigError(
                    f"{where}: reshape {list(reshape)} does not hold the {math.prod(tensor.dims)} "
                    f"elements of dims {list(tensor.dims)}"
                )
            raise ModelConfigError(
                f"{where}: reshape {list(reshape)} does not fit dims {list(tensor.dims)}: split at "
                "their variable-size (-1) dimensions, both must have as many pieces, each holding "
                "the same number of elements"
            )
        if list(tensor.dims).count(-1) > 1:
            raise ModelConfigError(f"{where}: with reshape, dims may have at most one -1")
    datatype = config_datatype(model_config_pb2.DataType.Name(tensor.data_type))
    optional = bool(getattr(tensor, "optional", False))
    return ConfigTensorSpec(tensor.name, datatype, tuple(tensor.dims), optional, reshape)


def specs_from_config(
    config: model_config_pb2.ModelConfig,
) -> tuple[tuple[ConfigTensorSpec, ...], tuple[ConfigTensorSpec, ...]]:
    """(inputs, outputs) as clients see them (dims, optional) with the model-side `reshape`.
    ModelConfigError for a tensor Triton would refuse (no name, no type, bad dims, a reshape
    that cannot hold the dims, a name used twice)."""
    inputs = tuple(_spec(t, "input", config.name) for t in config.input)
    outputs = tuple(_spec(t, "output", config.name) for t in config.output)
    for kind, specs in (("input", inputs), ("output", outputs)):
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ModelConfigError(f"model '{config.name}': {kind} name(s) {dup} declared more than once")
    return inputs, outputs


# ---- strictness ------------------------------------------------------------------------------
def set_fields(message: Message) -> list[str]:
    """Names of the fields `message` sets (non-default scalars, non-empty lists, present messages)."""
    return [fd.name for fd, _ in message.ListFields()]


def _unsupported(message: Message, supported: Collection[str], where: str) -> list[str]:
    return [f"{where}{name}" for name in set_fields(message) if name not in supported]


def check_config(
    config: model_config_pb2.ModelConfig,
    supported: Collection[str],
    *,
    backend: str,
    instance_kinds: Collection[int] = (KIND_AUTO, KIND_CPU),
) -> None:
    """Fail (ModelConfigError) unless `backend` implements everything `config` asks for.

    `supported`: the top-level ModelConfig fields the backend implements beyond COMMON_FIELDS
    (e.g. {"dynamic_batching", "instance_group", "parameters"}); any other set field is named
    in the error. Inside the accepted ones only what paved implements may be set: inputs
    (name, data_type, dims, reshape, optional; format FORMAT_NONE), outputs (name, data_type,
    dims, reshape), dynamic_batching (preferred_batch_size, max_queue_delay_microseconds,
    default_queue_policy.max_queue_size), instance_group (name, count, a kind of
    `instance_kinds`). A `model_transaction_policy` asking for nothing (decoupled false) is
    accepted by every backend. Also checks what Triton checks for every model: max_batch_size
    >= 0, dynamic batching only with max_batch_size > 0, preferred sizes in [1, max_batch_size],
    and the tensors (specs_from_config).
    """
    where = f"model '{config.name}'"
    allowed = COMMON_FIELDS | set(supported)
    bad = [
        name
        for name in set_fields(config)
        if name not in allowed
        and not (name == "model_transaction_policy" and not config.model_transaction_policy.decoupled)
    ]
    for i, tensor in enumerate(config.input):
        bad += _unsupported(tensor, _INPUT_FIELDS, f"input[{i}].")
        if tensor.format != model_config_pb2.ModelInput.FORMAT_NONE:
            bad.append(f"input[{i}].format")
    for i, tensor in enumerate(config.output):
        bad += _unsupported(tensor, _OUTPUT_FIELDS, f"output[{i}].")
    if config.HasField("dynamic_batching") and "dynamic_batching" in allowed:
        db = config.dynamic_batching
        bad += _unsupported(db, _DYNAMIC_BATCHING_FIELDS, "dynamic_batching.")
        bad += _unsupported(
            db.default_queue_policy, _QUEUE_POLICY_FIELDS, "dynamic_batching.default_queue_policy."
        )
    if "instance_group" in allowed:
        group_fields = _INSTANCE_GROUP_FIELDS | ({"gpus"} if KIND_GPU in instance_kinds else set())
        for i, group in enumerate(config.instance_group):
            bad += _unsupported(group, group_fields, f"instance_group[{i}].")
    if bad:
        raise ModelConfigError(
            f"{where}: the {backend} backend of this server does not support {', '.join(sorted(set(bad)))}"
        )
    if config.max_batch_size < 0:
        raise ModelConfigError(f"{where}: max_batch_size must be >= 0")
    # dynamic_batching with max_batch_size 0 is accepted and each request runs alone, as in Triton.
    preferred = config.dynamic_batching.preferred_batch_size if config.HasField("dynamic_batching") else ()
    if any(not 1 <= p <= config.max_batch_size for p in preferred):
        raise ModelConfigError(f"{where}: preferred_batch_size entries must be in [1, max_batch_size]")
    for group in config.instance_group:
        if group.kind not in instance_kinds:
            kinds = ", ".join(model_config_pb2.ModelInstanceGroup.Kind.Name(k) for k in instance_kinds)
            raise ModelConfigError(
                f"{where}: instance_group kind {model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)} "
                f"is not supported by the {backend} backend (supported: {kinds})"
            )
        if group.count < 0:
            raise ModelConfigError(f"{where}: instance_group count must be >= 0")
    specs_from_config(config)


def check_parameters(config: model_config_pb2.ModelConfig, known: Collection[str], *, backend: str) -> None:
    """ModelConfigError naming `parameters` keys the backend does not read (a typo would
    otherwise be ignored silently)."""
    unknown = sorted(set(config.parameters) - set(known))
    if unknown:
        raise ModelConfigError(
            f"model '{config.name}': unknown parameter(s) {unknown} for the {backend} backend; "
            f"known: {sorted(known)}"
        )


def bool_parameter(config: model_config_pb2.ModelConfig, key: str, default: bool) -> bool:
    """A "true"/"false" parameter (Triton's spelling); ModelConfigError for anything else."""
    if key not in config.parameters:
        return default
    value = config.parameters[key].string_value.strip().lower()
    if value not in ("true", "false"):
        raise ModelConfigError(
            f"model '{config.name}': parameter {key} must be 'true' or 'false', got {value!r}"
        )
    return value == "true"


def int_parameter(config: model_config_pb2.ModelConfig, key: str, default: int) -> int:
    """A positive integer parameter (decimal digits, at most 18 of them); ModelConfigError for
    anything else."""
    if key not in config.parameters:
        return default
    value = config.parameters[key].string_value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 18 and int(value) > 0):
        raise ModelConfigError(
            f"model '{config.name}': parameter {key} must be a positive integer, got {value[:40]!r}"
        )
    return int(value)


def instance_count(config: model_config_pb2.ModelConfig) -> int:
    """Execution workers the config asks for: the sum of its instance groups' counts (a group
    without a count is one instance, as in Triton), at least one."""
    return sum(g.count or 1 for g in config.instance_group) or 1


def config_to_dict(config: model_config_pb2.ModelConfig, *, defaults: bool = False) -> dict[str, Any]:
    """ModelConfig as Triton's HTTP /config returns it: proto field names, int64s as numbers;
    with `defaults`, every field (as Triton gives it to a Python model's `initialize`)."""
    out = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=defaults
    )
    return _int64_numbers(out, config.DESCRIPTOR)


def _int64_numbers(value: Any, descriptor) -> Any:
    # protobuf's JSON mapping writes int64 as strings; Triton (and its clients) expect numbers.
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = {F.CPPTYPE_INT64, F.CPPTYPE_UINT64}
    for name, field_value in list(value.items()):
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        if field.cpp_type in wide:
            value[name] = [int(v) for v in field_value] if isinstance(field_value, list) else int(field_value)
        elif field.cpp_type == F.CPPTYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                value_field = sub.fields_by_name["value"]
                if value_field.cpp_type == F.CPPTYPE_MESSAGE:
                    for k, v in field_value.items():
                        field_value[k] = _int64_numbers(v, value_field.message_type)
            elif isinstance(field_value, list):
                value[name] = [_int64_numbers(v, sub) for v in field_value]
            else:
                value[name] = _int64_numbers(field_value, sub)
    return value
