"""Where the bytes of batch files live: a local directory (one gateway, or replicas sharing a
volume) or an S3 bucket (replicas on different machines).

Invariants callers rely on:
- `put` is atomic: a reader sees the whole object or none (local: write to a temporary name,
  fsync, rename; S3: one PUT or one completed multipart upload), and putting the same key
  again replaces it whole (the batch finalizer may run twice after a crash).
- Keys are built by the gateway (`files/<tenant>/<file id>`), never taken from a request.
- Every S3 call has connect and read timeouts (`s3_client`), and an S3 failure (bucket missing,
  server down, access denied, timeout) is raised as `ObjectStoreUnavailable`: an OSError (what
  the upload path already turns into its 503) that is also a GatewayError 503 with Retry-After,
  so no path answers it with a 500.
- `open_read` of the S3 store asks for the object before it returns (call it from a worker
  thread): a failure is raised there, before any response has started.
- `delete` and `delete_prefix` of a missing object or prefix succeed (a sweep or a finalizer
  redone after a crash deletes again).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from paved.gateway.errors import GatewayError

_CHUNK = 1 << 20
_T = TypeVar("_T")


class ObjectStore(Protocol):
    async def put_file(self, key: str, path: str) -> None: ...
    def open_read(self, key: str) -> Iterator[bytes]: ...
    async def delete(self, key: str) -> None: ...
    async def delete_prefix(self, prefix: str) -> None: ...


class ObjectStoreUnavailable(OSError, GatewayError):
    """The object store failed a call: 503 + Retry-After, naming the cause (an S3 error code or
    the exception's type), never the bucket, endpoint or key."""

    def __init__(self, cause: str):
        GatewayError.__init__(
            self,
            503,
            f"the gateway's batch file store is unavailable ({cause})",
            code="files_store_unavailable",
            headers={"Retry-After": "30"},
        )
        self.strerror = cause


class LocalObjectStore:
    """Objects as files under `root` (created on first use)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    async def put_file(self, key: str, path: str) -> None:
        await asyncio.to_thread(self._put_sync, key, path)

    def _put_sync(self, key: str, path: str) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def open_read(self, key: str) -> Iterator[bytes]:
        """The object's bytes in chunks (a blocking iterator: run it in a thread or hand it to
        a StreamingResponse, which iterates sync iterators in a thread pool). The file is
        opened here, not at the first chunk: a missing object raises FileNotFoundError before
        an answer starts, as the S3 store's does, instead of cutting a 200 short."""
        f = open(self._path(key), "rb")  # noqa: SIM115 - closed by the generator below
        return _chunks(f)

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, self._path(key))

    async def delete_prefix(self, prefix: str) -> None:
        """Every object under the folder `prefix` (a key prefix ending in '/')."""
        await asyncio.to_thread(shutil.rmtree, self._path(prefix.rstrip("/")), ignore_errors=True)


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    with f:
        while chunk := f.read(_CHUNK):
            yield chunk


class S3ObjectStore:
    """Objects in `bucket` under `prefix`; `client` is a boto3 S3 client (see `s3_client`)."""

    def __init__(self, client: Any, bucket: str, prefix: str = ""):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    async def put_file(self, key: str, path: str) -> None:
        # upload_file switches to a multipart upload for large files: completed or absent.
        await asyncio.to_thread(_s3, self.client.upload_file, path, self.bucket, self.prefix + key)

    def open_read(self, key: str) -> Iterator[bytes]:
        body: IO[bytes] = _s3(self.client.get_object, Bucket=self.bucket, Key=self.prefix + key)["Body"]
        return _stream(body)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(_s3, self.client.delete_object, Bucket=self.bucket, Key=self.prefix + key)

    async def delete_prefix(self, prefix: str) -> None:
        await asyncio.to_thread(self._delete_prefix_sync, self.prefix + prefix)

    def _delete_prefix_sync(self, prefix: str) -> None:
        # One listing page (at most 1,000 keys) is one DeleteObjects call.
        token: dict[str, str] = {}
        while True:
            page = _s3(self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix, **token)
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                _s3(self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}


def _stream(body: IO[bytes]) -> Iterator[bytes]:
    try:
        while True:
            chunk = _s3(body.read, _CHUNK)
            if not chunk:
                return
            yield chunk
    finally:
        body.close()


def _s3(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`call` with boto's errors as ObjectStoreUnavailable (the client's own retries and
    deadlines have run by then)."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        if not type(e).__module__.startswith(
            ("boto3", "botocore", "s3transfer", "urllib3")
        ) and not isinstance(e, OSError):
            raise
        raise ObjectStoreUnavailable("S3 " + _s3_cause(e)) from e


def _s3_cause(e: BaseException) -> str:
    """S3's error code (NoSuchBucket, AccessDenied, ...) where the error or what it wraps has
    one (boto3's upload wraps it in S3UploadFailedError), else the exception's type."""
    seen: BaseException | None = e
    while seen is not None:
        code = (
            getattr(seen, "response", {}).get("Error", {}).get("Code") if hasattr(seen, "response") else None
        )
        if code:
            return str(code)
        seen = seen.__cause__ or seen.__context__
    return type(e).__name__


def s3_client(endpoint_url: str | None, region: str | None = None) -> Any:
    """A boto3 S3 client with deadlines (5 s connect, 60 s read, 3 tries); credentials from the
    usual AWS environment. Path-style addressing when an endpoint is named (moto, MinIO)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or "us-east-1",
        config=Config(
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
        ),
    )
