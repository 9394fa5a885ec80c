"""paved-images: the one command behind //tools/oci:oci (build actions, the push, helpers).

layer            build a deterministic layer from a file list (oci.bzl actions)
image            build an OCI image layout from layers, a base and a lock (oci.bzl actions)
compat           check a lock's vLLM wheel against paved's sources and the Triton manifest
push             push images to a registry (what `bazel run //images:push` runs)
vendor-base      write the metadata-only layout of a mirrored base (images/bases/<flavour>/)
backend-manifest print the vLLM imports of a Triton vLLM backend checkout (for a lock)
patch-backend    apply a lock's reviewed import rewrites to a vLLM backend checkout
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from paved.images import build, compat, push
from paved.images import lock as locks


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    helper = bool(argv) and argv[0] in ("backend-manifest", "patch-backend", "vendor-base")
    if helper and os.environ.get("BUILD_WORKING_DIRECTORY"):
        # `bazel run //tools/oci -- ...` runs in the runfiles tree: relative paths are the caller's.
        os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "compat":
        return compat.main(rest)
    if cmd == "push":
        return push.main(rest)
    if cmd == "vendor-base":
        return push.main_vendor_base(rest)
    ap = argparse.ArgumentParser(prog=f"paved-images {cmd}")
    if cmd == "layer":
        ap.add_argument("--manifest", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--info", required=True)
        return build.main_layer(ap.parse_args(rest))
    if cmd == "image":
        ap.add_argument("--out", required=True)
        ap.add_argument("--spec", required=True)
        ap.add_argument("--layer", action="append", default=[], help="TAR=INFO_JSON")
        ap.add_argument("--base")
        ap.add_argument("--lock")
        ap.add_argument("--status", help="Bazel's stable-status.txt (source revision)")
        ap.add_argument("--digest-out")
        return build.main_image(ap.parse_args(rest))
    if cmd == "backend-manifest":
        ap.add_argument("src", help="a vllm_backend checkout's src/ directory")
        args = ap.parse_args(rest)
        print("vllm_backend_imports = " + json.dumps(compat.backend_manifest(args.src), indent=2))
        return 0
    if cmd == "patch-backend":
        ap.add_argument("--lock", required=True)
        ap.add_argument("src", help="a vllm_backend checkout's src/ directory (edited in place)")
        args = ap.parse_args(rest)
        lock = locks.load(args.lock)
        if lock.triton is None:
            print(f"{args.lock} pins no Triton release", file=sys.stderr)
            return 1
        for change in compat.rewrite_backend(args.src, lock.triton.vllm_backend_rewrites):
            print(change)
        got = set(compat.backend_manifest(args.src))
        want = set(lock.triton.effective_imports())
        if got != want:
            print(
                f"after the rewrites the backend imports {sorted(got ^ want)} differently from the lock",
                file=sys.stderr,
            )
            return 1
        return 0
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
