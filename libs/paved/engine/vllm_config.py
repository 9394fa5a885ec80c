"""Configuration of one in-process vLLM model (no vLLM import: the frontend parses it cheaply)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paved.engine.protocol import ModelKind

_KINDS = ("generate", "embed")


@dataclass(frozen=True)
class VllmModelConfig:
    """One model served by its own AsyncLLM.

    Defaults suit the CPU build on a small machine; everything vLLM accepts that is not a
    named field goes through `engine_args` verbatim (e.g. {"max_num_batched_tokens": 2048}).
    """

    name: str
    path: str
    kind: ModelKind = "generate"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # Enforce in-subset JSON schemas with paved's constraint engine (else xgrammar only).
    paved_constraints: bool = True
    # Frontend admission bound: sequences (n x prompts) admitted but not finished. Beyond
    # it requests get 503 + Retry-After instead of queueing without bound.
    max_queued_sequences: int = 1024
    # Seconds a request may wait for its paved constraint to compile before a 400 (the
    # compile finishes in the background and is cached, so a retry is served at once).
    constraint_compile_budget_s: float = 30.0
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], base_dir: str = ".") -> VllmModelConfig:
        """Build from a config-file entry; relative paths are relative to `base_dir`."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"a model entry must be a table/object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - {"engine"})
        if unknown:
            raise ValueError(f"model entry has unknown key(s) {unknown}; known: {sorted(known)}")
        engine = raw.get("engine", "vllm")
        if engine != "vllm":
            raise ValueError(f"model entry: engine {engine!r} is not supported (only 'vllm')")
        for key in ("name", "path"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise ValueError(f"model entry needs a non-empty string {key!r}")
        values = {k: v for k, v in raw.items() if k in known}
        values["path"] = os.path.join(base_dir, os.path.expanduser(raw["path"]))
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"model {self.name!r}: kind must be one of {_KINDS}, got {self.kind!r}")
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"model {self.name!r}: {self.path} is not a Hugging Face model directory")
        for key in ("max_model_len", "max_num_seqs"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"model {self.name!r}: {key} must be a positive integer")
        if not isinstance(self.max_queued_sequences, int) or self.max_queued_sequences < 1:
            raise ValueError(f"model {self.name!r}: max_queued_sequences must be a positive integer")
        budget = self.constraint_compile_budget_s
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 3600:
            raise ValueError(f"model {self.name!r}: constraint_compile_budget_s must be in (0, 3600] seconds")
        if not isinstance(self.engine_args, Mapping):
            raise ValueError(f"model {self.name!r}: engine_args must be a table/object")
