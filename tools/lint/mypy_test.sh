#!/usr/bin/env bash
# Type check of the `paved` package (libs/paved) with pyproject.toml's [tool.mypy].
# Tagged `external` like ruff_test: it reads the source tree directly, which Bazel cannot track.
set -euo pipefail
cfg="$(readlink -f "$1")"
root="$(dirname "$cfg")"
cd "$root"
# The venv tools/bazel builds from the lock (the one @paved_venv points at).
mypy="$root/.venv/bin/mypy"
# A fresh cache per run: a cache in the tree could mask a change Bazel never saw.
"$mypy" --config-file "$cfg" --cache-dir "${TEST_TMPDIR:-$(mktemp -d)}/mypy_cache" -p paved
