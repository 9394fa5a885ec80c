"""The model package: a directory or tarball whose `model.json` names everything a start needs.

    {
      "schema_version": 1,
      "model_id": "tiny", "version": "1", "mode": "embedded",
      "engine_args": {"max_model_len": 512, "dtype": "float32"},
      "weights":   {"uri": "weights",   "files": [{"path": "model.safetensors", "sha256": "..", "size": 1}]},
      "tokenizer": {"uri": "tokenizer", "files": [{"path": "tokenizer.json", "sha256": "..", "size": 1}]},
      "plugins":   [{"uri": "plugins/my_plugin-0.1-py3-none-any.whl", "sha256": "..", "size": 1}]
    }

An artifact `uri` is relative to the package root (a folder of the package directory, prefix or
tarball) or absolute (`s3://bucket/prefix`, `/abs/dir`, `file:///abs/dir`): a package may point
at weights stored elsewhere. Each artifact file is fetched from `<uri>/<path>`. The weights and
tokenizer files are laid out side by side in one Hugging Face model directory, so their paths
must not collide. Every file carries its sha256 and size: S3 keeps no whole-object sha256 for
multipart uploads and ranged GETs carry no checksum, so this manifest is what verification
trusts.

Modes: "embedded" starts the paved frontend with the engine in-process; "standalone" starts
the engine alone (vLLM's own OpenAI server), for a frontend that reaches it remotely; "kserve"
serves classic models over KServe v2 gRPC and HTTP through paved.kserve, and has no tokenizer.
Its weights are either one model directory (a Triton config, `config.json` or `config.pbtxt`,
at the top, whose `name` is the package's model_id, and the model file; `--model-dir`) or a
whole Triton model repository (`<model>/config.pbtxt` and `<model>/<version>/...` per model;
`--model-repository`), in which case model_id must be one of its models: the one the control
plane probes (`kserve_layout`); the control plane routes every one of them (`kserve_models`).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from paved.images.lock import engine_override_error

MODEL_JSON = "model.json"
SCHEMA_VERSION: Final = 1
_SHA256 = r"^[0-9a-f]{64}$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# A Triton model config, in either form paved.kserve reads.
KSERVE_CONFIGS = ("config.pbtxt", "config.json")
# A repository's model folder without a config is served by paved.kserve when a version folder
# holds one of these (its model_config.AUTO_COMPLETE_FILES, Triton's auto-complete), so it is
# one of the package's models too.
KSERVE_AUTO_COMPLETE_FILES = ("model.onnx", "model.py")
# Version folders paved.kserve (as Triton) loads: decimal, no leading zero.
_KSERVE_VERSION = re.compile(r"^(0|[1-9][0-9]*)$")


class PackageError(ValueError):
    """The package is malformed: its model.json does not validate or names unsafe paths."""


def _safe_relpath(path: str, what: str) -> str:
    if not path or "\\" in path or "\0" in path:
        raise ValueError(f"{what} {path!r} must be a non-empty POSIX relative path")
    norm = posixpath.normpath(path)
    if posixpath.isabs(path) or norm != path or norm == "." or norm.split("/")[0] == "..":
        raise ValueError(f"{what} {path!r} must be a normalized relative path inside the package")
    return path


# 1 TiB: far past any model file (shards are tens of GB), and small enough that a download's
# part list (one task per part, 64 MiB by default) stays bounded; a manifest naming more is
# refused at validation, before anything allocates.
MAX_FILE_SIZE = 1 << 40


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    sha256: str = Field(pattern=_SHA256)
    size: int = Field(ge=0, le=MAX_FILE_SIZE)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _safe_relpath(v, "file path")


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(min_length=1)
    files: tuple[FileEntry, ...] = Field(min_length=1)

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if is_absolute_uri(v):
            return v.rstrip("/") if v not in ("/", "s3://") else v
        return _safe_relpath(v.rstrip("/"), "artifact uri")


class PluginWheel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(min_length=1)
    sha256: str = Field(pattern=_SHA256)
    size: int = Field(ge=0, le=MAX_FILE_SIZE)

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not v.endswith(".whl"):
            raise ValueError(f"plugin uri {v!r} must name a .whl file")
        return v if is_absolute_uri(v) else _safe_relpath(v, "plugin uri")

    @property
    def filename(self) -> str:
        return posixpath.basename(self.uri)


RESERVED_ENGINE_ARGS = frozenset(
    {"host", "port", "uds", "model", "served_model_name", "api_key", "root_path"}
)


class ModelPackage(BaseModel):
    """The validated model.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    model_id: str = Field(pattern=_NAME)
    version: str = Field(pattern=_NAME)
    mode: Literal["embedded", "standalone", "kserve"] = "embedded"
    # Passed to the engine verbatim (vLLM engine arguments: max_model_len, dtype, ...).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    weights: Artifact
    tokenizer: Artifact | None = None  # required, except for mode "kserve"
    plugins: tuple[PluginWheel, ...] = ()

    @field_validator("engine_args")
    @classmethod
    def _engine_args_leave_paved_its_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        # These the launcher sets itself (where the engine listens, what it serves, who may
        # call it): {"host": "0.0.0.0"} once exposed the engine past the launcher's gate, and
        # {"port": ...} made a replica that is never ready. Refused here, with a reason, though
        # the launcher's own flags also come last (argparse keeps the last).
        taken = sorted(k for k in value if k.replace("-", "_") in RESERVED_ENGINE_ARGS)
        if taken:
            raise ValueError(f"engine_args {taken} are set by paved itself and may not be given")
        return value

    @model_validator(mode="after")
    def _layout(self) -> ModelPackage:
        if self.mode == "kserve":
            if self.tokenizer is not None:
                raise ValueError("a kserve package has no tokenizer")
            if self.plugins:
                raise ValueError("a kserve package takes no plugins (they extend vLLM)")
        elif self.tokenizer is None:
            raise ValueError(f"mode {self.mode!r} needs a tokenizer (only a kserve package has none)")
        seen: dict[str, str] = {}
        for role, artifact in self._artifacts():
            for f in artifact.files:
                key = f.path.lower()
                if key in seen:
                    raise ValueError(f"file {f.path!r} is listed by both {seen[key]} and {role}")
                seen[key] = role
        paths = set(seen)
        # A file may not also be the directory of another file ("a" and "a/b").
        for p in paths:
            parent = posixpath.dirname(p)
            while parent:
                if parent in paths:
                    raise ValueError(f"{parent!r} is both a file and a directory")
                parent = posixpath.dirname(parent)
        if self.mode == "kserve":
            self.kserve_layout()
        elif "config.json" not in paths:
            raise ValueError("the model directory needs a config.json (list it under weights)")
        names = [w.filename for w in self.plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"plugin wheel file names must be unique, got {names}")
        # The engine (vLLM, torch, Triton) is pinned by the image lock, never by a package.
        override = engine_override_error(names)
        if override:
            raise ValueError(override)
        return self

    def kserve_layout(self) -> Literal["model", "repository"]:
        """What a kserve package's weights are: "model" (a Triton config at the top: one model
        directory) or "repository" (no config at the top, `<model>/config.*` for each model, or
        for a model without one `<model>/<version>/model.onnx` or `model.py`, as paved.kserve
        loads them; model_id one of them); ValueError when neither."""
        return self._kserve_models()[0]

    def kserve_models(self) -> list[str]:
        """The models a kserve package serves, sorted: [model_id] for a model directory, every
        model folder of a repository (model_id among them); ValueError as kserve_layout."""
        return self._kserve_models()[1]

    def _kserve_models(self) -> tuple[Literal["model", "repository"], list[str]]:
        paths = {f.path for f in self.weights.files}
        if any(name in paths for name in KSERVE_CONFIGS):
            return "model", [self.model_id]
        models = sorted({m for m in map(_repository_model, paths) if m is not None})
        if not models:
            raise ValueError(
                "a kserve package's weights are a model directory (config.json or config.pbtxt at the "
                "top) or a Triton model repository (<model>/config.pbtxt per model, or "
                "<model>/<version>/model.onnx or model.py without one); found neither"
            )
        if self.model_id not in models:
            raise ValueError(
                f"model_id {self.model_id!r} is not a model of the repository ({models}): the control "
                "plane probes and routes the package by it"
            )
        return "repository", models

    def _artifacts(self) -> list[tuple[str, Artifact]]:
        out = [("weights", self.weights)]
        if self.tokenizer is not None:
            out.append(("tokenizer", self.tokenizer))
        return out

    def model_files(self) -> list[tuple[Artifact, FileEntry]]:
        return [(a, f) for _, a in self._artifacts() for f in a.files]

    def total_bytes(self) -> int:
        return sum(f.size for _, f in self.model_files()) + sum(w.size for w in self.plugins)

    def canonical_json(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    def digest(self) -> str:
        """Content address of the package: sha256 of its canonical model.json."""
        return hashlib.sha256(self.canonical_json()).hexdigest()


def _repository_model(path: str) -> str | None:
    """The model folder of a repository that `path` makes a model paved.kserve serves: its
    config, or a model file its config is completed from; hidden folders are not loaded."""
    parts = path.split("/")
    if parts[0].startswith("."):
        return None
    if len(parts) == 2 and parts[1] in KSERVE_CONFIGS:
        return parts[0]
    if len(parts) == 3 and _KSERVE_VERSION.match(parts[1]) and parts[2] in KSERVE_AUTO_COMPLETE_FILES:
        return parts[0]
    return None


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def parse_model_json(raw: bytes | str, source: str = MODEL_JSON) -> ModelPackage:
    """Validate a model.json; errors name the source and every offending field."""
    try:
        return ModelPackage.model_validate_json(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()
        )
        raise PackageError(f"{source} is not a valid model package: {problems}") from None


_ABS = re.compile(r"^(s3://|file://|/)")


def is_absolute_uri(uri: str) -> bool:
    return bool(_ABS.match(uri))


def join_uri(base: str, rel: str) -> str:
    """`base` (an absolute uri or package-relative path) joined with a relative path."""
    if not base or base == ".":
        return rel
    return base.rstrip("/") + "/" + rel
