"""A model package's I/O fingerprint: what a client of the model can observe besides quality.

Red-black rollouts move the bare alias from one version to the next under live traffic, which
is only safe when requests and answers keep their shape. The fingerprint captures that shape
from the package's model.json (validated by paved.launcher.package), without fetching weights:

    {"kind": "generate" | "embed" | "kserve" (a classic KServe model, mode "kserve"),
     "tokenizer_sha256": sha256 over the tokenizer files' (path, manifest sha256) list,
     "chat_template_sha256": see below, or None when the package has no chat template,
     "max_model_len": engine_args.max_model_len or None,
     "kserve": engine_args.kserve (declared KServe tensor specs) or None,
     "resources": {"tensor_parallel_size", "pipeline_parallel_size", "gpus"}: what a replica
       needs (engine_args' vLLM parallel sizes; gpus = their product, 0 for a classic model),
     "models" (kserve packages only): the models a replica serves, sorted (the model id alone
       for a model directory, every model of a model repository)}

"resources" is recorded for the drivers (a Kubernetes pod's nvidia.com/gpu) and is not part of
the comparison: a client cannot observe how many GPUs serve it, so changing it never blocks a
rollout. Nor is "models": the control plane routes each of them to the package's replicas, and
a model added or removed is already a change of the "kserve" field (its config's hash).

A "kserve" package has no tokenizer (its tokenizer and chat template fields are None); its
"kserve" field is engine_args.kserve when declared, else what states its tensors: the manifest
sha256 of its Triton config.json ({"config_json_sha256"}) for a model directory with one, else
({"configs_sha256"}) the sha256 over the (path, manifest sha256) list of every Triton config
(config.pbtxt / config.json) of the model directory or model repository, and for a repository's
model without a config the model.onnx / model.py its config is completed from (any change to
one counts as a change).

Chat template: a `chat_template.*` tokenizer file -> its manifest sha256; else the
`chat_template` value of tokenizer_config.json when that file can be read (a directory, a
tarball, S3) -> sha256 of it (canonical JSON), None when it declares none; else the manifest
sha256 of tokenizer_config.json itself (conservative: any change to it counts as a change).

Sources (as the launcher accepts them): a package directory (path, file://, s3://prefix) or a
tarball (.tar, .tar.gz, .tgz; local or s3://). An S3 tarball is streamed only up to the
members needed (model.json is first in paved-built tarballs). Blocking: call it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tarfile
from typing import IO, Any

from paved.control_plane.errors import BadRequest
from paved.launcher.materialize import is_tarball
from paved.launcher.package import (
    KSERVE_AUTO_COMPLETE_FILES,
    KSERVE_CONFIGS,
    MODEL_JSON,
    ModelPackage,
    PackageError,
    is_absolute_uri,
    join_uri,
    parse_model_json,
)
from paved.launcher.storage import Downloader, TransferError, local_path, parse_s3_uri

FIELDS = ("kind", "tokenizer_sha256", "chat_template_sha256", "max_model_len", "kserve")
_NOT_COMPARED = frozenset({"resources", "models"})
TOKENIZER_CONFIG = "tokenizer_config.json"
_SMALL = 16 << 20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def fingerprint_package(uri: str, *, downloader: Downloader | None = None) -> dict[str, Any]:
    """The fingerprint of the package at `uri`; BadRequest if it cannot be read or is invalid."""
    if not isinstance(uri, str) or not uri:
        raise BadRequest("package_uri must be a non-empty string")
    dl = downloader or Downloader()
    try:
        if is_tarball(uri):
            package, config_raw = _from_tarball(uri, dl)
        else:
            package = parse_model_json(dl.read_small(join_uri(uri, MODEL_JSON)), join_uri(uri, MODEL_JSON))
            config_raw = _read_config(uri, package, dl)
    except PackageError as exc:
        raise BadRequest(str(exc), code="invalid_package") from None
    except (OSError, TransferError, tarfile.TarError) as exc:
        raise BadRequest(f"cannot read the package at {uri}: {exc}", code="package_unreadable") from None
    return fingerprint_of(package, config_raw)


def fingerprint_of(package: ModelPackage, tokenizer_config: bytes | None = None) -> dict[str, Any]:
    """The fingerprint of a parsed model.json (+ tokenizer_config.json's bytes, if read)."""
    engine_args = dict(package.engine_args)
    kserve = engine_args.get("kserve")
    declared = kserve if isinstance(kserve, dict | list) and kserve else None
    if package.mode == "kserve" or package.tokenizer is None:
        config = next((f.sha256 for f in package.weights.files if f.path == "config.json"), None)
        shape: dict[str, Any] = {"config_json_sha256": config}
        if config is None:
            shape = {"configs_sha256": _sha(_canonical(_shape_files(package)))}
        return {
            "kind": "kserve",
            "tokenizer_sha256": None,
            "chat_template_sha256": None,
            "max_model_len": None,
            "kserve": declared or shape,
            "resources": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "gpus": 0},
            "models": _kserve_models(package),
        }
    kind = engine_args.get("kind", "generate")
    if kind not in ("generate", "embed"):
        raise BadRequest(
            f"engine_args.kind must be 'generate' or 'embed', got {kind!r:.40}", code="invalid_package"
        )
    files = sorted((f.path, f.sha256) for f in package.tokenizer.files)
    max_len = engine_args.get("max_model_len")
    return {
        "kind": kind,
        "tokenizer_sha256": _sha(_canonical(files)),
        "chat_template_sha256": _chat_template_sha(package, tokenizer_config),
        "max_model_len": max_len if isinstance(max_len, int) and not isinstance(max_len, bool) else None,
        "kserve": declared,
        "resources": _resources(engine_args),
    }


def _shape_files(package: ModelPackage) -> list[tuple[str, str]]:
    """(path, manifest sha256) of what states a kserve package's tensors: every Triton config
    (config.pbtxt / config.json) at the top or of a repository's model, and for a repository's
    model without one the files paved.kserve completes its config from (its version folders'
    model.onnx / model.py), sorted."""
    configs = [
        f
        for f in package.weights.files
        if f.path.count("/") <= 1 and posixpath.basename(f.path) in KSERVE_CONFIGS
    ]
    configured = {f.path.split("/")[0] for f in configs if "/" in f.path}
    completed = [
        f
        for f in package.weights.files
        if f.path.count("/") == 2
        and posixpath.basename(f.path) in KSERVE_AUTO_COMPLETE_FILES
        and f.path.split("/")[1].isdigit()
        and f.path.split("/")[0] not in configured
        and not f.path.startswith(".")
    ]
    return sorted((f.path, f.sha256) for f in [*configs, *completed])


def _kserve_models(package: ModelPackage) -> list[str]:
    try:
        return package.kserve_models()
    except ValueError:  # not a kserve layout (a tokenizer-less package of another mode)
        return [package.model_id]


def _resources(engine_args: dict[str, Any]) -> dict[str, int]:
    sizes = {}
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = engine_args.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise BadRequest(
                f"engine_args.{name} must be an integer in [1, 1024], got {value!r:.40}",
                code="invalid_package",
            )
        sizes[name] = value
    return {**sizes, "gpus": sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"]}


def fingerprint_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The fingerprint fields whose values differ (in FIELDS order, then any extra keys)."""
    a, b = a or {}, b or {}
    extra = sorted((set(a) | set(b)) - set(FIELDS) - _NOT_COMPARED)
    return [k for k in (*FIELDS, *extra) if a.get(k) != b.get(k)]


def _chat_template_sha(package: ModelPackage, config_raw: bytes | None) -> str | None:
    entries = {f.path: f.sha256 for f in package.tokenizer.files} if package.tokenizer else {}
    templates = sorted(p for p in entries if posixpath.basename(p).startswith("chat_template."))
    if templates:
        return _sha(_canonical([(p, entries[p]) for p in templates]))
    if config_raw is not None:
        try:
            config = json.loads(config_raw)
        except ValueError:
            config = None
        if isinstance(config, dict):
            template = config.get("chat_template")
            return None if template is None else _sha(_canonical(template))
    return entries.get(TOKENIZER_CONFIG)


def _has_config(package: ModelPackage) -> bool:
    if package.tokenizer is None:
        return False
    return any(f.path == TOKENIZER_CONFIG for f in package.tokenizer.files)


def _read_config(uri: str, package: ModelPackage, dl: Downloader) -> bytes | None:
    if not _has_config(package) or package.tokenizer is None:
        return None
    base = package.tokenizer.uri
    where = join_uri(base if is_absolute_uri(base) else join_uri(uri, base), TOKENIZER_CONFIG)
    return dl.read_small(where, limit=_SMALL)


def _from_tarball(uri: str, dl: Downloader) -> tuple[ModelPackage, bytes | None]:
    if uri.startswith("s3://"):
        bucket, key = parse_s3_uri(uri)
        try:
            body = dl.s3.get_object(Bucket=bucket, Key=key)["Body"]
        except Exception as exc:  # botocore's errors: a clear 400 rather than a 500
            raise TransferError(f"{uri}: {type(exc).__name__}: {exc}") from exc
        try:
            # Stream mode ("r|*") reads forward only and stops once the members are found.
            with tarfile.open(fileobj=body, mode="r|*") as tar:
                return _scan(tar, uri, dl)
        finally:
            body.close()
    with tarfile.open(local_path(uri)) as tar:
        return _scan(tar, uri, dl)


def _scan(tar: tarfile.TarFile, uri: str, dl: Downloader) -> tuple[ModelPackage, bytes | None]:
    """model.json then tokenizer/tokenizer_config.json from the tarball, in member order."""
    package: ModelPackage | None = None
    config_member: str | None = None
    pending: dict[str, bytes] = {}
    for member in tar:
        name = member.name.removeprefix("./")
        if name != MODEL_JSON and not name.endswith(TOKENIZER_CONFIG):
            continue
        if not member.isfile() or member.size > _SMALL:
            continue
        data = _read(tar.extractfile(member))
        if name == MODEL_JSON:
            package = parse_model_json(data, f"{uri}!{MODEL_JSON}")
            config_member = _config_member(package)
            if config_member is None:
                return package, None
            if is_absolute_uri(config_member):
                return package, dl.read_small(config_member, limit=_SMALL)
            if config_member in pending:
                return package, pending[config_member]
        elif package is None:
            # Bounded: a tarball listing many such files before model.json is not paved-built.
            if len(pending) < 8:
                pending[name] = data
        elif name == config_member:
            return package, data
    if package is None:
        raise TransferError(f"{uri} has no {MODEL_JSON} at its root")
    # Listed in the manifest but absent from the tarball: fall back to its manifest sha.
    return package, None


def _config_member(package: ModelPackage) -> str | None:
    """Where tokenizer_config.json is: a member name, an absolute uri, or None (not listed)."""
    if not _has_config(package) or package.tokenizer is None:
        return None
    return join_uri(package.tokenizer.uri, TOKENIZER_CONFIG)


def _read(f: IO[bytes] | None) -> bytes:
    return b"" if f is None else f.read(_SMALL + 1)[:_SMALL]
