#!/usr/bin/env bash
# Bazel --workspace_status_command: the source revision images record in the label
# org.opencontainers.image.revision. STABLE_ keys go to stable-status.txt, so a new revision
# rebuilds the images that carry it and nothing else. "-dirty" marks tracked local edits.
set -euo pipefail
rev="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [[ $rev != unknown ]] && ! git diff --quiet HEAD -- 2>/dev/null; then
  rev="${rev}-dirty"
fi
echo "STABLE_PAVED_REVISION ${rev}"
