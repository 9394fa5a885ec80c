"""Where the bytes of batch files live: a local directory (one gateway, or replicas sharing a
volume) or an S3 bucket (replicas on different machines).

Invariants callers rely on:
- `put` is atomic: a reader sees the whole object or none (local: write to a temporary name,
  fsync, rename; S3: one PUT or one completed multipart upload), and putting the same key
  again replaces it whole (the batch finalizer may run twice after a crash).
- Keys are built by the gateway (`files/<tenant>/<file id>`), never taken from a request.
- Every S3 call has connect and read timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

_CHUNK = 1 << 20


class ObjectStore(Protocol):
    async def put_file(self, key: str, path: str) -> None: ...
    def open_read(self, key: str) -> Iterator[bytes]: ...
    async def delete(self, key: str) -> None: ...


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
        a StreamingResponse, which iterates sync iterators in a thread pool)."""
        with open(self._path(key), "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, self._path(key))


class S3ObjectStore:
    """Objects in `bucket` under `prefix`; `client` is a boto3 S3 client (see `s3_client`)."""

    def __init__(self, client: Any, bucket: str, prefix: str = ""):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    async def put_file(self, key: str, path: str) -> None:
        # upload_file switches to a multipart upload for large files: completed or absent.
        await asyncio.to_thread(self.client.upload_file, path, self.bucket, self.prefix + key)

    def open_read(self, key: str) -> Iterator[bytes]:
        body: IO[bytes] = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"]
        try:
            while chunk := body.read(_CHUNK):
                yield chunk
        finally:
            body.close()

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self.prefix + key)


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
