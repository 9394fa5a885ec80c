"""Batch files in S3: a gateway main with `--files-s3-*` against moto's S3 server on loopback,
in front of a paved frontend on the simulated engine, driven with the official `openai` client.

- End to end: upload, run (output in several chunks), download, delete; the chunk objects are
  gone once the files are published, a deleted file's object is gone from the bucket.
- S3 failing is a 503 with Retry-After, never a 500: a bucket that does not exist (upload), an
  object missing behind the gateway's back (content, batch create), and a server that refuses
  connections (upload).
"""

from __future__ import annotations

import asyncio
import io
import json
import secrets
import time

import openai
import pytest
from gateway_proc import GatewayProcess, write_routes
from servers import ServerProcess

from paved.gateway.batches.objects import ObjectStoreUnavailable, S3ObjectStore, s3_client
from paved.launcher.gate import free_port, reserve
from paved.launcher.testing import CREDENTIALS, MotoServer

BUCKET = "paved-batches"
PREFIX = "gw"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches_s3")
    frontend = ServerProcess("--engine", "sim://tiny?tokens_per_s=2000&max_num_seqs=64", ready_timeout_s=120)
    moto = MotoServer(str(tmp / "moto.log"))
    gateways: list[GatewayProcess] = []
    try:
        moto.start()
        s3 = moto.client()
        s3.create_bucket(Bucket=BUCKET)
        routes = write_routes(
            tmp / "routes.json", [{"alias": "tiny", "backends": [{"url": frontend.url, "version": "v1"}]}]
        )
        admin = "adm-" + secrets.token_hex(16)

        def gateway(*args: str) -> GatewayProcess:
            gw = GatewayProcess(
                routes, *args, admin_key=admin, state_dir=tmp / secrets.token_hex(4), env=CREDENTIALS
            )
            gateways.append(gw)
            return gw

        yield {"moto": moto, "s3": s3, "gateway": gateway, "tmp": tmp}
    finally:
        for gw in gateways:
            gw.stop()
        moto.stop()
        frontend.terminate()


def _client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=60, max_retries=0)


def _jsonl(n: int, prefix: str) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _keys(s3, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


def _s3_args(endpoint: str, bucket: str = BUCKET) -> list[str]:
    return ["--files-s3-bucket", bucket, "--files-s3-endpoint", endpoint, "--files-s3-prefix", PREFIX]


def test_a_batch_end_to_end_with_its_files_in_s3(world):
    s3 = world["s3"]
    gw = world["gateway"](*_s3_args(world["moto"].endpoint), "--batch-chunk-lines", "7")
    gw.tenant("acme", models=["tiny"])
    client = _client(gw, gw.key("acme"))
    data = _jsonl(40, "s3")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert _keys(s3, f"{PREFIX}/files/acme/{uploaded.id}") == [f"{PREFIX}/files/acme/{uploaded.id}"]
    assert client.files.content(uploaded.id).content == data
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 40, batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"s3-{i}" for i in range(40))
    assert all(x["response"]["status_code"] == 200 for x in out)
    # Chunks of 7 lines were written while it ran (the moto log saw their PUTs) and deleted
    # once the output was published.
    chunk_puts = world["moto"].requests("PUT", f"/{PREFIX}/batches/{batch.id}/chunks/")
    assert len(chunk_puts) >= 40 // 7, chunk_puts
    assert _keys(s3, f"{PREFIX}/batches/{batch.id}/") == []
    output_key = f"{PREFIX}/files/acme/{batch.output_file_id}"
    assert _keys(s3, output_key) == [output_key]
    for file_id in (uploaded.id, batch.output_file_id):
        assert client.files.delete(file_id).deleted
        assert _keys(s3, f"{PREFIX}/files/acme/{file_id}") == []
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)


def test_s3_errors_are_a_503_with_retry_after_never_a_500(world):
    s3 = world["s3"]
    moto = world["moto"]
    # A bucket that does not exist: the upload is refused.
    missing = world["gateway"](*_s3_args(moto.endpoint, bucket="no-such-bucket"))
    missing.tenant("nb", models=["tiny"])
    with pytest.raises(openai.APIStatusError) as refused:
        _client(missing, missing.key("nb")).files.create(
            file=("in.jsonl", io.BytesIO(_jsonl(2, "nb"))), purpose="batch"
        )
    assert refused.value.status_code == 503, refused.value
    assert "NoSuchBucket" in str(refused.value) and "no-such-bucket" not in str(refused.value)
    assert refused.value.response.headers.get("retry-after")

    # An object gone behind the gateway's back: its content and a batch from it.
    gw = world["gateway"](*_s3_args(moto.endpoint))
    gw.tenant("gone", models=["tiny"])
    client = _client(gw, gw.key("gone"))
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(2, "g"))), purpose="batch")
    s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/files/gone/{f.id}")
    for call in (
        lambda: client.files.content(f.id),
        lambda: client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.APIStatusError) as err:
            call()
        assert err.value.status_code == 503 and err.value.response.headers.get("retry-after"), err.value

    # A server that refuses connections (a port held but not listening).
    held = reserve("127.0.0.1", free_port())
    try:
        down = world["gateway"](*_s3_args(f"http://127.0.0.1:{held.getsockname()[1]}"))
        down.tenant("down", models=["tiny"])
        with pytest.raises(openai.APIStatusError) as err:
            _client(down, down.key("down")).files.create(
                file=("in.jsonl", io.BytesIO(_jsonl(2, "d"))), purpose="batch"
            )
        assert err.value.status_code == 503 and err.value.response.headers.get("retry-after"), err.value
    finally:
        held.close()


def test_the_s3_store_deletes_a_prefix_and_reports_failures_as_unavailable(world):
    """S3ObjectStore directly: delete_prefix over more than one listing page (the page size
    is the server's: more keys than moto's default of 1,000 is slow, so MaxKeys pages are
    forced through a client that asks for 2 per page), and a missing bucket as
    ObjectStoreUnavailable (a 503)."""

    async def go() -> None:
        client = s3_client(world["moto"].endpoint)
        real_list = client.list_objects_v2
        pages: list[int] = []

        def small_pages(**kwargs):
            page = real_list(MaxKeys=2, **kwargs)
            pages.append(len(page.get("Contents", [])))
            return page

        client.list_objects_v2 = small_pages
        store = S3ObjectStore(client, BUCKET, "unit")
        src = world["tmp"] / "obj"
        src.write_bytes(b"x" * 10)
        for i in range(5):
            await store.put_file(f"batches/b1/chunks/{i}", str(src))
        await store.put_file("batches/b2/chunks/0", str(src))
        assert b"".join(await asyncio.to_thread(store.open_read, "batches/b1/chunks/3")) == b"x" * 10
        await store.delete_prefix("batches/b1/")
        assert len(pages) >= 3
        assert _keys(world["s3"], "unit/batches/") == ["unit/batches/b2/chunks/0"]
        await store.delete_prefix("batches/none/")  # nothing there: fine
        await store.delete("batches/none/x")
        nowhere = S3ObjectStore(client, "no-such-bucket")
        with pytest.raises(ObjectStoreUnavailable) as err:
            await nowhere.put_file("k", str(src))
        assert err.value.status == 503 and err.value.headers["Retry-After"]
        with pytest.raises(ObjectStoreUnavailable):
            await asyncio.to_thread(nowhere.open_read, "k")

    asyncio.run(go())


def test_a_delete_that_s3_fails_keeps_the_file_for_a_retry(world, tmp_path):
    """The object goes first: with S3 down the delete is a 503 and the file is still listed, so
    the client's retry can finish it (row first would orphan the object behind a 'deleted')."""
    moto = MotoServer(str(tmp_path / "moto2.log"))
    moto.start()
    try:
        moto.client().create_bucket(Bucket=BUCKET)
        gw = world["gateway"](*_s3_args(moto.endpoint))
        gw.tenant("del", models=["tiny"])
        client = _client(gw, gw.key("del"))
        f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(2, "del"))), purpose="batch")
    finally:
        moto.stop()
    with pytest.raises(openai.APIStatusError) as err:
        client.files.delete(f.id)
    assert err.value.status_code == 503 and err.value.response.headers.get("retry-after"), err.value
    assert client.files.retrieve(f.id).id == f.id
