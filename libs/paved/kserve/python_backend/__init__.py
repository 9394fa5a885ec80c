"""Triton's Python backend for paved's KServe server: `create(source)` serves a model
directory whose version folder holds a `model.py` defining `TritonPythonModel`.

  served.py                       the ServedModel: config checks, batching, responses, BLS
  worker.py                       one instance's worker process, seen from the server
  stub.py                         the worker process itself (Triton's "stub")
  frames.py                       the messages between them (pickle 5, arrays out of band)
  triton_python_backend_utils.py  what model.py imports as `pb_utils`

This module imports nothing heavy: the worker process imports the package on its way to
stub.py and must start fast, so `create` loads the server side only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paved.kserve.backends import ModelSource
    from paved.kserve.python_backend.served import PythonModel


def create(source: ModelSource) -> PythonModel:
    """The model of `source` (checked, not loaded; ModelConfigError naming the field)."""
    from paved.kserve.python_backend.served import create as create_model

    return create_model(source)
