"""Finding Bazel-built data (like //models/tiny) from a binary or test at run time."""

from __future__ import annotations

import os
import sys

WORKSPACE = "paved"
# The checkout this module was imported from when it is not a runfiles tree (direct pytest or
# python runs): Bazel-built outputs are found under its bazel-bin.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def runfile(path: str) -> str:
    """Absolute, symlink-resolved path of workspace-relative `path` in this process's runfiles.

    Looks where Bazel puts runfiles for `bazel run` / `bazel test` (RUNFILES_DIR, TEST_SRCDIR,
    `<main>.runfiles`), then relative to the working directory, then in the checkout's
    `bazel-bin` (a source checkout with the target built). The target must list the file in
    `data`.
    """
    roots = [os.environ.get("RUNFILES_DIR"), os.environ.get("TEST_SRCDIR")]
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main:
        roots.append(os.path.abspath(main).split(".runfiles" + os.sep)[0] + ".runfiles")
    for root in filter(None, roots):
        candidate = os.path.join(root, WORKSPACE, path)
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    for candidate in (path, os.path.join(_CHECKOUT, "bazel-bin", path)):
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    raise FileNotFoundError(
        f"{path} is not in this target's runfiles (add its label to `data`) nor built in "
        f"{_CHECKOUT}/bazel-bin"
    )


def tiny_model_dir() -> str:
    """//models/tiny: the default model of `bazel run //services/frontend:serve` and the tests'.

    Resolved (see `runfile`) because vLLM keys its compile cache on the model path, and the
    sandbox path differs on every run."""
    return os.path.dirname(runfile("models/tiny/config.json"))
