"""Build a model package from a Hugging Face model folder, optionally upload it to S3.

    python -m paved.launcher.build --hf-dir models/tiny --model-id tiny --version 1 \\
        --engine-args '{"max_model_len": 512, "dtype": "float32"}' --out /tmp/tiny-pkg
    python -m paved.launcher.build ... --out /tmp/tiny.tar            # a tarball instead
    python -m paved.launcher.build ... --out /tmp/tiny-pkg --upload s3://bucket/models/tiny/1

Layout of the result: model.json, weights/<files>, tokenizer/<files>, plugins/<wheels>.
Tokenizer files (tokenizer*.json, special_tokens_map.json, vocab/merges, *.model, chat
templates) go under tokenizer/, everything else under weights/. With `--mode kserve` the folder
is either a classic model directory, e.g. //models/xgb, whose config's (config.json or
config.pbtxt) `name` must be the model id (the name KServe clients call), or a whole Triton
model repository (`<model>/config.pbtxt`, `<model>/<version>/...`), whose models keep their
directory names and one of which must be the model id (the model the control plane probes):
all of it goes under weights/ and there is no tokenizer. Tarballs are reproducible (sorted
entries, mtime 0, uid/gid 0).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import tarfile
from typing import Any

from paved.launcher.package import MODEL_JSON, ModelPackage

log = logging.getLogger("paved.launcher")
TOKENIZER_PATTERNS = (
    "tokenizer*.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: str) -> list[str]:
    """Relative paths of the regular files under root (dot-files skipped). Anything that would
    be left out silently or hang a read is an error instead: os.walk does not descend into
    linked directories, and a broken link or a FIFO is not a file to hash."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise ValueError(
                    f"{os.path.join(dirpath, d)} is a symbolic link to a directory; "
                    "copy its files in or point at its target"
                )
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            if not os.path.isfile(path):
                raise ValueError(f"{path} is not a regular file (a broken symbolic link?)")
            out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return out


def is_tokenizer_file(relpath: str) -> bool:
    return "/" not in relpath and any(fnmatch.fnmatch(relpath, p) for p in TOKENIZER_PATTERNS)


def build_package(
    hf_dir: str,
    out: str,
    model_id: str,
    version: str,
    engine_args: dict[str, Any] | None = None,
    mode: str = "embedded",
    plugin_wheels: tuple[str, ...] = (),
    link: bool = False,
) -> ModelPackage:
    """Write a package directory (or tarball if `out` ends in .tar/.tar.gz/.tgz). With `link`,
    a package directory hardlinks the source files where it can instead of copying them."""
    hf_dir = os.path.realpath(hf_dir)
    if mode == "kserve":
        if os.path.isfile(os.path.join(hf_dir, "config.json")):
            _check_kserve_name(os.path.join(hf_dir, "config.json"), model_id)
        elif os.path.isfile(os.path.join(hf_dir, "config.pbtxt")):
            _check_kserve_name(os.path.join(hf_dir, "config.pbtxt"), model_id)
        # else a model repository: its models' names are their folders (ModelPackage checks them)
    elif not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    placed: list[tuple[str, str]] = []  # (package-relative path, source file)
    weights: list[dict[str, Any]] = []
    tokenizer: list[dict[str, Any]] = []
    for rel in _walk(hf_dir):
        src = os.path.join(hf_dir, rel)
        entry = {"path": rel, "sha256": sha256_file(src), "size": os.path.getsize(src)}
        role = "tokenizer" if mode != "kserve" and is_tokenizer_file(rel) else "weights"
        (tokenizer if role == "tokenizer" else weights).append(entry)
        placed.append((f"{role}/{rel}", src))
    if not tokenizer and mode != "kserve":
        raise ValueError(f"{hf_dir} has no tokenizer files ({', '.join(TOKENIZER_PATTERNS)})")
    wheels = []
    for wheel in plugin_wheels:
        if not os.path.isfile(wheel):
            raise ValueError(f"plugin wheel {wheel} is not a file")
        name = os.path.basename(wheel)
        wheels.append(
            {"uri": f"plugins/{name}", "sha256": sha256_file(wheel), "size": os.path.getsize(wheel)}
        )
        placed.append((f"plugins/{name}", wheel))
    package = ModelPackage.model_validate(
        {
            "model_id": model_id,
            "version": version,
            "mode": mode,
            "engine_args": engine_args or {},
            "weights": {"uri": "weights", "files": weights},
            "tokenizer": {"uri": "tokenizer", "files": tokenizer} if tokenizer else None,
            "plugins": wheels,
        }
    )
    manifest = (json.dumps(package.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()
    if out.endswith((".tar", ".tar.gz", ".tgz")):
        _write_tar(out, manifest, placed)
    else:
        os.makedirs(out, exist_ok=True)
        for rel, src in placed:
            dest = os.path.join(out, *rel.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if link:
                try:
                    os.link(src, dest)
                    continue
                except OSError:
                    pass
            shutil.copyfile(src, dest)
        with open(os.path.join(out, MODEL_JSON), "wb") as f:
            f.write(manifest)
    return package


def _check_kserve_name(config_path: str, model_id: str) -> None:
    with open(config_path, "rb") as f:
        raw = f.read(1 << 20)
    if config_path.endswith(".pbtxt"):
        name = _pbtxt_name(raw.decode(errors="replace"))
    else:
        try:
            config = json.loads(raw)
        except ValueError:
            raise ValueError(f"{config_path} is not JSON (a Triton model config)") from None
        name = config.get("name") if isinstance(config, dict) else None
    if name != model_id:
        raise ValueError(
            f"{config_path} names the model {name!r}, not {model_id!r}: KServe clients call it by "
            "that name, so --model-id must be it"
        )


_PBTXT_TOKEN = re.compile(
    r'#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}\[\]<>]|[^\s{}\[\]<>:,;"\'#]+|[:,;]'
)


def _pbtxt_name(text: str) -> str | None:
    """The top-level `name` of a protobuf-text Triton config (None when it sets none). A small
    scan rather than the protobuf parser: the launcher does not load the KServe stubs, and
    only the one field at depth 0 matters here (nested tensors have names too)."""
    depth = 0
    parts = [t for t in _PBTXT_TOKEN.findall(text) if not t.startswith("#")]
    for i, part in enumerate(parts):
        if part in ("{", "[", "<"):
            depth += 1
        elif part in ("}", "]", ">"):
            depth -= 1
        elif depth == 0 and part == "name" and i + 2 < len(parts) and parts[i + 1] == ":":
            value = parts[i + 2]
            if value[:1] in "\"'":
                return value[1:-1]
    return None


def _write_tar(out: str, manifest: bytes, placed: list[tuple[str, str]]) -> None:
    def info(name: str, size: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        return ti

    raw = open(out, "wb")  # noqa: SIM115 (closed below; gzip needs mtime=0 for reproducibility)
    try:
        fileobj: io.BufferedIOBase
        if out.endswith(".tar"):
            fileobj = raw
        else:
            import gzip

            fileobj = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
        with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(info(MODEL_JSON, len(manifest)), io.BytesIO(manifest))
            for rel, src in sorted(placed):
                with open(src, "rb") as f:
                    tar.addfile(info(rel, os.path.getsize(src)), f)
        if fileobj is not raw:
            fileobj.close()
    finally:
        raw.close()


def upload_package(package_dir: str, s3_uri: str, client: Any, multipart_threshold: int | None = None) -> int:
    """Upload every file of a package directory (or one tarball) under `s3_uri`. Returns bytes."""
    from boto3.s3.transfer import TransferConfig

    from paved.launcher.storage import parse_s3_uri

    bucket, prefix = parse_s3_uri(s3_uri)
    config = TransferConfig(multipart_threshold=multipart_threshold) if multipart_threshold else None
    total = 0
    if os.path.isfile(package_dir):
        client.upload_file(package_dir, bucket, prefix, Config=config)
        return os.path.getsize(package_dir)
    for rel in _walk(package_dir):
        key = f"{prefix.rstrip('/')}/{rel}" if prefix else rel
        path = os.path.join(package_dir, rel)
        client.upload_file(path, bucket, key, Config=config)
        total += os.path.getsize(path)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build_package", description=__doc__.split("\n")[0])
    p.add_argument(
        "--hf-dir", required=True, help="Hugging Face model folder (config.json, weights, tokenizer)"
    )
    p.add_argument("--out", required=True, help="package directory, or a .tar/.tar.gz/.tgz file")
    p.add_argument("--model-id", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--mode", choices=("embedded", "standalone", "kserve"), default="embedded")
    p.add_argument("--engine-args", default="{}", help="JSON object of vLLM engine arguments")
    p.add_argument("--plugin", action="append", default=[], help="plugin wheel to include (repeatable)")
    p.add_argument("--upload", help="s3://bucket/prefix to upload the result to")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cwd = os.environ.get("BUILD_WORKING_DIRECTORY", "")
    hf_dir, out = os.path.join(cwd, args.hf_dir), os.path.join(cwd, args.out)
    try:
        engine_args = json.loads(args.engine_args)
        if not isinstance(engine_args, dict):
            raise ValueError("--engine-args must be a JSON object")
        package = build_package(
            hf_dir,
            out,
            args.model_id,
            args.version,
            engine_args,
            args.mode,
            tuple(os.path.join(cwd, w) for w in args.plugin),
        )
    except (ValueError, OSError) as e:  # bad input, or an unreadable source / unwritable output
        print(f"build_package: {e}", file=sys.stderr)
        return 2
    log.info(
        "wrote %s (%s:%s, %d files, %d bytes)",
        out,
        package.model_id,
        package.version,
        len(package.model_files()),
        package.total_bytes(),
    )
    if args.upload:
        from paved.launcher.storage import make_s3_client

        n = upload_package(out, args.upload, make_s3_client(args.s3_endpoint_url))
        log.info("uploaded %d bytes to %s", n, args.upload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
