"""Deterministic OCI image building: layers, config, manifest and an OCI image layout.

Every byte is a function of the inputs' contents and paths only:
  * tar entries sorted by path, parents before children, every directory listed;
  * mtime 0, uid/gid 0, empty owner names, modes normalized to 0755 (directories and files
    with any execute bit) or 0644, PAX format (no device numbers, no atime/ctime);
  * gzip with mtime 0, an empty file name and a fixed compression level;
  * JSON with sorted keys and compact separators;
  * the image config's `created` and history timestamps are the Unix epoch.
So building twice, on any machine with the same zlib, gives the same digests.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
# Docker's layer media types name the same bytes as OCI's; a manifest we write is OCI, so a
# base's Docker-typed layers are referenced under the OCI name (same digest, same blob).
_DOCKER_TO_OCI_LAYER = {
    "application/vnd.docker.image.rootfs.diff.tar.gzip": MEDIA_LAYER_GZIP,
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": MEDIA_LAYER_GZIP,
}
EPOCH = "1970-01-01T00:00:00Z"
REF_NAME = "org.opencontainers.image.ref.name"
GZIP_LEVEL = 6
_CHUNK = 1 << 20


class OciError(Exception):
    """An input is unusable: a bad layout, a base that does not match its pin, a bad path."""


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# ---- layers ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One path in a layer: a regular file (from `source`, or empty), a directory or a symlink."""

    path: str  # absolute path inside the image
    kind: str = "file"  # file | dir | symlink
    source: str | None = None  # host file whose bytes the file gets (None: empty file)
    target: str | None = None  # symlink target
    executable: bool = False


def _norm_image_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise OciError(f"layer path {path!r} must be absolute")
    norm = posixpath.normpath(path)
    if norm != path.rstrip("/") or ".." in norm.split("/"):
        raise OciError(f"layer path {path!r} is not normalized")
    return norm


def expand_entries(entries: Iterable[Entry]) -> list[Entry]:
    """Normalizes paths, expands host directories into their files, adds every parent
    directory, rejects conflicting duplicates and returns the entries sorted by path."""
    by_path: dict[str, Entry] = {}

    def add(entry: Entry) -> None:
        prev = by_path.get(entry.path)
        if prev is not None and prev != entry:
            raise OciError(f"layer path {entry.path} is given twice with different contents")
        by_path[entry.path] = entry

    for e in entries:
        path = _norm_image_path(e.path)
        if e.kind == "file" and e.source and os.path.isdir(e.source):
            # A directory artifact (e.g. a Bazel tree artifact): its files, recursively.
            for root, dirs, files in os.walk(e.source, followlinks=True):
                dirs.sort()
                rel = os.path.relpath(root, e.source)
                base = path if rel == "." else posixpath.join(path, *rel.split(os.sep))
                add(Entry(base, "dir"))
                for name in sorted(files):
                    src = os.path.join(root, name)
                    add(Entry(posixpath.join(base, name), "file", src, executable=_is_exec(src)))
            continue
        add(dataclasses.replace(e, path=path))
    for path in list(by_path):
        parent = posixpath.dirname(path)
        while parent not in ("/", ""):
            if parent in by_path and by_path[parent].kind != "dir":
                raise OciError(f"{parent} is both a directory and a {by_path[parent].kind}")
            by_path.setdefault(parent, Entry(parent, "dir"))
            parent = posixpath.dirname(parent)
    return [by_path[p] for p in sorted(by_path)]


def _is_exec(path: str) -> bool:
    return bool(os.stat(path).st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))


class _HashingWriter(io.RawIOBase):
    """Write-through that hashes and counts what passes into `sink`."""

    def __init__(self, sink):
        self._sink = sink
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.hash.update(b)
        self.size += len(b)
        self._sink.write(b)
        return len(b)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    digest: str  # sha256 of the gzipped blob (what the manifest names)
    diff_id: str  # sha256 of the uncompressed tar (what the config's rootfs names)
    size: int  # bytes of the gzipped blob
    media_type: str = MEDIA_LAYER_GZIP

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LayerInfo:
        return cls(**data)


def _tarinfo(entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path.lstrip("/") + ("/" if entry.kind == "dir" else ""))
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "dir":
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    elif entry.kind == "symlink":
        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target or ""
    else:
        info.type = tarfile.REGTYPE
        info.mode = 0o755 if entry.executable else 0o644
        info.size = os.path.getsize(entry.source) if entry.source else 0
    return info


def write_layer(entries: Iterable[Entry], out_path: str | os.PathLike) -> LayerInfo:
    """Writes a gzipped tar of `entries` to `out_path` in one pass; returns its digests."""
    expanded = expand_entries(entries)
    with open(out_path, "wb") as raw:
        blob = _HashingWriter(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=blob, mtime=0, compresslevel=GZIP_LEVEL) as gz:
            tar_stream = _HashingWriter(gz)
            with tarfile.open(fileobj=tar_stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in expanded:
                    info = _tarinfo(entry)
                    if info.isreg() and entry.source:
                        with open(entry.source, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
    return LayerInfo(
        digest="sha256:" + blob.hash.hexdigest(),
        diff_id="sha256:" + tar_stream.hash.hexdigest(),
        size=blob.size,
    )


# ---- image layouts -----------------------------------------------------------------------


@dataclasses.dataclass
class Image:
    """A parsed image: its manifest (bytes and digest) and config (bytes and parsed)."""

    manifest_bytes: bytes
    manifest_digest: str
    manifest: dict
    config_bytes: bytes
    config: dict

    @property
    def layers(self) -> list[dict]:
        return list(self.manifest.get("layers", []))


class Layout:
    """An OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/...`).

    A layout may hold only some blobs: an image stacked on a mirrored base references the
    base's layers by digest without carrying them (the registry mounts them)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def blob_path(self, digest: str) -> Path:
        algo, _, hexdigest = digest.partition(":")
        if algo != "sha256" or len(hexdigest) != 64:
            raise OciError(f"unsupported digest {digest!r}")
        return self.root / "blobs" / "sha256" / hexdigest

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str) -> bytes:
        path = self.blob_path(digest)
        if not path.is_file():
            raise OciError(f"{self.root}: blob {digest} is missing")
        data = path.read_bytes()
        if sha256_bytes(data) != digest:
            raise OciError(f"{self.root}: blob {digest} does not match its digest")
        return data

    def index(self) -> dict:
        try:
            return json.loads((self.root / "index.json").read_bytes())
        except (OSError, ValueError) as e:
            raise OciError(f"{self.root} is not an OCI image layout: {e}") from e

    def image(self, platform: tuple[str, str] = ("linux", "amd64")) -> Image:
        """The layout's single image (an index in the layout resolves to `platform`)."""
        manifests = self.index().get("manifests", [])
        if len(manifests) != 1:
            raise OciError(f"{self.root}: expected exactly one manifest in index.json, got {len(manifests)}")
        desc = manifests[0]
        data = self.read_blob(desc["digest"])
        manifest = json.loads(data)
        if manifest.get("mediaType", desc.get("mediaType")) in (MEDIA_INDEX, DOCKER_MANIFEST_LIST):
            for m in manifest.get("manifests", []):
                p = m.get("platform", {})
                if (p.get("os"), p.get("architecture")) == platform:
                    desc = m
                    data = self.read_blob(desc["digest"])
                    manifest = json.loads(data)
                    break
            else:
                raise OciError(f"{self.root}: index has no {platform[0]}/{platform[1]} image")
        config_bytes = self.read_blob(manifest["config"]["digest"])
        return Image(data, desc["digest"], manifest, config_bytes, json.loads(config_bytes))

    def write_blob(self, data: bytes) -> str:
        digest = sha256_bytes(data)
        path = self.blob_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return digest

    def add_blob_file(self, src: str | os.PathLike, digest: str) -> None:
        path = self.blob_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def write_index(self, manifest_bytes: bytes, ref_name: str) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
        digest = self.write_blob(manifest_bytes)
        desc = {
            "mediaType": MEDIA_MANIFEST,
            "digest": digest,
            "size": len(manifest_bytes),
            "annotations": {REF_NAME: ref_name},
        }
        (self.root / "index.json").write_bytes(canonical_json({"schemaVersion": 2, "manifests": [desc]}))
        return digest


@dataclasses.dataclass
class ImageSpec:
    """What the image config sets on top of the base (the rules_oci `oci_image` attributes)."""

    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    os: str = "linux"
    architecture: str = "amd64"
    created_by: str = "paved oci_image"


def _merge_env(base_env: list[str], env: dict[str, str]) -> list[str]:
    merged: dict[str, str] = {}
    for item in base_env:
        key, _, value = item.partition("=")
        merged[key] = value
    for key, value in env.items():
        # ${VAR} refers to the base's value, as in a Dockerfile ENV (e.g. PATH=/x:${PATH}).
        merged[key] = value.replace("${" + key + "}", merged.get(key, ""))
    # Base order first (stable), then ours sorted: a deterministic, readable Env list.
    keys = [k for k in (i.partition("=")[0] for i in base_env) if k in merged]
    keys += sorted(k for k in merged if k not in keys)
    return [f"{k}={merged[k]}" for k in dict.fromkeys(keys)]


def build_image(
    out_dir: str | os.PathLike,
    layers: list[tuple[str, LayerInfo]],
    spec: ImageSpec,
    base: Image | None = None,
    ref_name: str = "latest",
) -> str:
    """Writes an OCI layout with `layers` (path, info) stacked on `base` (or on scratch).

    The base's layers are referenced by digest and never copied; returns the manifest digest."""
    layout = Layout(out_dir)
    base_config = base.config if base else {}
    base_cfg = base_config.get("config") or {}
    config: dict = {"architecture": spec.architecture, "os": spec.os, "created": EPOCH}
    if base and (base_config.get("os"), base_config.get("architecture")) != (spec.os, spec.architecture):
        raise OciError(
            f"base is {base_config.get('os')}/{base_config.get('architecture')}, "
            f"image is {spec.os}/{spec.architecture}"
        )
    run: dict = {k: v for k, v in base_cfg.items() if k not in ("Labels", "Env")}
    env = _merge_env(base_cfg.get("Env") or [], spec.env)
    if env:
        run["Env"] = env
    labels = {**(base_cfg.get("Labels") or {}), **spec.labels}
    if labels:
        run["Labels"] = labels
    if spec.entrypoint is not None:
        run["Entrypoint"] = list(spec.entrypoint)
        run.pop("Cmd", None)  # as in a Dockerfile: a new ENTRYPOINT drops the base's CMD
    if spec.cmd is not None:
        run["Cmd"] = list(spec.cmd)
    if spec.workdir:
        run["WorkingDir"] = spec.workdir
    if spec.user:
        run["User"] = spec.user
    config["config"] = run
    base_layers = base.layers if base else []
    diff_ids = list((base_config.get("rootfs") or {}).get("diff_ids", []))
    if len(diff_ids) != len(base_layers):
        raise OciError(f"base config lists {len(diff_ids)} diff_ids for {len(base_layers)} layers")
    history = list(base_config.get("history") or [])
    for _path, info in layers:
        diff_ids.append(info.diff_id)
        history.append({"created": EPOCH, "created_by": spec.created_by})
    config["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    if history:
        config["history"] = history
    config_bytes = canonical_json(config)
    config_digest = layout.write_blob(config_bytes)

    manifest_layers = []
    for desc in base_layers:
        desc = dict(desc)
        desc["mediaType"] = _DOCKER_TO_OCI_LAYER.get(desc.get("mediaType", ""), desc.get("mediaType"))
        desc.pop("urls", None)
        manifest_layers.append(desc)
    for path, info in layers:
        layout.add_blob_file(path, info.digest)
        manifest_layers.append({"mediaType": info.media_type, "digest": info.digest, "size": info.size})
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": manifest_layers,
    }
    return layout.write_index(canonical_json(manifest), ref_name)


def image_labels(image: Image) -> dict[str, str]:
    return dict((image.config.get("config") or {}).get("Labels") or {})


def image_env(image: Image) -> dict[str, str]:
    env = {}
    for item in (image.config.get("config") or {}).get("Env") or []:
        key, _, value = item.partition("=")
        env[key] = value
    return env
