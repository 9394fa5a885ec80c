"""Content-addressed local model cache (the FSx / node-local-disk role).

Layout under the cache root:

    blobs/sha256/<hex>           one verified, read-only file per distinct content
    packages/<digest>/           one materialized package (digest = sha256 of its model.json)
        model/...                the Hugging Face model directory: hardlinks into blobs/
        plugins/...              the package's plugin wheels, installed (only if it has any)
        model.json               the validated manifest
        .last_used               mtime = last start that used the package (LRU)
    refs/<sha256(uri)>.json      package URI -> digest: a warm start reads no model.json remotely
    locks/                       flock(2) files (see below)
    tmp/                         downloads and package assembly in progress (same filesystem)

Every entry appears by one atomic rename of a finished, verified temp file or directory, so a
crash or a checksum failure never leaves a partial entry. Blob reference counts are the
filesystem's link counts: a blob with st_nlink == 1 belongs to no package.

Locks (flock, released by the kernel when a process dies):
  * gc.lock: shared while a launcher materializes; exclusive (non-blocking) to evict, and to
    clear tmp/ at each cold start (budget or not). Eviction and clearing never run under
    someone's download and never wait for one.
  * pkg-<digest>.lock: exclusive while a package is materialized; a second launcher of the same
    package waits, then finds it complete (one download per host).
  * blob-<hex>.lock: exclusive while a blob is fetched (packages sharing a file).
  * inuse-<digest>.lock: shared for a launcher's whole life; eviction skips packages whose lock
    it cannot take exclusively.
A blocking acquire waits at most the cache's `lock_timeout_s` (default 3600 s, the launcher's
--lock-timeout), then fails with LockTimeout naming the lock and the pid of the process holding
it: an exclusive holder writes its pid into the lock file (shared holders would overwrite each
other's, so they write none; nobody blocks on a shared holder: eviction never waits).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger("paved.launcher")


DEFAULT_LOCK_TIMEOUT_S = 3600.0


class LockTimeout(TimeoutError):
    """A cache lock was not acquired within its deadline; the message names the holder."""


class FileLock:
    """An flock(2) on `path`, safe against the lock file being unlinked by another holder."""

    def __init__(self, path: str, timeout_s: float | None = DEFAULT_LOCK_TIMEOUT_S):
        self.path = path
        self.timeout_s = timeout_s
        self.fd = -1
        self._exclusive = False

    def acquire(
        self,
        shared: bool = False,
        blocking: bool = True,
        waiting: Callable[[], None] | None = None,
        poll_s: float = 0.05,
        timeout_s: float | None = None,
    ) -> bool:
        """Take the lock; False only when not `blocking` and it is held. A blocking acquire
        raises LockTimeout after `timeout_s` (default: the lock's own; None: wait forever)."""
        op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        told = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if not blocking:
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    raise LockTimeout(
                        f"cache lock {self.path} not acquired within {limit:g} s (lock timeout): "
                        f"{self.holder_description()}"
                    ) from None
                if waiting and not told:
                    waiting()
                    told = True
                pause = poll_s if deadline is None else min(poll_s, max(deadline - time.monotonic(), 0))
                time.sleep(pause)
                poll_s = min(poll_s * 1.5, 0.5)
                continue
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                self._exclusive = not shared
                if self._exclusive:
                    self._write_pid(str(os.getpid()))
                return True
            os.close(fd)  # unlinked between open and flock: lock the new file instead

    def _write_pid(self, text: str) -> None:
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode(), 0)
        except OSError:
            pass  # the pid is a diagnostic; the lock itself is held

    def holder(self) -> int | None:
        """The pid the current exclusive holder wrote, if any."""
        try:
            with open(self.path, "rb") as f:
                text = f.read(32).decode("ascii", "replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def holder_description(self) -> str:
        pid = self.holder()
        if pid is None:
            return "held by another process (it wrote no pid: a shared holder, or an older launcher)"
        # A pid of the holder's pid namespace: another container sharing the cache has its own.
        return f"held by pid {pid}"

    def release(self) -> None:
        if self.fd >= 0:
            if self._exclusive:
                self._write_pid("")  # no stale pid for the next (shared) holders
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def held(self, shared: bool = False, waiting: Callable[[], None] | None = None) -> Iterator[None]:
        self.acquire(shared=shared, waiting=waiting)
        try:
            yield
        finally:
            self.release()


@dataclass(frozen=True)
class EvictionReport:
    before_bytes: int
    after_bytes: int
    packages: tuple[str, ...]
    blobs: int
    skipped_in_use: tuple[str, ...]


class Cache:
    def __init__(
        self, root: str, max_bytes: int | None = None, lock_timeout_s: float | None = DEFAULT_LOCK_TIMEOUT_S
    ):
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.lock_timeout_s = lock_timeout_s
        for sub in ("blobs/sha256", "packages", "refs", "locks", "tmp"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)

    # -- paths -------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> str:
        return os.path.join(self.root, "blobs", "sha256", sha256)

    def package_dir(self, digest: str) -> str:
        return os.path.join(self.root, "packages", digest)

    def lock(self, name: str) -> FileLock:
        return FileLock(os.path.join(self.root, "locks", name + ".lock"), self.lock_timeout_s)

    def temp_path(self, hint: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in hint)[-60:]
        return os.path.join(self.root, "tmp", f"{safe}.{os.getpid()}.{uuid.uuid4().hex[:8]}")

    # -- blobs -------------------------------------------------------------------------------
    def has_blob(self, sha256: str, size: int) -> bool:
        try:
            return os.stat(self.blob_path(sha256)).st_size == size
        except FileNotFoundError:
            return False

    def commit_blob(self, tmp: str, sha256: str) -> str:
        """Move a verified temp file into the store (read-only). Idempotent."""
        dest = self.blob_path(sha256)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        return dest

    # -- refs (package URI -> digest) ----------------------------------------------------------
    def _ref_path(self, uri: str) -> str:
        return os.path.join(self.root, "refs", hashlib.sha256(uri.encode()).hexdigest() + ".json")

    def read_ref(self, uri: str) -> str | None:
        try:
            with open(self._ref_path(uri)) as f:
                ref = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        return ref.get("digest") if ref.get("uri") == uri else None

    def write_ref(self, uri: str, digest: str) -> None:
        tmp = self.temp_path("ref")
        with open(tmp, "w") as f:
            json.dump({"uri": uri, "digest": digest, "written": time.time()}, f)
        os.replace(tmp, self._ref_path(uri))

    # -- packages ----------------------------------------------------------------------------
    def has_package(self, digest: str) -> bool:
        return os.path.isfile(os.path.join(self.package_dir(digest), "model.json"))

    def publish_package(self, staging: str, digest: str) -> bool:
        """Atomically rename a fully assembled staging dir into place; False if one exists."""
        try:
            os.rename(staging, self.package_dir(digest))
            return True
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(staging, ignore_errors=True)
            return False

    def touch(self, digest: str) -> None:
        marker = os.path.join(self.package_dir(digest), ".last_used")
        with open(marker, "a"):
            pass
        os.utime(marker)

    def hold(self, digest: str) -> FileLock:
        """Mark a package in use for this process's lifetime (eviction skips it)."""
        lock = self.lock(f"inuse-{digest}")
        lock.acquire(shared=True)
        return lock

    # -- eviction ----------------------------------------------------------------------------
    def usage_bytes(self) -> int:
        total = 0
        with os.scandir(os.path.join(self.root, "blobs", "sha256")) as it:
            for e in it:
                with contextlib.suppress(FileNotFoundError):
                    total += e.stat(follow_symlinks=False).st_size
        return total

    def evict(self, target_bytes: int, protect: frozenset[str] = frozenset()) -> EvictionReport | None:
        """Evict least recently used packages (never in-use or protected ones) and unreferenced
        blobs until blobs take at most `target_bytes`. Returns None when another launcher is
        materializing (eviction is skipped, never waited for)."""
        gc = self.lock("gc")
        if not gc.acquire(blocking=False):
            log.info("cache: eviction skipped, another launcher is materializing")
            return None
        try:
            before = self.usage_bytes()
            self._clear_tmp()
            evicted: list[str] = []
            skipped: list[str] = []
            blobs = self._drop_unreferenced_blobs()
            usage = self.usage_bytes()
            for digest in self._packages_lru():
                if usage <= target_bytes:
                    break
                if digest in protect:
                    continue
                inuse = self.lock(f"inuse-{digest}")
                if not inuse.acquire(blocking=False):
                    skipped.append(digest)
                    continue
                try:
                    trash = self.temp_path(f"evict-{digest[:12]}")
                    os.rename(self.package_dir(digest), trash)
                    shutil.rmtree(trash, ignore_errors=True)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(inuse.path)
                finally:
                    inuse.release()
                evicted.append(digest)
                blobs += self._drop_unreferenced_blobs()
                usage = self.usage_bytes()
            self._drop_dangling_refs()
            report = EvictionReport(before, usage, tuple(evicted), blobs, tuple(skipped))
            if evicted or blobs:
                log.info(
                    "cache: evicted %d package(s), %d blob(s): %d -> %d bytes (budget %d)",
                    len(evicted),
                    blobs,
                    before,
                    usage,
                    target_bytes,
                )
            if usage > target_bytes:
                log.warning(
                    "cache: %d bytes still above the %d-byte budget (in use: %s)",
                    usage,
                    target_bytes,
                    ", ".join(d[:12] for d in skipped) or "none",
                )
            return report
        finally:
            gc.release()

    def clean_tmp(self) -> bool:
        """Remove what crashed launchers left in tmp/ (half-written downloads, staging dirs).
        Only under the exclusive gc lock, taken without waiting: every writer of tmp/ holds it
        shared, so nothing of a live download goes. False (nothing removed) if it is held."""
        gc = self.lock("gc")
        if not gc.acquire(blocking=False):
            return False
        try:
            self._clear_tmp()
        finally:
            gc.release()
        return True

    def _clear_tmp(self) -> None:
        """Caller holds the gc lock exclusively."""
        for name in os.listdir(os.path.join(self.root, "tmp")):
            self._remove(os.path.join(self.root, "tmp", name))

    def _packages_lru(self) -> list[str]:
        entries = []
        for digest in os.listdir(os.path.join(self.root, "packages")):
            d = self.package_dir(digest)
            try:
                used = os.stat(os.path.join(d, ".last_used")).st_mtime
            except FileNotFoundError:
                used = os.stat(d).st_mtime
            entries.append((used, digest))
        return [d for _, d in sorted(entries)]

    def _drop_unreferenced_blobs(self) -> int:
        n = 0
        with os.scandir(os.path.join(self.root, "blobs", "sha256")) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if st.st_nlink <= 1:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.lock(f"blob-{e.name}").path)
                    n += 1
        return n

    def _drop_dangling_refs(self) -> None:
        refs = os.path.join(self.root, "refs")
        for name in os.listdir(refs):
            path = os.path.join(refs, name)
            try:
                with open(path) as f:
                    digest = json.load(f).get("digest", "")
            except (OSError, ValueError):
                digest = ""
            if not digest or not self.has_package(digest):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    @staticmethod
    def _remove(path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
