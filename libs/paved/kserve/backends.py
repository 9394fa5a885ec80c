"""Backends of a Triton model repository: which module serves a model directory, and what it is
given to build the model from.

A backend is a module exposing `create(source: ModelSource) -> ServedModel`. The repository
loader (paved.kserve.model_repository) reads a model's config (config.pbtxt or config.json),
picks the module from the config's `backend` (or `platform`), and calls `create` once per
version to load. Invariants callers rely on:
- `create` only builds: it reads the config and checks it (a `ModelConfigError` naming the field
  for anything the backend cannot serve as Triton would); loading weights, starting workers and
  other slow work happen in `ServedModel.load`, which the repository runs in the background.
- A model that calls other models (a Python model's BLS, an ensemble's steps) does it through
  `source.repository`, at request time, never at `create`: the models it names may load later.
- A backend this server does not have is a load failure with the reason in the repository
  index (never a model that answers something else).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tritonclient.grpc import model_config_pb2

from paved.kserve.model import InferRequest, InferResponse, ServedModel

if TYPE_CHECKING:
    from collections.abc import Callable

# Triton's backend names -> the paved module that serves them.
BACKEND_MODULES = {
    "xgboost": "paved.kserve.xgboost_model",
    "python": "paved.kserve.python_backend",
    "pytorch": "paved.kserve.torch_model",
    "onnxruntime": "paved.kserve.onnx_model",
    "ensemble": "paved.kserve.ensemble",
}
# Triton's `platform` values -> the backend that serves them (a config may give either).
PLATFORMS = {
    "pytorch_libtorch": "pytorch",
    "onnxruntime_onnx": "onnxruntime",
    "ensemble": "ensemble",
}


class ModelConfigError(ValueError):
    """The model directory cannot be served as configured (the message names the field)."""


class RepositoryView(Protocol):
    """What a model may use of the repository that serves it (BLS, ensemble steps)."""

    def get_ready(self, name: str, version: str = "") -> ServedModel:
        """The model, ready; raises the transport's NOT_FOUND / UNAVAILABLE error otherwise."""
        ...

    async def infer(self, model: ServedModel, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Run `request` on `model` with the repository's admission and output selection
        (awaited: admission errors raise here; the iterator yields the responses)."""
        ...


@dataclass(frozen=True)
class ModelSource:
    """One version of one model directory, as a backend's `create` receives it."""

    name: str
    version: str  # "1", "2", ...: the version folder's name
    directory: str  # the model's directory (holds config.pbtxt / config.json)
    version_dir: str  # directory/version: the backend's files (model.py, model.pt, ...)
    config: model_config_pb2.ModelConfig  # parsed, name filled in
    repository: RepositoryView


def backend_of(config: model_config_pb2.ModelConfig) -> str:
    """The backend that serves `config` (from `backend`, else `platform`); ModelConfigError when
    neither names one this server has."""
    backend = config.backend or PLATFORMS.get(config.platform, "")
    if not backend:
        raise ModelConfigError(
            f"model '{config.name}': no backend (config.backend) or known platform "
            f"(config.platform {config.platform!r}); known backends: {sorted(BACKEND_MODULES)}"
        )
    named = PLATFORMS.get(config.platform, config.backend)
    if config.backend and config.platform and named != config.backend:
        raise ModelConfigError(
            f"model '{config.name}': backend {config.backend!r} and platform {config.platform!r} disagree"
        )
    if backend not in BACKEND_MODULES:
        raise ModelConfigError(
            f"model '{config.name}': backend {backend!r} is not supported by this server; "
            f"supported: {sorted(BACKEND_MODULES)}"
        )
    return backend


def factory(backend: str) -> Callable[[ModelSource], ServedModel]:
    """The `create` of `backend`'s module; ModelConfigError when the module is not installed."""
    try:
        module = importlib.import_module(BACKEND_MODULES[backend])
    except (KeyError, ImportError) as e:
        raise ModelConfigError(f"backend {backend!r} is not available in this server: {e}") from None
    create = getattr(module, "create", None)
    if create is None:
        raise ModelConfigError(f"backend {backend!r} ({BACKEND_MODULES[backend]}) has no create(source)")
    return create
