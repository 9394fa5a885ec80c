"""Shared fixtures of the image tests."""

import os
from pathlib import Path

import pytest


def _resolve(short: str) -> Path:
    root = Path(os.environ.get("TEST_SRCDIR", ".")) / os.environ.get("TEST_WORKSPACE", "paved")
    return (root / short).resolve() if short.startswith("../") else root / short


def _runfile(env_var: str, suffix: str = "") -> Path:
    """The runfile whose $(rootpath) Bazel put in `env_var` ("../repo/x" for external ones);
    for a $(rootpaths) list, the one whose name ends with `suffix`."""
    found = [_resolve(s) for s in os.environ[env_var].split() if s.endswith(suffix)]
    if len(found) != 1:
        raise LookupError(f"{env_var}={os.environ[env_var]!r} has {len(found)} files ending in {suffix!r}")
    return found[0]


@pytest.fixture(scope="session")
def runfile():
    """runfile(ENV_VAR[, suffix]) -> Path of the data file the BUILD target passed in that variable."""
    return _runfile
