#!/usr/bin/env bash
# Lint + format check of every Python file in the source tree (not only those in a target).
# Tagged `external` so it always runs: it reads the tree directly, which Bazel cannot track.
set -euo pipefail
cfg="$(readlink -f "$1")"
ruff="$(readlink -f "$2")"
root="$(dirname "$cfg")"
cd "$root"
"$ruff" check --no-cache --config "$cfg" .
"$ruff" format --no-cache --check --config "$cfg" .
