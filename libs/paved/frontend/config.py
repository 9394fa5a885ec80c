"""Server configuration: a TOML or JSON file, or command-line flags for a single model.

    [server]                      # all optional
    host = "127.0.0.1"
    port = 8000                   # 0: any free port (the URL is printed)
    max_body_bytes = 33554432
    max_buffered_body_bytes = 134217728   # chunked bodies buffered at once, all requests
    drain_timeout_s = 30

    [[models]]                    # one engine each; several may share the process
    name = "chat"
    path = "/models/llama"        # relative paths are relative to this file
    max_model_len = 4096

    [[models]]
    name = "embed"
    path = "/models/all-MiniLM-L6-v2"
    kind = "embed"

    [[models]]                    # a remote model: Triton (vLLM backend) or paved over KServe v2
    name = "llama"                # the model's name on the remote server
    engine = "kserve://scoring.internal:8001?tokenizer=/models/llama"

    [[models]]                    # a simulated engine (no model runs; paved.engine.sim)
    name = "sim"
    engine = "sim://sim?tokens_per_s=30&max_num_seqs=16&kv_tokens=65536"

Model keys are those of `paved.engine.vllm_config.VllmModelConfig`, or, with `engine`, those
of `RemoteModelConfig` (URI options: `paved.engine.kserve_engine.KServeEngine.from_uri`,
`paved.engine.sim.SimConfig.from_uri`).

KServe v2 beside the OpenAI API, over the same engines, is on when a port is set:

    [server]
    kserve_grpc_port = 8001       # 0: any free port
    kserve_http_port = 8002
    kserve_model_dirs = ["xgb"]   # classic (XGBoost) model directories, KServe only
    kserve_max_message_bytes = 67108864   # larger gRPC messages / HTTP bodies: refused
    kserve_stream_max_in_flight = 1024    # requests one ModelStreamInfer call runs at once
    kserve_stream_queue_size = 256        # responses held for a slow stream client
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paved.engine.vllm_config import VllmModelConfig
from paved.frontend.app import DEFAULT_MAX_BODY_BYTES

_SERVER_KEYS = {
    "host",
    "port",
    "max_body_bytes",
    "max_buffered_body_bytes",
    "drain_timeout_s",
    "kserve_grpc_port",
    "kserve_http_port",
    "kserve_model_dirs",
    "kserve_max_message_bytes",
    "kserve_stream_max_in_flight",
    "kserve_stream_queue_size",
}
# Bounds of the KServe listener's limits (paved.kserve's defaults apply when unset): below
# them nothing useful fits; above, one client could hold unbounded memory.
_KSERVE_LIMITS = {
    "kserve_max_message_bytes": (1024, 2**31 - 1),
    "kserve_stream_max_in_flight": (1, 1 << 20),
    "kserve_stream_queue_size": (1, 1 << 20),
}


@dataclass
class RemoteModelConfig:
    """A model served by a remote KServe v2 server (see paved.engine.kserve_engine), or by the
    simulated engine (`sim://`, see paved.engine.sim)."""

    name: str
    engine: str  # kserve://HOST:PORT[?options] or sim://[MODEL][?options]
    max_queued_sequences: int = 1024

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> RemoteModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"remote model {raw.get('name')!r}: unknown key(s) {unknown}; expected {sorted(known)} "
                "(engine options go in the URI's query)"
            )
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a remote model needs a non-empty 'name' (its name on the remote server)")
        if not isinstance(self.engine, str):
            raise ValueError(f"remote model {self.name!r}: engine must be a kserve:// or sim:// URI")
        if not isinstance(self.max_queued_sequences, int) or self.max_queued_sequences < 1:
            raise ValueError(f"model {self.name!r}: max_queued_sequences must be a positive integer")
        self.make_engine()  # parses the URI: a bad one fails here, not at boot

    def make_engine(self):
        if self.engine.startswith("sim://"):
            from paved.engine.sim import SimEngine

            return SimEngine.from_uri(self.engine, self.name)
        from paved.engine.kserve_engine import KServeEngine

        return KServeEngine.from_uri(self.engine, self.name)


ModelConfig = VllmModelConfig | RemoteModelConfig


def make_engine(model: ModelConfig):
    """The engine for one configured model (vLLM is imported only when needed)."""
    if isinstance(model, RemoteModelConfig):
        return model.make_engine()
    from paved.engine.vllm_engine import VllmEngine

    return VllmEngine(model)


@dataclass
class ServerConfig:
    models: list[ModelConfig] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Chunked request bodies buffered at once, all requests together (then 503); None: 128 MiB,
    # or max_body_bytes if that is larger.
    max_buffered_body_bytes: int | None = None
    # How long a shutdown waits for in-flight requests before cancelling them.
    drain_timeout_s: float = 30.0
    # KServe v2 over the same engines; None: that listener is off.
    kserve_grpc_port: int | None = None
    kserve_http_port: int | None = None
    kserve_model_dirs: list[str] = field(default_factory=list)
    # None: paved.kserve's defaults (64 MiB, 1024, 256).
    kserve_max_message_bytes: int | None = None
    kserve_stream_max_in_flight: int | None = None
    kserve_stream_queue_size: int | None = None

    @property
    def kserve(self) -> bool:
        return self.kserve_grpc_port is not None or self.kserve_http_port is not None

    def validate(self) -> None:
        if not self.models:
            raise ValueError("no models configured")
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {duplicates}")
        for key in ("port", "kserve_grpc_port", "kserve_http_port"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535
            ):
                raise ValueError(f"{key} must be an integer in [0, 65535], got {value!r}")
        fixed = [p for p in (self.port, self.kserve_grpc_port, self.kserve_http_port) if p]
        if len(fixed) != len(set(fixed)):
            raise ValueError(f"the OpenAI and KServe ports must differ, got {fixed}")
        if self.kserve_model_dirs and not self.kserve:
            raise ValueError("kserve_model_dirs needs kserve_grpc_port or kserve_http_port")
        for key, (low, high) in _KSERVE_LIMITS.items():
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
            if not self.kserve:
                raise ValueError(f"{key} needs kserve_grpc_port or kserve_http_port")
        for d in self.kserve_model_dirs:
            if not os.path.isfile(os.path.join(d, "config.json")):
                raise ValueError(f"{d} is not a KServe model directory (no config.json)")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_buffered_body_bytes is not None and (
            isinstance(self.max_buffered_body_bytes, bool)
            or not isinstance(self.max_buffered_body_bytes, int)
            or self.max_buffered_body_bytes < self.max_body_bytes
        ):
            raise ValueError(
                f"max_buffered_body_bytes must be an integer >= max_body_bytes ({self.max_body_bytes}), "
                f"got {self.max_buffered_body_bytes!r}"
            )
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
        models: list[ModelConfig] = [
            RemoteModelConfig.from_mapping(entry)
            if isinstance(entry, Mapping) and "engine" in entry
            else VllmModelConfig.from_mapping(entry, base_dir)
            for entry in entries
        ]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    server = dict(server)
    dirs = server.get("kserve_model_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ValueError(f"{path}: kserve_model_dirs must be a list of directory paths")
    server["kserve_model_dirs"] = [os.path.join(base_dir, d) for d in dirs]
    config = ServerConfig(models=models, **server)
    config.validate()
    return config
