"""paved's OCI images: version locks, a deterministic image builder, a registry pusher and the
static vLLM compatibility checker that fails the build when pinned versions drift.

Standard library only (plus nothing): the Bazel rules in tools/build_defs/oci.bzl run it as
build actions, so it must not need the engine, torch or the C++ extension.
"""
