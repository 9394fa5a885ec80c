"""Package URI -> verified local model directory in the cache.

Sources: a directory (local path, `file://`, or `s3://bucket/prefix` holding `model.json`) or
a tarball (`.tar`, `.tar.gz`, `.tgz`; local or on S3) with `model.json` at its root.

Warm start: the cache's ref for the URI names a complete package whose files all have their
manifest sizes -> done, without any network access (package URIs are treated as immutable:
publish a new version under a new URI, or pass `refresh=True` to re-read model.json).
Cold start: read model.json, then fetch each file whose blob is missing, verify its sha256
against the manifest, commit it to the blob store, hardlink everything into a staging
directory (plus installed plugin wheels) and rename it into place. A file whose sha256 does not
match is fetched once more (a flip in transit), then the start fails; nothing partial stays.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from paved.launcher import plugins
from paved.launcher.build import sha256_file
from paved.launcher.cache import Cache, FileLock
from paved.launcher.package import (
    MODEL_JSON,
    ModelPackage,
    PackageError,
    is_absolute_uri,
    join_uri,
    parse_model_json,
)
from paved.launcher.progress import Progress, human_bytes
from paved.launcher.storage import MODEL_JSON_LIMIT, Downloader, Fetch, TransferError, local_path

log = logging.getLogger("paved.launcher")
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class ChecksumError(RuntimeError):
    """A fetched file does not match the sha256 of the package manifest."""


class CacheBudgetError(RuntimeError):
    """The package's missing bytes exceed the cache's whole budget; the cache was not touched."""


@dataclass
class Materialized:
    uri: str
    digest: str
    package: ModelPackage
    package_dir: str
    model_dir: str
    plugin_dir: str | None
    warm: bool
    seconds: float
    fetched_bytes: int = 0
    fetched_files: int = 0
    # Shared "in use" lock on the package, held until the process exits (eviction skips it).
    hold: FileLock | None = field(default=None, repr=False)

    def summary(self) -> dict:
        return {
            "uri": self.uri,
            "model_id": self.package.model_id,
            "version": self.package.version,
            "mode": self.package.mode,
            "digest": self.digest,
            "model_dir": self.model_dir,
            "plugin_dir": self.plugin_dir,
            "warm": self.warm,
            "seconds": round(self.seconds, 3),
            "fetched_bytes": self.fetched_bytes,
            "fetched_files": self.fetched_files,
        }


@dataclass(frozen=True)
class _Need:
    """One blob to obtain: where from (uri, or a member of the package tarball) and what it is."""

    sha256: str
    size: int
    label: str
    uri: str | None = None
    member: str | None = None


def is_tarball(uri: str) -> bool:
    return uri.endswith(TAR_SUFFIXES)


class Materializer:
    def __init__(
        self,
        cache: Cache,
        downloader: Downloader | None = None,
        verify: bool = False,
        progress_tty: bool | None = None,
    ):
        self.cache = cache
        self.downloader = downloader or Downloader()
        self.verify = verify
        self.progress_tty = progress_tty

    # -- public ------------------------------------------------------------------------------
    def materialize(self, uri: str, refresh: bool = False) -> Materialized:
        t0 = time.monotonic()
        if not refresh:
            warm = self._warm(uri, t0)
            if warm is not None:
                return warm
        cache = self.cache
        package = None
        if is_tarball(uri):
            estimate = self.downloader.head_size(uri)
        else:
            package = parse_model_json(
                self.downloader.read_small(join_uri(uri, MODEL_JSON)), join_uri(uri, MODEL_JSON)
            )
            estimate = self._missing_bytes(uri, package, False)
        if cache.max_bytes is not None:
            # Evicting could not make room, only empty the cache for nothing (a manifest's
            # sizes are whatever its author wrote: 1 PiB would evict every package).
            self._check_budget(uri, estimate, "nothing was evicted")
            # Make room first; evicting needs the gc lock exclusively, so not while we hold it.
            cache.evict(cache.max_bytes - estimate)  # clears tmp/ too
        else:
            # Without a budget nothing evicts, and a crashed launcher's partial downloads would
            # fill the disk over the restarts.
            cache.clean_tmp()
        hold = None
        try:
            with ExitStack() as stack:
                # Shared gc lock: nobody evicts (or clears tmp/) while this launcher fetches.
                stack.enter_context(cache.lock("gc").held(shared=True))
                tar = None
                if package is None:
                    tar = stack.enter_context(self._open_tarball(uri))
                    package = parse_model_json(_tar_model_json(tar, uri), join_uri(uri, MODEL_JSON))
                    if cache.max_bytes is not None:
                        # The tarball's size was only a guess: its manifest may name blobs
                        # outside it (absolute URIs), or compress well. Checked before fetching.
                        needed = self._missing_bytes(uri, package, True)
                        self._check_budget(uri, needed, "nothing was fetched")
                digest = package.digest()
                hold = cache.hold(digest)
                result = self._cold(uri, package, digest, tar, t0)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        result.hold = hold
        if cache.max_bytes is not None:
            cache.evict(cache.max_bytes, protect=frozenset({digest}))
        return result

    def _missing_bytes(self, uri: str, package: ModelPackage, from_tar: bool) -> int:
        """What the package's blobs not yet in the cache add up to."""
        return sum(
            n.size for n in self._needs(uri, package, from_tar) if not self.cache.has_blob(n.sha256, n.size)
        )

    def _check_budget(self, uri: str, needed: int, outcome: str) -> None:
        budget = self.cache.max_bytes
        if budget is not None and needed > budget:
            raise CacheBudgetError(
                f"{uri}: the package needs {human_bytes(needed)} ({needed} bytes) not in the "
                f"cache, more than its whole budget of {human_bytes(budget)} "
                f"({budget} bytes, --cache-max-bytes); {outcome}"
            )

    # -- warm --------------------------------------------------------------------------------
    def _warm(self, uri: str, t0: float) -> Materialized | None:
        digest = self.cache.read_ref(uri)
        if not digest:
            return None
        hold = self.cache.hold(digest)
        package = self._complete_package(digest)
        if package is None:
            hold.release()
            return None
        self.cache.touch(digest)
        m = self._result(uri, package, digest, warm=True, t0=t0)
        m.hold = hold
        log.info(
            "package %s:%s (%s) warm in the cache: %s",
            package.model_id,
            package.version,
            digest[:12],
            m.model_dir,
        )
        return m

    def _complete_package(self, digest: str) -> ModelPackage | None:
        """The package if its directory is complete (sizes, or hashes with verify=True); None
        if it is absent or damaged (the caller rebuilds it). A model.json that does not parse
        (cut short by a power loss, say) is damage like a missing file, not a malformed
        package: it was validated before it was written."""
        pdir = self.cache.package_dir(digest)
        try:
            with open(os.path.join(pdir, MODEL_JSON), "rb") as f:
                package = parse_model_json(f.read(), os.path.join(pdir, MODEL_JSON))
        except FileNotFoundError:
            return None
        except (PackageError, OSError) as e:
            log.warning(
                "cache: package %s is damaged (%s: %s); materializing it again", digest[:12], MODEL_JSON, e
            )
            return None
        for _, entry in package.model_files():
            path = os.path.join(pdir, "model", entry.path)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            intact = st is not None and st.st_size == entry.size
            if intact and (not self.verify or sha256_file(path) == entry.sha256):
                continue
            log.warning("cache: package %s is damaged (%s); materializing it again", digest[:12], path)
            blob = self.cache.blob_path(entry.sha256)
            with contextlib.suppress(FileNotFoundError):
                if st is not None and os.stat(blob).st_ino == st.st_ino:
                    os.unlink(blob)  # the blob itself is bad: fetch it again
            return None
        return package

    # -- cold --------------------------------------------------------------------------------
    def _cold(
        self, uri: str, package: ModelPackage, digest: str, tar: tarfile.TarFile | None, t0: float
    ) -> Materialized:
        """Under the shared gc lock: materialize once per host (the package lock)."""
        cache = self.cache
        needs = self._needs(uri, package, tar is not None)
        with cache.lock(f"pkg-{digest}").held(
            waiting=lambda: log.info("package %s: another launcher is materializing it; waiting", digest[:12])
        ):
            if self._complete_package(digest) is not None:
                cache.touch(digest)
                cache.write_ref(uri, digest)
                log.info("package %s materialized by another launcher", digest[:12])
                return self._result(uri, package, digest, warm=True, t0=t0)
            if os.path.exists(cache.package_dir(digest)):  # damaged: rebuild it
                trash = cache.temp_path(f"damaged-{digest[:12]}")
                os.rename(cache.package_dir(digest), trash)
                shutil.rmtree(trash, ignore_errors=True)
            fetched_bytes, fetched_files = self._obtain(needs, tar)
            self._assemble(package, digest)
            cache.touch(digest)
            cache.write_ref(uri, digest)
        m = self._result(uri, package, digest, warm=False, t0=t0)
        m.fetched_bytes, m.fetched_files = fetched_bytes, fetched_files
        log.info(
            "package %s:%s (%s) materialized in %.2fs (%d files, %s fetched): %s",
            package.model_id,
            package.version,
            digest[:12],
            m.seconds,
            fetched_files,
            human_bytes(fetched_bytes),
            m.model_dir,
        )
        return m

    def _needs(self, uri: str, package: ModelPackage, from_tar: bool) -> list[_Need]:
        """One entry per distinct blob, located by an absolute uri or a package-relative path."""
        needs: dict[str, _Need] = {}

        def add(sha: str, size: int, label: str, where: str) -> None:
            if sha in needs:
                return
            if is_absolute_uri(where):
                needs[sha] = _Need(sha, size, label, uri=where)
            elif from_tar:
                needs[sha] = _Need(sha, size, label, member=where)
            else:
                needs[sha] = _Need(sha, size, label, uri=join_uri(uri, where))

        for artifact, entry in package.model_files():
            add(entry.sha256, entry.size, entry.path, join_uri(artifact.uri, entry.path))
        for wheel in package.plugins:
            add(wheel.sha256, wheel.size, wheel.filename, wheel.uri)
        return list(needs.values())

    def _obtain(self, needs: list[_Need], tar: tarfile.TarFile | None) -> tuple[int, int]:
        """Fetch and commit every missing blob. Returns (bytes, files) fetched by this process."""
        cache = self.cache
        todo = [n for n in needs if not cache.has_blob(n.sha256, n.size)]
        if not todo:
            return 0, 0
        progress = Progress(sum(n.size for n in todo), label="materialize", tty=self.progress_tty)
        fetched_bytes = fetched_files = 0
        try:
            theirs = []
            with ExitStack() as locks:
                mine = []
                for n in todo:
                    lock = cache.lock(f"blob-{n.sha256}")
                    if lock.acquire(blocking=False):
                        locks.callback(lock.release)
                        if cache.has_blob(n.sha256, n.size):
                            # Committed by another launcher between our check and our lock:
                            # fetching it again would replace a blob packages already link.
                            progress.add(n.size)
                        else:
                            mine.append(n)
                    else:
                        theirs.append((n, lock))
                b, f = self._fetch_verified(mine, tar, progress)
                fetched_bytes += b
                fetched_files += f
            # Our blobs are committed and their locks released before waiting for anyone else's
            # (two launchers each waiting for the other's blob would deadlock otherwise).
            for n, lock in theirs:
                with lock.held(
                    waiting=functools.partial(
                        log.info, "%s: another launcher is fetching it; waiting", n.label
                    )
                ):
                    if cache.has_blob(n.sha256, n.size):
                        progress.add(n.size)
                    else:  # the other launcher failed: fetch it ourselves
                        b, f = self._fetch_verified([n], tar, progress)
                        fetched_bytes += b
                        fetched_files += f
        finally:
            progress.close()
        return fetched_bytes, fetched_files

    def _fetch_verified(
        self, needs: list[_Need], tar: tarfile.TarFile | None, progress: Progress, attempt: int = 1
    ) -> tuple[int, int]:
        if not needs:
            return 0, 0
        temps = {self.cache.temp_path(n.sha256[:16]): n for n in needs}
        try:
            got: dict[str, str] = {}
            remote = [Fetch(n.uri, n.size, tmp, n.label) for tmp, n in temps.items() if n.uri is not None]
            got.update(self.downloader.fetch_all(remote, progress))
            for tmp, n in temps.items():
                if n.member is not None:
                    assert tar is not None  # noqa: S101 - members come only from a tarball
                    got[tmp] = _extract_member(tar, n, tmp, progress)
            bad = [(tmp, n) for tmp, n in temps.items() if got[tmp] != n.sha256]
            for tmp, n in temps.items():
                if got[tmp] == n.sha256:
                    self.cache.commit_blob(tmp, n.sha256)
            if bad:
                for tmp, n in bad:
                    progress.add(-n.size)
                    os.unlink(tmp)
                if attempt == 1:
                    log.warning("sha256 mismatch for %s; fetching again", ", ".join(n.label for _, n in bad))
                    b, f = self._fetch_verified([n for _, n in bad], tar, progress, attempt=2)
                    return sum(n.size for n in needs) - sum(n.size for _, n in bad) + b, len(needs) - len(
                        bad
                    ) + f
                raise ChecksumError(
                    "; ".join(
                        f"{n.label}: sha256 mismatch (manifest {n.sha256}, fetched {got[tmp]})"
                        for tmp, n in bad
                    )
                )
            return sum(n.size for n in needs), len(needs)
        finally:
            for tmp in temps:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    def _assemble(self, package: ModelPackage, digest: str) -> None:
        cache = self.cache
        staging = cache.temp_path(f"pkg-{digest[:12]}")
        try:
            model = os.path.join(staging, "model")
            os.makedirs(model)
            for _, entry in package.model_files():
                dest = os.path.join(model, *entry.path.split("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.link(cache.blob_path(entry.sha256), dest)
            if package.plugins:
                plugins.install_wheels(
                    [(w.filename, cache.blob_path(w.sha256)) for w in package.plugins],
                    os.path.join(staging, "plugins"),
                )
            with open(os.path.join(staging, MODEL_JSON), "w") as f:
                json.dump(package.model_dump(mode="json"), f, indent=2, sort_keys=True)
                # Its presence marks the package complete: on disk before the rename publishes it.
                f.flush()
                os.fsync(f.fileno())
            cache.publish_package(staging, digest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _result(self, uri: str, package: ModelPackage, digest: str, warm: bool, t0: float) -> Materialized:
        pdir = self.cache.package_dir(digest)
        return Materialized(
            uri=uri,
            digest=digest,
            package=package,
            package_dir=pdir,
            model_dir=os.path.join(pdir, "model"),
            plugin_dir=os.path.join(pdir, "plugins") if package.plugins else None,
            warm=warm,
            seconds=time.monotonic() - t0,
        )

    @contextmanager
    def _open_tarball(self, uri: str) -> Iterator[tarfile.TarFile]:
        if not uri.startswith("s3://"):
            with tarfile.open(local_path(uri)) as tar:
                yield tar
            return
        size = self.downloader.head_size(uri)
        tmp = self.cache.temp_path("tarball")
        try:
            progress = Progress(size, label="package tarball", tty=self.progress_tty)
            self.downloader.fetch_all([Fetch(uri, size, tmp, os.path.basename(uri))], progress)
            progress.close()
            with tarfile.open(tmp) as tar:
                yield tar
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _tar_model_json(tar: tarfile.TarFile, uri: str) -> bytes:
    try:
        member = tar.extractfile(MODEL_JSON)
    except KeyError:
        member = None
    if member is None:
        raise TransferError(f"{uri} has no {MODEL_JSON} at its root")
    data = member.read(MODEL_JSON_LIMIT + 1)
    if len(data) > MODEL_JSON_LIMIT:
        raise TransferError(f"{uri}: its {MODEL_JSON} is larger than {MODEL_JSON_LIMIT} bytes")
    return data


def _extract_member(tar: tarfile.TarFile, need: _Need, dest: str, progress: Progress) -> str:
    try:
        info = tar.getmember(need.member or "")
    except KeyError:
        raise TransferError(f"{need.label}: {need.member} is not in the package tarball") from None
    if not info.isfile() or info.size != need.size:
        raise TransferError(
            f"{need.label}: size mismatch: the manifest says {need.size}, the tarball {info.size}"
        )
    h = hashlib.sha256()
    src = tar.extractfile(info)
    assert src is not None  # noqa: S101 - _check_member admitted only regular files
    with open(dest, "wb") as out:
        while chunk := src.read(4 << 20):
            h.update(chunk)
            out.write(chunk)
            progress.add(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()
