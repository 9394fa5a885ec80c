"""Server configuration: a TOML or JSON file, or command-line flags for a single model.

    [server]                      # all optional
    host = "127.0.0.1"
    port = 8000                   # 0: any free port (the URL is printed)
    max_body_bytes = 33554432
    drain_timeout_s = 30

    [[models]]                    # one engine each; several may share the process
    name = "chat"
    path = "/models/llama"        # relative paths are relative to this file
    max_model_len = 4096

    [[models]]
    name = "embed"
    path = "/models/all-MiniLM-L6-v2"
    kind = "embed"

Model keys are those of `paved.engine.vllm_config.VllmModelConfig`.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paved.engine.vllm_config import VllmModelConfig
from paved.frontend.app import DEFAULT_MAX_BODY_BYTES

_SERVER_KEYS = {"host", "port", "max_body_bytes", "drain_timeout_s"}


@dataclass
class ServerConfig:
    models: list[VllmModelConfig] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How long a shutdown waits for in-flight requests before cancelling them.
    drain_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.models:
            raise ValueError("no models configured")
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {duplicates}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")


def load(path: str) -> ServerConfig:
    """Parse a .toml or .json config file."""
    with open(path, "rb") as f:
        raw: Any = json.load(f) if path.endswith(".json") else tomllib.load(f)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a table/object at the top level")
    unknown = sorted(set(raw) - {"server", "models"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; expected 'server' and 'models'")
    server = raw.get("server", {})
    if not isinstance(server, Mapping) or set(server) - _SERVER_KEYS:
        raise ValueError(f"{path}: [server] accepts only {sorted(_SERVER_KEYS)}")
    entries = raw.get("models", [])
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'models' must be a list of tables/objects")
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        models = [VllmModelConfig.from_mapping(entry, base_dir) for entry in entries]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    config = ServerConfig(models=models, **server)
    config.validate()
    return config
