#!/usr/bin/env bash
# Genrule tool: builds the libFuzzer binaries with clang (Bazel 4's auto-configured C++
# toolchain is gcc, which has no libFuzzer). Usage: build_fuzzers.sh OUT_DIR SOURCES...
# Library sources are compiled once and linked into every `*_fuzzer.cc` given; each binary
# is written as OUT_DIR/<name>_fuzzer.
set -euo pipefail
out_dir="$1"
shift

cxx="${PAVED_FUZZ_CXX:-}"
if [[ -z $cxx ]]; then
  for candidate in clang++-14 clang++; do
    if command -v "$candidate" >/dev/null 2>&1; then cxx="$candidate"; break; fi
  done
fi
if [[ -z $cxx ]]; then
  echo "build_fuzzers.sh: clang++ not found; the fuzz targets need clang and libFuzzer:" >&2
  echo "  sudo apt-get install -y clang-14 libclang-rt-14-dev   (tools/bazel installs them)" >&2
  exit 1
fi

flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined
       -fno-sanitize-recover=all -I.)
lib_sources=()
fuzzers=()
for src in "$@"; do
  case "$src" in
    *_fuzzer.cc) fuzzers+=("$src") ;;
    *.cc) lib_sources+=("$src") ;;
  esac
done

obj_dir="$(mktemp -d)"
trap 'rm -rf "$obj_dir"' EXIT
# Two compilers at a time: the machines this runs on have two cores.
pids=()
objs=()
for src in "${lib_sources[@]}"; do
  obj="$obj_dir/$(basename "${src%.cc}").o"
  objs+=("$obj")
  "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$obj" &
  pids+=($!)
  if (( ${#pids[@]} >= 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for pid in "${pids[@]}"; do wait "$pid"; done

for src in "${fuzzers[@]}"; do
  name="$(basename "${src%.cc}")"
  "$cxx" "${flags[@]}" -fsanitize=fuzzer "$src" "${objs[@]}" -o "$out_dir/$name"
done
