"""The OpenAI Files and Batches API, per tenant.

    POST /v1/files (multipart: file, purpose=batch, optionally expires_after[anchor]=created_at
                    and expires_after[seconds]: the file is deleted that long after its upload)
    GET /v1/files   GET|DELETE /v1/files/{id}
    GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches (?after=&limit=)   GET /v1/batches/{id}
    POST /v1/batches/{id}/cancel

Objects are shaped as OpenAI documents them (the `openai` SDK's FileObject and Batch parse
them). Every call authenticates with the caller's API key; a file or batch of another tenant
answers the same 404 as one that does not exist. An upload is validated whole as it streams to
disk (paved.gateway.batches.validate) before anything is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paved.gateway.batches import validate
from paved.gateway.batches.objects import ObjectStore
from paved.gateway.batches.store import BatchStore, TooManyBatches, new_id
from paved.gateway.errors import GatewayError
from paved.gateway.types import MAX_ID_LEN, well_formed_id
from paved.http.json_body import JSONBodyError, parse_json

if TYPE_CHECKING:
    from paved.gateway.access.auth import Authenticator
    from paved.gateway.routing.router import Router

WINDOWS = {"24h": 24 * 3600.0}
MAX_METADATA_PAIRS = 16


@dataclass
class BatchesAPI:
    authenticator: Authenticator
    store: BatchStore
    objects: ObjectStore
    router: Router
    limits: validate.Limits
    default_max_tokens: int = 256
    clock: Callable[[], float] = time.time
    # The window a "24h" batch gets (tests shorten it).
    window_s: float | None = None
    # Called once a batch is stored: this replica's runner leases its lines at once instead of
    # at its next poll (other replicas find it at theirs).
    on_create: Callable[[], None] | None = None

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    # -- files -----------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise GatewayError(
                400, "upload the file as multipart/form-data (fields: file, purpose)", param="file"
            )
        try:
            # File parts spool to disk past 1 MiB: memory stays bounded whatever the size.
            form = await request.form(max_files=1, max_fields=8)
        except ClientDisconnect:
            raise GatewayError(499, "client closed the request", code="client_closed_request") from None
        except (MultiPartException, HTTPException, ValueError) as e:
            detail = getattr(e, "detail", None) or getattr(e, "message", None) or str(e)
            raise GatewayError(400, f"malformed multipart body: {detail}", param="file") from None
        try:
            purpose = form.get("purpose")
            if purpose != "batch":
                raise GatewayError(
                    400, "purpose must be 'batch' (the only purpose this gateway accepts)", param="purpose"
                )
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise GatewayError(400, "missing the file field", param="file")
            expires_after = _expires_after(
                form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            )
            # Control characters (a NUL, which a database's text refuses) are left out.
            filename = "".join(c for c in (upload.filename or "") if c.isprintable())[:255] or "batch.jsonl"
            file_id = new_id("file")
            tenant = principal.tenant.name
            key = f"files/{tenant}/{file_id}"
            try:
                fd, tmp = tempfile.mkstemp(prefix="paved-upload-")
            except OSError as e:
                raise _files_unavailable(e) from None
            try:
                with os.fdopen(fd, "wb") as dest:
                    summary = await asyncio.to_thread(
                        validate.validate_stream,
                        upload.file,
                        dest,
                        principal=principal,
                        router=self.router,
                        limits=self.limits,
                        default_max_tokens=self.default_max_tokens,
                    )
                try:
                    await self.objects.put_file(key, tmp)
                except OSError as e:
                    raise _files_unavailable(e) from None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        finally:
            await form.close()
        now = self.clock()
        row: dict[str, Any] = {
            "id": file_id,
            "tenant": tenant,
            "purpose": "batch",
            "filename": filename,
            "bytes": summary.bytes,
            "created_at": now,
            "object_key": key,
            "lines": summary.lines,
            "url": summary.url,
            "model": summary.model,
        }
        expires_at = now + expires_after if expires_after is not None else None
        await self.store.add_file(row, expires_at=expires_at)
        row["expires_at"] = expires_at
        return JSONResponse(_file_object(row))

    async def list_files(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError(400, "order must be asc or desc", param="order")
        limit = _limit(q.get("limit"), default=10000, most=10000)
        rows, more = await self.store.list_files(
            principal.tenant.name,
            purpose=_text_param(q.get("purpose"), "purpose"),
            after=_text_param(q.get("after"), "after"),
            limit=limit,
            ascending=order == "asc",
        )
        return JSONResponse(_page([_file_object(r) for r in rows], more))

    async def get_file(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        row = await self.store.get_file(principal.tenant.name, _ident(request.path_params["file_id"], "file"))
        return JSONResponse(_file_object(row))

    async def delete_file(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        tenant, file_id = principal.tenant.name, _ident(request.path_params["file_id"], "file")
        row = await self.store.get_file(tenant, file_id)
        # The object first: a store that fails leaves the row, so the client's retry (the delete
        # of a missing object succeeds) finishes it; the other order orphaned the object.
        await self.objects.delete(row["object_key"])
        await self.store.delete_file(tenant, file_id)
        return JSONResponse({"id": row["id"], "object": "file", "deleted": True})

    async def content(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        row = await self.store.get_file(principal.tenant.name, _ident(request.path_params["file_id"], "file"))
        # In a thread: the S3 store asks for the object here, so a failure is a 503 before the
        # response starts rather than a body cut short.
        try:
            chunks: Iterator[bytes] = await asyncio.to_thread(self.objects.open_read, row["object_key"])
        except FileNotFoundError:  # deleted since it was looked up (the local store)
            raise GatewayError(404, f"No such file: '{row['id']}'", code="not_found") from None
        return StreamingResponse(
            chunks, media_type="application/jsonl", headers={"content-length": str(row["bytes"])}
        )

    # -- batches ---------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        try:
            body = parse_json(await request.body())
        except JSONBodyError as e:
            raise GatewayError(400, f"the request body is {e}") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or endpoint not in validate.ENDPOINTS:
            raise GatewayError(
                400, "endpoint must be one of: " + ", ".join(validate.ENDPOINTS), param="endpoint"
            )
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in WINDOWS:
            raise GatewayError(400, "completion_window must be '24h'", param="completion_window")
        meta = body.get("metadata")
        if meta is not None and (
            not isinstance(meta, dict)
            or len(meta) > MAX_METADATA_PAIRS
            or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in meta.items()
            )
            or not _utf8(meta)
        ):
            raise GatewayError(
                400,
                "metadata must be an object of at most 16 string pairs (keys <= 64, values <= 512 "
                "chars) of valid Unicode text",
                param="metadata",
            )
        if (
            meta is not None
            and "paved_cache" in meta
            and meta["paved_cache"] not in ("off", "write", "refresh")
        ):
            raise GatewayError(400, "metadata.paved_cache must be off, write or refresh", param="metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise GatewayError(400, "input_file_id must be the id of an uploaded file", param="input_file_id")
        tenant = principal.tenant.name
        try:
            f = await self.store.get_file(tenant, _ident(file_id, "file"))
        except GatewayError:
            raise GatewayError(
                404, f"No such file: '{file_id}'", param="input_file_id", code="not_found"
            ) from None
        if f["purpose"] != "batch":
            raise GatewayError(400, "the input file's purpose must be 'batch'", param="input_file_id")
        if f["url"] != endpoint:
            raise GatewayError(
                400,
                f"the input file's requests are for {f['url']}, not the batch's endpoint {endpoint}",
                param="endpoint",
            )
        now = self.clock()
        batch_id = new_id("batch")
        row = {
            "id": batch_id,
            "tenant": tenant,
            "key_id": principal.key_id,
            "endpoint": endpoint,
            "model": f["model"],
            "input_file_id": file_id,
            "completion_window": window,
            "status": "in_progress",
            "metadata": meta,
            "total": f["lines"],
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + (self.window_s if self.window_s is not None else WINDOWS[window]),
        }

        def lines() -> Iterator[tuple[str, str]]:
            # Consumed inside the store's worker thread: the file streams, never held whole.
            for raw in validate.iter_lines(self.objects.open_read(f["object_key"])):
                obj = json.loads(raw)
                yield obj["custom_id"], json.dumps(obj["body"], ensure_ascii=False, separators=(",", ":"))

        try:
            await self.store.create_batch(row, lines(), max_active=self.limits.max_active_batches)
        except TooManyBatches:
            raise GatewayError(
                429,
                f"this tenant already has {self.limits.max_active_batches} batches that have not "
                "finished (the most it may have at once); retry once one has ended",
                code="batch_limit_reached",
                headers={"Retry-After": "60"},
            ) from None
        except FileNotFoundError:  # deleted since it was looked up (the local store)
            raise GatewayError(
                404, f"No such file: '{file_id}'", param="input_file_id", code="not_found"
            ) from None
        if self.on_create is not None:
            self.on_create()
        return JSONResponse(_batch_object(await self.store.get_batch(tenant, batch_id)))

    async def list_batches(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        q = request.query_params
        rows, more = await self.store.list_batches(
            principal.tenant.name,
            after=_text_param(q.get("after"), "after"),
            limit=_limit(q.get("limit"), default=20, most=100),
        )
        return JSONResponse(_page([_batch_object(r) for r in rows], more))

    async def get(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        batch_id = _ident(request.path_params["batch_id"], "batch")
        return JSONResponse(_batch_object(await self.store.get_batch(principal.tenant.name, batch_id)))

    async def cancel(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        batch_id = _ident(request.path_params["batch_id"], "batch")
        row = await self.store.cancel(principal.tenant.name, batch_id, self.clock())
        return JSONResponse(_batch_object(row))


def _limit(raw: str | None, *, default: int, most: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise GatewayError(400, f"limit must be an integer between 1 and {most}", param="limit")
    return value


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def _file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": int(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": _ts(row.get("expires_at")),
    }


# OpenAI's bounds on a file's `expires_after.seconds` (1 hour to 30 days).
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)


def _expires_after(anchor: object, seconds: object) -> float | None:
    """The upload's `expires_after` (multipart fields `expires_after[anchor]`, which must be
    `created_at`, and `expires_after[seconds]`): seconds after creation, or None if absent."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise GatewayError(400, "expires_after.anchor must be 'created_at'", param="expires_after.anchor")
    low, high = EXPIRES_AFTER_S
    digits = seconds.strip() if isinstance(seconds, str) else ""
    # ASCII digits, few of them: "²" is a digit to str.isdigit and not to int().
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 12) or not low <= int(digits) <= high:
        raise GatewayError(
            400,
            f"expires_after.seconds must be an integer from {low} to {high}",
            param="expires_after.seconds",
        )
    return float(int(digits))


# Ids this gateway issues are short printable ASCII; a NUL byte reached PostgreSQL, which
# refuses it in text (a 500).
def _utf8(meta: dict[str, str]) -> bool:
    """Every key and value is text UTF-8 can hold (no lone surrogate, no NUL): metadata is
    stored and answered on every read of the batch."""
    try:
        for k, v in meta.items():
            k.encode()
            v.encode()
    except UnicodeEncodeError:
        return False
    return not any("\x00" in k or "\x00" in v for k, v in meta.items())


def _ident(value: str, kind: str) -> str:
    """`value` if it can name a `kind`; else the 404 of one that does not exist."""
    if not well_formed_id(value):
        raise GatewayError(404, f"No such {kind}: {value[:MAX_ID_LEN]!r}", code="not_found")
    return value


def _text_param(value: str | None, param: str) -> str | None:
    """A query parameter naming an id or a purpose: printable and short, else a 400."""
    if value is not None and (len(value) > MAX_ID_LEN or not value.isprintable()):
        raise GatewayError(
            400, f"{param} must be a printable string of at most {MAX_ID_LEN} characters", param=param
        )
    return value


def _ts(value: float | None) -> int | None:
    return None if value is None else int(value)


def _batch_object(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("completed") is not None:
        completed, failed = row["completed"], row["failed"]
    else:
        counts = row.get("counts") or {}
        completed, failed = counts.get("done", 0), counts.get("failed", 0)
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": int(row["created_at"]),
        "in_progress_at": _ts(row["in_progress_at"]),
        "expires_at": _ts(row["expires_at"]),
        "finalizing_at": _ts(row["finalizing_at"]),
        "completed_at": _ts(row["completed_at"]),
        "failed_at": None,
        "expired_at": _ts(row["expired_at"]),
        "cancelling_at": _ts(row["cancelling_at"]),
        "cancelled_at": _ts(row["cancelled_at"]),
        "request_counts": {"total": row["total"], "completed": completed, "failed": failed},
        "metadata": row["metadata"],
    }


def _files_unavailable(e: OSError) -> GatewayError:
    """The file store cannot take the upload (a full or unwritable disk, an S3 outage): a 503
    the client may retry, naming the cause but no path."""
    return GatewayError(
        503,
        f"the gateway's batch file store is unavailable ({e.strerror or type(e).__name__})",
        code="files_store_unavailable",
        headers={"Retry-After": "30"},
    )
