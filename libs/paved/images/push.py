"""`tools/bazel run //images:push -- --registry HOST:PORT [--tag T]`: pushes every image.

Before anything is sent, each image must have a passing compatibility report made for the
same lock (sha256) the image was baked with; otherwise nothing is pushed. Then per image:
  1. its base must be in the registry under the lock's mirror repository. A stand-in base
     (built here, all blobs local) is mirrored by this command; a real base is mirrored by
     the release beforehand (images/README.md), and a missing one is an error;
  2. base layers are cross-repo mounted from the mirror; a layer another image of this run
     already pushed is mounted from there; the rest is uploaded;
  3. the manifest is PUT by tag and the registry's digest must equal the local one.
Each pushed digest is printed as `HOST:PORT/REPO:TAG@sha256:...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from paved.images import lock as locks
from paved.images import oci
from paved.images.registry import Registry, RegistryError


class PushRefused(Exception):
    pass


@dataclasses.dataclass
class Target:
    name: str
    repository: str
    layout: oci.Layout
    image: oci.Image
    base: oci.Image | None
    base_layout: oci.Layout | None
    base_repository: str | None
    compat_report: str | None
    remote_tags: list[str]


def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p


def load_targets(spec_path: str, root: Path) -> list[Target]:
    spec = json.loads(Path(spec_path).read_text())
    targets = []
    for item in spec["images"]:
        layout = oci.Layout(_resolve(item["layout"], root))
        base_layout = oci.Layout(_resolve(item["base_layout"], root)) if item.get("base_layout") else None
        base_repository = item.get("base_repository")
        if not base_repository and item.get("lock"):
            base_repository = locks.load(_resolve(item["lock"], root)).base.mirror_repository
        targets.append(
            Target(
                name=item["name"],
                repository=item["repository"],
                layout=layout,
                image=layout.image(),
                base=base_layout.image() if base_layout else None,
                base_layout=base_layout,
                base_repository=base_repository,
                compat_report=str(_resolve(item["compat_report"], root))
                if item.get("compat_report")
                else None,
                remote_tags=list(item.get("remote_tags") or []),
            )
        )
    return targets


def preflight(target: Target) -> None:
    """Refuses an image without a passing compatibility report for the lock it was baked with."""
    labels = oci.image_labels(target.image)
    lock_sha = labels.get("org.paved.lock.sha256")
    if lock_sha is None:
        return  # not a flavoured image (e.g. a stand-in base): nothing to be compatible with
    if not target.compat_report or not Path(target.compat_report).is_file():
        raise PushRefused(f"{target.name}: no compatibility report; refusing to push")
    report = json.loads(Path(target.compat_report).read_text())
    if report.get("lock_sha256") != lock_sha:
        raise PushRefused(
            f"{target.name}: its compatibility report is for lock {report.get('lock_sha256')}, "
            f"the image was baked with {lock_sha}; refusing to push"
        )
    if not report.get("ok"):
        problems = "\n    ".join(report.get("errors") or ["(no details)"])
        raise PushRefused(
            f"{target.name}: the {report.get('flavour')} compatibility check against {report.get('engine')} "
            f"failed; refusing to push:\n    {problems}"
        )


def push_blob(reg: Registry, repo: str, desc: dict, sources: list[oci.Layout], mount_from: list[str]) -> str:
    digest = desc["digest"]
    if reg.has_blob(repo, digest):
        return "exists"
    for other in mount_from:
        if other != repo and reg.mount_blob(repo, digest, other):
            return f"mounted from {other}"
    for layout in sources:
        if layout.has_blob(digest):
            reg.upload_blob(repo, digest, path=layout.blob_path(digest))
            return "uploaded"
    raise RegistryError(f"{repo}: blob {digest} is neither in the registry nor local")


def mirror_base(reg: Registry, target: Target, out=sys.stdout) -> None:
    """Makes sure the base is in its mirror repository (uploading a local stand-in)."""
    base, repo = target.base, target.base_repository
    if base is None or repo is None:
        return
    try:
        _, _, have = reg.get_manifest(repo, base.manifest_digest)
        if have == base.manifest_digest:
            return
    except RegistryError:
        pass
    layout = target.base_layout
    missing = [d["digest"] for d in base.layers if not (layout and layout.has_blob(d["digest"]))]
    if missing:
        raise PushRefused(
            f"{target.name}: base {base.manifest_digest} is not in {reg.host}/{repo} and its layers are not "
            f"local; mirror the pinned base first (images/README.md, 'Mirroring a base')"
        )
    for desc in [*base.layers, base.manifest["config"]]:
        push_blob(reg, repo, desc, [layout], [])  # type: ignore[list-item]
    digest = reg.put_manifest(
        repo, base.manifest_digest, base.manifest_bytes, base.manifest.get("mediaType", oci.MEDIA_MANIFEST)
    )
    if digest and digest != base.manifest_digest:
        raise RegistryError(f"{repo}: registry stored the base as {digest}, expected {base.manifest_digest}")
    print(f"mirrored base {reg.host}/{repo}@{base.manifest_digest}", file=out, flush=True)


def push(reg: Registry, targets: list[Target], tag: str | None, out=sys.stdout) -> list[dict]:
    for t in targets:
        preflight(t)
    pushed: list[dict] = []
    holders: dict[str, list[str]] = {}  # blob digest -> repositories of this run that hold it
    for t in targets:
        mirror_base(reg, t, out)
        base_digests = {d["digest"] for d in (t.base.layers if t.base else [])}
        for desc in [*t.image.layers, t.image.manifest["config"]]:
            mount_from = [t.base_repository] if desc["digest"] in base_digests and t.base_repository else []
            mount_from += holders.get(desc["digest"], [])
            how = push_blob(reg, t.repository, desc, [t.layout], mount_from)
            holders.setdefault(desc["digest"], []).append(t.repository)
            if how.startswith("mounted") or how == "uploaded":
                print(f"  {t.repository}: {desc['digest'][:19]} {how}", file=out, flush=True)
        tags = [tag] if tag else (t.remote_tags or [default_tag(t.image)])
        for ref in tags:
            digest = reg.put_manifest(t.repository, ref, t.image.manifest_bytes)
            if digest and digest != t.image.manifest_digest:
                raise RegistryError(
                    f"{t.repository}:{ref}: registry stored {digest}, expected {t.image.manifest_digest}"
                )
            print(f"pushed {reg.host}/{t.repository}:{ref}@{t.image.manifest_digest}", file=out, flush=True)
            pushed.append(
                {"repository": t.repository, "tag": ref, "digest": t.image.manifest_digest, "name": t.name}
            )
    return pushed


def default_tag(image: oci.Image) -> str:
    rev = oci.image_labels(image).get("org.opencontainers.image.revision", "unknown")
    if rev in ("", "unknown"):
        return "latest"
    sha, dirty = rev.removesuffix("-dirty"), rev.endswith("-dirty")
    return f"git-{sha[:12]}" + ("-dirty" if dirty else "")


def vendor_base(reg: Registry, repository: str, digest: str, out_dir: str | Path) -> str:
    """Writes the metadata-only layout of a mirrored base (oci-layout, index.json, manifest and
    config blobs; its layers stay in the registry) for images/bases/<flavour>/; returns the
    digest of the image manifest (the linux/amd64 one when `digest` names an index)."""
    data, media_type, got = reg.get_manifest(repository, digest)
    if got != digest:
        raise RegistryError(f"{repository}@{digest}: the registry returned {got}")
    manifest = json.loads(data)
    if manifest.get("mediaType", media_type) in (oci.MEDIA_INDEX, oci.DOCKER_MANIFEST_LIST):
        platforms = {
            (m.get("platform", {}).get("os"), m.get("platform", {}).get("architecture")): m
            for m in manifest.get("manifests", [])
        }
        if ("linux", "amd64") not in platforms:
            raise RegistryError(f"{repository}@{digest}: the index has no linux/amd64 image")
        desc = platforms[("linux", "amd64")]
        data, media_type, digest = reg.get_manifest(repository, desc["digest"])
        manifest = json.loads(data)
    layout = oci.Layout(out_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.write_blob(reg.get_blob(repository, manifest["config"]["digest"]))
    layout.write_blob(data)
    (layout.root / "oci-layout").write_bytes(oci.canonical_json({"imageLayoutVersion": "1.0.0"}))
    desc = {"mediaType": manifest.get("mediaType", media_type), "digest": digest, "size": len(data)}
    (layout.root / "index.json").write_bytes(oci.canonical_json({"schemaVersion": 2, "manifests": [desc]}))
    if layout.image().manifest_digest != digest:
        raise oci.OciError(f"{out_dir}: wrote a layout of another image than {digest}")
    return digest


def main_vendor_base(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="vendor-base", description=(vendor_base.__doc__ or "").split(";")[0])
    ap.add_argument("--registry", required=True, help="HOST:PORT of the registry that mirrors the base")
    ap.add_argument("--repository", required=True, help="e.g. paved/base/gpu")
    ap.add_argument("--digest", required=True, help="the base's manifest (or index) digest")
    ap.add_argument("--out", required=True, help="e.g. images/bases/gpu")
    ap.add_argument("--plain-http", action="store_true")
    args = ap.parse_args(argv)
    reg = Registry(args.registry, plain_http=True if args.plain_http else None)
    digest = vendor_base(reg, args.repository, args.digest, args.out)
    print(f"wrote {args.out} (manifest {digest}); pin it as [base] digest in the flavour's lock")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="push", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="push spec written by oci_push (JSON)")
    ap.add_argument("--registry", required=True, help="HOST:PORT")
    ap.add_argument("--tag", help="tag to push (default: the image's remote_tags, else git-<revision>)")
    ap.add_argument("--plain-http", action="store_true", help="http:// even for a non-loopback host")
    ap.add_argument("--only", action="append", default=[], help="push only these image names")
    ap.add_argument("--digests-out", help="write what was pushed as JSON")
    args = ap.parse_args(argv)
    root = Path(os.environ.get("PAVED_PUSH_ROOT", "."))
    targets = load_targets(args.spec, root)
    if args.only:
        targets = [t for t in targets if t.name in args.only]
    reg = Registry(args.registry, plain_http=True if args.plain_http else None)
    try:
        pushed = push(reg, targets, args.tag)
    except PushRefused as e:
        print(f"push refused: {e}", file=sys.stderr)
        return 2
    except (RegistryError, oci.OciError, locks.LockError) as e:
        print(f"push failed: {e}", file=sys.stderr)
        return 1
    if args.digests_out:
        Path(args.digests_out).write_text(json.dumps(pushed, indent=1) + "\n")
    print(f"{len(pushed)} image(s) pushed to {args.registry}", file=sys.stderr)
    return 0
