"""The build actions behind tools/build_defs/oci.bzl: a layer from a file list (a py_binary's
runfiles, or loose files) and an image layout from layers, a base, a spec and a lock."""

from __future__ import annotations

import json
import posixpath
import re
import sys
from pathlib import Path

from paved.images import lock as locks
from paved.images import oci

REVISION_KEY = "STABLE_PAVED_REVISION"


class BuildError(Exception):
    pass


def parse_py_stub(text: str) -> tuple[str, list[str]]:
    """(main file, import paths) of a Bazel 4 py_binary launcher stub, both relative to the
    runfiles root: exactly what the stub itself would put on sys.path and run."""
    main = re.search(r"^\s*rel_path = '([^']+)'$", text, re.M)
    imports = re.search(r"^\s*python_imports = '([^']*)'$", text, re.M)
    if not main or imports is None:
        raise BuildError("not a Bazel 4 py_binary stub (no rel_path / python_imports line)")
    return main.group(1), [p for p in imports.group(1).split(":") if p]


def launch_info(stub_path: str, runfiles_dir: str, workspace: str, entries: list[oci.Entry]) -> dict:
    """Entrypoint, environment and working directory that run the binary in the image the
    way `bazel run` does, without the stub (whose interpreter path is the build machine's)."""
    main, imports = parse_py_stub(Path(stub_path).read_text())
    prefix = runfiles_dir.rstrip("/") + "/"
    repos = sorted({e.path[len(prefix) :].split("/")[0] for e in entries if e.path.startswith(prefix)})
    path = [runfiles_dir] + [posixpath.join(runfiles_dir, p) for p in imports]
    path += [posixpath.join(runfiles_dir, r) for r in repos]
    return {
        "main": posixpath.join(runfiles_dir, main),
        "env": {"PYTHONPATH": ":".join(dict.fromkeys(path)), "RUNFILES_DIR": runfiles_dir},
        "workdir": posixpath.join(runfiles_dir, workspace),
    }


def build_layer(manifest_path: str, out: str, info_out: str) -> oci.LayerInfo:
    """manifest: {"entries": [{"path", "source"?, "symlink"?, "dir"?}], "binary"?: {"stub",
    "runfiles_dir", "workspace"}}; writes the gzipped layer and its JSON info."""
    spec = json.loads(Path(manifest_path).read_text())
    entries = []
    for e in spec["entries"]:
        if "symlink" in e:
            entries.append(oci.Entry(e["path"], "symlink", target=e["symlink"]))
        elif e.get("dir"):
            entries.append(oci.Entry(e["path"], "dir"))
        else:
            src = e.get("source")
            entries.append(oci.Entry(e["path"], "file", src, executable=bool(src) and oci._is_exec(src)))
    info = oci.write_layer(entries, out)
    doc = info.to_json()
    binary = spec.get("binary")
    if binary:
        doc["launch"] = launch_info(
            binary["stub"], binary["runfiles_dir"], binary["workspace"], oci.expand_entries(entries)
        )
    Path(info_out).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    return info


def read_status(path: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if path and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


def build_image_action(
    out: str,
    spec_path: str,
    layers: list[tuple[str, str]],
    base_dir: str | None,
    lock_path: str | None,
    status_path: str | None,
    digest_out: str | None,
) -> str:
    spec_doc = json.loads(Path(spec_path).read_text())
    lock = locks.load(lock_path) if lock_path else None
    base = oci.Layout(base_dir).image() if base_dir else None
    layer_infos = []
    launch = None
    for tar, info_path in layers:
        doc = json.loads(Path(info_path).read_text())
        launch = doc.pop("launch", None) or launch
        layer_infos.append((tar, oci.LayerInfo.from_json(doc)))

    spec = oci.ImageSpec(
        entrypoint=spec_doc.get("entrypoint") or None,
        cmd=spec_doc.get("cmd") or None,
        env=dict(spec_doc.get("env") or {}),
        labels=dict(spec_doc.get("labels") or {}),
        workdir=spec_doc.get("workdir") or None,
        user=spec_doc.get("user") or None,
        created_by=spec_doc.get("created_by") or "paved oci_image",
    )
    if spec.entrypoint is None and launch is not None:
        if lock is None:
            raise BuildError(
                "an image of a py_binary layer needs a lock: it names the interpreter the base provides"
            )
        spec.entrypoint = [lock.python, launch["main"]]
        spec.env = {**launch["env"], **spec.env}
        spec.workdir = spec.workdir or launch["workdir"]
    if lock is not None:
        if base is None:
            raise BuildError(f"{lock.path}: a {lock.flavour} image must be stacked on its pinned base")
        errors = locks.check_base(lock, base.manifest_digest, oci.image_env(base))
        if errors:
            raise BuildError("\n".join(errors))
        status = read_status(status_path)
        spec.labels = {
            **spec.labels,
            **lock.labels(),
            "org.opencontainers.image.revision": status.get(REVISION_KEY, "unknown"),
        }
    digest = oci.build_image(out, layer_infos, spec, base, ref_name=spec_doc.get("ref_name") or "latest")
    if digest_out:
        Path(digest_out).write_text(digest + "\n")
    return digest


def main_layer(args) -> int:
    build_layer(args.manifest, args.out, args.info)
    return 0


def main_image(args) -> int:
    try:
        build_image_action(
            args.out,
            args.spec,
            [tuple(x.split("=", 1)) for x in args.layer],
            args.base,
            args.lock,
            args.status,
            args.digest_out,
        )
    except (BuildError, oci.OciError, locks.LockError) as e:
        print(f"oci_image: {e}", file=sys.stderr)
        return 1
    return 0
