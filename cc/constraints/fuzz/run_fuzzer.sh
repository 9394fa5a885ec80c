#!/usr/bin/env bash
# sh_test body: a short, bounded libFuzzer run of one target over its committed seed corpus.
# Usage: run_fuzzer.sh FUZZER SEED_DIR
# Bounds (override with --test_env): FUZZ_SECONDS (default 20), FUZZ_RUNS (default 10000000),
# FUZZ_SEED (default 1: the same inputs on every run, so a red CI is reproducible; give another
# seed, or 0 for a random one, to explore). Crash reproducers land in the test's undeclared
# outputs (bazel-testlogs/.../test.outputs/); add them to the corpus when fixing the bug.
set -euo pipefail
fuzzer="$1"
seeds="$2"
[[ -x $fuzzer ]] || { echo "run_fuzzer.sh: $fuzzer is not an executable" >&2; exit 2; }
[[ -n $(ls -A "$seeds") ]] || { echo "run_fuzzer.sh: empty seed corpus $seeds" >&2; exit 2; }

work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-$work/..}/"
mkdir -p "$work"
# Leaks count as findings too (LeakSanitizer works inside Bazel's linux-sandbox here).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# New inputs go to the scratch directory first; the committed seeds are only read.
exec "$fuzzer" \
  -seed="${FUZZ_SEED:-1}" \
  -runs="${FUZZ_RUNS:-10000000}" \
  -max_total_time="${FUZZ_SECONDS:-20}" \
  -max_len=4096 \
  -timeout=30 \
  -rss_limit_mb=2048 \
  -print_final_stats=1 \
  -artifact_prefix="$artifacts" \
  "$work" "$seeds"
