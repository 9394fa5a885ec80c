#!/usr/bin/env bash
# Builds kube-apiserver and kube-controller-manager from Debian's `kubernetes` source package
# (no registry ships them; ../shared/FIELD_NOTES.md, "Kubernetes") and prints the folder that
# holds them. The binaries are cached outside the repository, keyed by the source package's
# version and RECIPE (bump it when the build steps change), so only the first run on a machine
# pays the build (about 4-6 minutes on 2 cores); later runs print the cached folder in well under
# a second.
#
# Robust to a second run and to apt being offline:
# - one run at a time per cache (flock on <cache>/.lock): a run started during a build waits
#   for it and then prints what it built;
# - the deb-src lists are refreshed at most once a day; when that refresh fails (offline), the
#   lists already there are used, and with none, the newest cached build of this RECIPE; when
#   a newer source version cannot be downloaded or built, an older cached build is printed
#   (with a warning on stderr). Only with no usable build at all does it fail (exit 1).
#
# Usage: tools/k8s/build_apiserver.sh            -> prints the bin folder on stdout (only that)
# Env:   PAVED_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/paved)
set -euo pipefail

cache_root="${PAVED_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/paved}/kubernetes"
RECIPE=1
GO=/usr/lib/go-1.19/bin

log() { printf 'build_apiserver: %s\n' "$*" >&2; }
die() { printf 'build_apiserver: %s\n' "$*" >&2; exit 1; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

mkdir -p "$cache_root"
exec {lock_fd}>"$cache_root/.lock"
if ! flock -n "$lock_fd"; then
  log "another run holds $cache_root/.lock (a build in progress); waiting for it (at most 60 min)"
  flock -w 3600 "$lock_fd" || die "still locked after 60 min: $cache_root/.lock"
fi

# The machine's own apt lists stay untouched: deb-src entries for the same archives live in
# a private sources dir and lists dir, passed to apt with -o.
apt_dir="$cache_root/apt"
apt_opts=(-o "Dir::Etc::sourcelist=/dev/null" -o "Dir::Etc::sourceparts=$apt_dir/sources"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::archives=$apt_dir/archives")

has_binaries() { [[ -x $1/kube-apiserver && -x $1/kube-controller-manager ]]; }

# The newest cached build of this RECIPE, whatever its source version.
cached_build() {
  local d
  while IFS= read -r d; do
    has_binaries "$d" && { echo "$d"; return 0; }
  done < <(compgen -G "$cache_root/*-r$RECIPE/bin" | sort -V -r)
  return 1
}

source_version() {
  mkdir -p "$apt_dir/sources" "$apt_dir/lists/partial" "$apt_dir/archives/partial"
  local src
  for src in /etc/apt/sources.list.d/*.sources; do
    [[ -f $src ]] || continue
    sed -e 's/^Types:.*/Types: deb-src/' "$src" > "$apt_dir/sources/$(basename "$src")"
  done
  if [[ -f /etc/apt/sources.list ]]; then
    sed -n -e 's/^deb /deb-src /p' /etc/apt/sources.list > "$apt_dir/sources/main.list"
  fi
  # One update per day at most: the version pins the cache key. Offline, it fails fast and
  # the lists (or builds) already cached stand.
  if [[ -z $(find "$apt_dir/lists" -maxdepth 1 -name '*Sources*' -mmin -1440 2>/dev/null) ]]; then
    apt-get "${apt_opts[@]}" -o Acquire::Retries=0 -o Acquire::http::Timeout=20 update >&2 \
      || log "apt-get update for deb-src failed; using what is already cached"
  fi
  { apt-cache "${apt_opts[@]}" showsrc kubernetes 2>/dev/null || true; } | sed -n 's/^Version: //p' | sort -V | tail -1
}

# The recipe (RECIPE=1). Runs in a subshell of its own: any failing step ends it.
build_into() {
  local out="$1" version="$2" p work orig
  for p in golang-1.19-go rsync jq; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || {
      log "installing golang-1.19-go rsync jq with apt (one time)"
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y golang-1.19-go rsync jq >&2
      break
    }
  done
  work="$(mktemp -d "$cache_root/build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  log "building kube-apiserver and kube-controller-manager $version (first time on this machine: minutes)"
  (cd "$work" && apt-get "${apt_opts[@]}" source --download-only "kubernetes=$version" >&2)
  orig="$(compgen -G "$work/kubernetes_*.orig.tar.gz" | head -1)"
  [[ -f $orig ]] || die "apt-get source gave no .orig.tar.gz"
  mkdir "$work/src"
  tar -xzf "$orig" -C "$work/src" --strip-components=1
  cd "$work/src"
  # Debian's own layout: a GOPATH in which the tree is k8s.io/kubernetes (plain `go build
  # -mod=vendor` fails with "updates to go.mod needed").
  mkdir -p .go/src/k8s.io
  ln -s ../../.. .go/src/k8s.io/kubernetes
  mkdir -p "$work/home"
  GOPATH="$PWD/.go" GOCACHE="$work/gocache" HOME="$work/home" CGO_ENABLED=0 PATH="$GO:$PATH" \
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >&2
  rm -rf "$out.tmp"
  mkdir -p "$out.tmp"
  cp _output/bin/kube-apiserver _output/bin/kube-controller-manager "$out.tmp/"
  mv "$out.tmp" "$out"
}

version="$(source_version)"
if [[ -z $version ]]; then
  if out="$(cached_build)"; then
    log "no deb-src lists (apt offline?); using the cached $out"
    echo "$out"
    exit 0
  fi
  die "no 'kubernetes' source package in the machine's Debian archives (see apt-get update's error above) and no cached build under $cache_root"
fi
out="$cache_root/$version-r$RECIPE/bin"
if has_binaries "$out"; then
  echo "$out"
  exit 0
fi
start=$SECONDS
# In the background so that errexit holds inside it (it does not in an `if` condition).
( build_into "$out" "$version" ) &
if ! wait $!; then
  if older="$(cached_build)"; then
    log "building $version failed; using the older cached $older"
    echo "$older"
    exit 0
  fi
  die "building $version failed (output above); retry with: $0"
fi
log "built in $((SECONDS - start)) s; cached in $out"
echo "$out"
