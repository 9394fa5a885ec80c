"""Byte transfers from S3 or local paths into temp files, hashed (sha256) on the way.

S3: every file larger than `part_size` is split into ranged GETs that run in parallel on one
thread pool shared by all files of a package (smaller files are one GET each, also in
parallel). Parts are written in place with `pwrite` into a preallocated temp file; the sha256
is computed in file order as soon as the leading parts are complete, overlapping hashing with
the download instead of re-reading the file at the end. Each part is retried on its own with
exponential backoff and jitter; a stream that keeps the socket alive but moves fewer than
`stall_min_bytes` in `stall_timeout_s` counts as failed (botocore's read_timeout is per socket
read, so a throttled stream would otherwise never end). Ranged GETs carry no checksum: the
caller compares the returned sha256 with the package manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from paved.launcher.progress import Progress

log = logging.getLogger("paved.launcher")

MiB = 1 << 20
# The most a package's model.json may hold (it lists files, it holds none).
MODEL_JSON_LIMIT = 16 * MiB
# Small reads: a read of urllib3's returns only once it has all its bytes (or the stream ends).
_CHUNK = 64 << 10
_NOT_RETRYABLE_CODES = {
    "NoSuchKey",
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidRange",
    "403",
    "404",
    "416",
}


class TransferError(RuntimeError):
    """A file could not be fetched (after retries, or a permanent error)."""


class _Retryable(Exception):
    pass


@dataclass(frozen=True)
class TransferConfig:
    workers: int = 8
    # Files above this are split into ranged GETs of this size. Large parts suit both real S3
    # (one connection streams ~100 MB/s) and servers that pay per request.
    part_size: int = 64 * MiB
    max_attempts: int = 5
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0
    stall_min_bytes: int = 1 * MiB
    # fsync each finished file before the cache renames it in: after a crash a blob is either
    # absent or complete (warm starts check sizes, not hashes).
    fsync: bool = True


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// uri: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"s3 uri {uri!r} names no bucket")
    return bucket, key


def local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def make_s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    addressing_style: str | None = None,
    config: TransferConfig | None = None,
) -> Any:
    """A boto3 S3 client; the endpoint falls back to $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL."""
    import boto3
    from botocore.config import Config

    cfg = config or TransferConfig()
    endpoint_url = (
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    )
    style = (
        addressing_style
        or os.environ.get("PAVED_S3_ADDRESSING_STYLE")
        or ("path" if endpoint_url else "auto")
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or "us-east-1",
        config=Config(
            s3={"addressing_style": style},
            # botocore retries connection-level failures of the request itself; mid-stream
            # failures are retried per part below.
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=max(cfg.workers * 2, 10),
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
        ),
    )


def _classify(exc: BaseException) -> bool:
    """True if retrying may help."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code not in _NOT_RETRYABLE_CODES and status not in _NOT_RETRYABLE_CODES
    return isinstance(exc, BotoCoreError | OSError | _Retryable)


@dataclass(frozen=True)
class Fetch:
    """One file to fetch: `src` is s3://bucket/key or a local path; written to `dest`."""

    src: str
    size: int
    dest: str
    label: str


class _StallWatch:
    """Aborts a response body that moves fewer than `min_bytes` in any `window_s`: checked by
    a timer, not after a read returns (a read of a trickling stream may not return for the
    whole window, or ever: botocore's read_timeout is per socket read). `stalled` then holds
    the reason."""

    def __init__(self, body: Any, window_s: float, min_bytes: int):
        self._body = body
        self._window_s = window_s
        self._min_bytes = min_bytes
        self._moved = 0
        self._lock = threading.Lock()
        self._stopped = False
        self.stalled: str | None = None
        self._timer: threading.Timer | None = None
        self._arm()

    def _arm(self) -> None:
        self._timer = threading.Timer(self._window_s, self._check)
        self._timer.daemon = True
        self._timer.start()

    def _check(self) -> None:
        with self._lock:
            if self._stopped:
                return
            moved, self._moved = self._moved, 0
            if moved >= self._min_bytes:
                self._arm()
                return
            self.stalled = f"stalled: {moved} bytes in {self._window_s:g}s (< {self._min_bytes})"
        _abort_stream(self._body)

    def add(self, n: int) -> None:
        with self._lock:
            self._moved += n

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()


def _abort_stream(body: Any) -> None:
    """Wake the thread blocked reading `body` (a botocore StreamingBody over urllib3): shut its
    socket down (closing the file from another thread does not interrupt a recv)."""
    raw = getattr(body, "_raw_stream", body)
    sock = getattr(getattr(raw, "_connection", None), "sock", None)
    if sock is None:  # the connection already handed back: its socket is still under the file
        sock = getattr(getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None), "_sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    else:
        with contextlib.suppress(Exception):
            body.close()


class _FileJob:
    """Parts of one file in flight, and its in-order sha256."""

    def __init__(self, fetch: Fetch, nparts: int, part_size: int, fsync: bool):
        self.fetch = fetch
        self.nparts = nparts
        self.part_size = part_size
        self.fsync = fsync
        self.fd = os.open(fetch.dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(self.fd, fetch.size)
        except OSError as e:
            os.close(self.fd)
            # The bare error ("File too large") named neither the file nor the size asked for.
            raise OSError(
                e.errno, f"{fetch.label}: cannot size the download to {fetch.size} bytes: {e.strerror}"
            ) from None
        self._lock = threading.Lock()
        self._done = [False] * nparts
        self._next = 0
        self._hashing = False
        self._hash = hashlib.sha256()
        self.sha256: str | None = None

    def part_range(self, i: int) -> tuple[int, int]:
        start = i * self.part_size
        return start, min(start + self.part_size, self.fetch.size)

    def part_done(self, i: int) -> None:
        """Mark part i written; whichever thread finds the next parts complete hashes them."""
        with self._lock:
            self._done[i] = True
            if self._hashing:
                return
            self._hashing = True
        while True:
            with self._lock:
                if self._next >= self.nparts or not self._done[self._next]:
                    self._hashing = False
                    return
                j = self._next
            start, end = self.part_range(j)
            pos = start
            while pos < end:
                buf = os.pread(self.fd, min(4 * MiB, end - pos), pos)
                if not buf:
                    raise TransferError(f"{self.fetch.label}: temp file shorter than expected")
                self._hash.update(buf)
                pos += len(buf)
            with self._lock:
                self._next += 1
                if self._next == self.nparts:
                    self._finish()

    def _finish(self) -> None:
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        self.sha256 = self._hash.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Downloader:
    """Fetches many files in parallel; see the module docstring."""

    def __init__(
        self,
        config: TransferConfig | None = None,
        s3_client_factory: Callable[[], Any] | None = None,
    ):
        self.config = config or TransferConfig()
        self._factory = s3_client_factory or (lambda: make_s3_client(config=self.config))
        self._client: Any = None
        self._client_lock = threading.Lock()

    @property
    def s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def head_size(self, uri: str) -> int:
        if uri.startswith("s3://"):
            bucket, key = parse_s3_uri(uri)
            try:
                return int(self.s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except Exception as e:
                raise TransferError(f"cannot stat {uri}: {e}") from e
        return os.path.getsize(local_path(uri))

    def read_small(self, uri: str, limit: int = MODEL_JSON_LIMIT) -> bytes:
        """Whole content of a small object (model.json), with the same retry policy."""
        if not uri.startswith("s3://"):
            with open(local_path(uri), "rb") as f:
                data = f.read(limit + 1)
        else:
            bucket, key = parse_s3_uri(uri)
            # At most limit + 1 bytes: the object's size is whatever its author uploaded.
            data = self._retry(
                uri, lambda: self.s3.get_object(Bucket=bucket, Key=key)["Body"].read(limit + 1)
            )
        if len(data) > limit:
            raise TransferError(f"{uri} is larger than {limit} bytes")
        return data

    def _retry(self, what: str, op: Callable[[], Any]) -> Any:
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                return op()
            except Exception as e:
                if not _classify(e) or attempt == cfg.max_attempts:
                    raise TransferError(f"{what}: {type(e).__name__}: {e}") from e
                self._pause_before_retry(what, attempt, e)
        raise AssertionError("unreachable")

    def _pause_before_retry(self, what: str, attempt: int, error: BaseException) -> None:
        delay = self._backoff(attempt)
        log.warning(
            "%s: attempt %d failed (%s: %s); retrying in %.2fs",
            what,
            attempt,
            type(error).__name__,
            error,
            delay,
        )
        time.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        cfg = self.config
        return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)  # noqa: S311 - retry jitter

    def fetch_all(self, fetches: Sequence[Fetch], progress: Progress | None = None) -> dict[str, str]:
        """Fetch every file; returns {dest: sha256}. On failure raises TransferError (temp files
        are the caller's to delete)."""
        cfg = self.config
        jobs: list[_FileJob] = []
        tasks: list[tuple[_FileJob, int]] = []
        try:
            for f in fetches:
                ranged = f.src.startswith("s3://") and f.size > cfg.part_size
                nparts = -(-f.size // cfg.part_size) if ranged else 1
                job = _FileJob(f, nparts, cfg.part_size if ranged else max(f.size, 1), cfg.fsync)
                jobs.append(job)
                tasks.extend((job, i) for i in range(nparts))
            # Largest parts first keeps the pool busy to the end.
            tasks.sort(key=lambda t: -(t[0].part_range(t[1])[1] - t[0].part_range(t[1])[0]))
            cancel = threading.Event()
            with ThreadPoolExecutor(max(1, min(cfg.workers, len(tasks))), "paved-dl") as pool:
                futures: list[Future[None]] = [
                    pool.submit(self._run_part, job, i, progress, cancel) for job, i in tasks
                ]
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    cancel.set()
                    for fut in pending:
                        fut.cancel()
                    wait(pending)
                    raise failed[0].exception()  # type: ignore[misc]
            result = {}
            for job in jobs:
                if job.sha256 is None:
                    raise TransferError(f"{job.fetch.label}: incomplete transfer")
                result[job.fetch.dest] = job.sha256
            return result
        finally:
            for job in jobs:
                job.close()

    def _run_part(self, job: _FileJob, i: int, progress: Progress | None, cancel: threading.Event) -> None:
        if cancel.is_set():
            return
        start, end = job.part_range(i)
        src = job.fetch.src
        whole = job.nparts == 1
        what = job.fetch.label if whole else f"{job.fetch.label} [part {i + 1}/{job.nparts}]"
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            got = 0

            def count(n: int) -> None:
                nonlocal got
                got += n
                if progress:
                    progress.add(n)

            try:
                if src.startswith("s3://"):
                    self._get_range(job, start, end, whole, count, cancel)
                else:
                    self._copy_local(job, count)
                break
            except Exception as e:
                if progress and got:
                    progress.add(-got)
                if cancel.is_set():
                    return
                if not _classify(e) or attempt == cfg.max_attempts:
                    raise TransferError(
                        f"{what}: {type(e).__name__}: {e}"
                        + (f" (after {attempt} attempts)" if attempt > 1 else "")
                    ) from e
                self._pause_before_retry(what, attempt, e)
        job.part_done(i)

    def _get_range(
        self,
        job: _FileJob,
        start: int,
        end: int,
        whole: bool,
        count: Callable[[int], None],
        cancel: threading.Event,
    ) -> None:
        cfg = self.config
        bucket, key = parse_s3_uri(job.fetch.src)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if not whole:
            kwargs["Range"] = f"bytes={start}-{end - 1}"
        resp = self.s3.get_object(**kwargs)
        length = int(resp.get("ContentLength", -1))
        if length != end - start:
            total = resp.get("ContentRange", "").rpartition("/")[2] if not whole else length
            raise TransferError(
                f"size mismatch: the manifest says {job.fetch.size} bytes, the object has "
                f"{total} (range answer {length} bytes for {end - start})"
            )
        body = resp["Body"]
        pos = start
        watch = _StallWatch(body, cfg.stall_timeout_s, cfg.stall_min_bytes)
        # Bytes count once a read returns: reads well under the window's minimum, so a slow
        # stream that does move enough is not taken for a stalled one.
        read_size = max(1, min(_CHUNK, cfg.stall_min_bytes // 4))
        try:
            while pos < end:
                if cancel.is_set():
                    raise TransferError("cancelled")
                try:
                    chunk = body.read(read_size if end - pos > read_size else end - pos)
                except Exception:
                    if watch.stalled:
                        raise _Retryable(watch.stalled) from None
                    raise
                if watch.stalled:  # what the read returned may be cut short by the abort
                    raise _Retryable(watch.stalled)
                if not chunk:
                    raise _Retryable(f"stream ended at byte {pos - start} of {end - start}")
                os.pwrite(job.fd, chunk, pos)
                pos += len(chunk)
                count(len(chunk))
                watch.add(len(chunk))
        finally:
            watch.stop()
            body.close()

    def _copy_local(self, job: _FileJob, count: Callable[[int], None]) -> None:
        path = local_path(job.fetch.src)
        size = os.path.getsize(path)
        if size != job.fetch.size:
            raise TransferError(f"size mismatch: the manifest says {job.fetch.size} bytes, {path} has {size}")
        with open(path, "rb", buffering=0) as f:
            pos = 0
            while True:
                chunk = f.read(4 * MiB)
                if not chunk:
                    break
                os.pwrite(job.fd, chunk, pos)
                pos += len(chunk)
                count(len(chunk))
        if pos != job.fetch.size:
            raise TransferError(f"{path} changed while it was copied")
