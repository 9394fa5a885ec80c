"""The batch runner's output chunks, retention and shared token share, over a real store
(BatchStore on SQLite and on PostgreSQL 15, files in a local directory) with the line's
request path stubbed.

- Output is written in chunks as lines finish, each recorded in the manifest; the files are the
  chunks' concatenation, each custom_id exactly once, and no result is left in the rows.
- A chunk object written but never committed (the runner killed between the two) is ignored:
  another runner re-chunks its lines; a runner that loses a chunk race deletes its object.
- Retention: a finished batch past it is deleted with its rows, chunks and output / error
  files by the sweep; a younger one, or one still running, is kept. Two replicas sweeping at
  once delete each batch once, without errors. Files past their `expires_after` are swept.
- A finalize outlasting its lease (a slow object store) renews it: another replica does not
  take the batch over, and the files are published once.
- The finalizer of a 50,000-line batch holds one chunk at a time (Python memory peak ~2.7 MB
  for a 20 MB output; ~38 MB when it reads every line at once).
- The tenant token share is counted in the shared database: what one replica's batch used
  closes the share for another replica of the same tenant.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from starlette.responses import JSONResponse

from paved.gateway.access.state import GatewayStore
from paved.gateway.batches.objects import LocalObjectStore
from paved.gateway.batches.runner import BatchMetrics, BatchRunner, RunnerConfig
from paved.gateway.batches.store import (
    BatchStore,
    TooManyBatches,
    batches_table,
    chunks_table,
    files_table,
    lines_table,
)
from paved.gateway.errors import GatewayError
from paved.gateway.types import Limits, Principal, Tenant
from paved.testing.postgres import create_database, postgres_server

T0 = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _proxy(tokens_per_answer: int = 10) -> SimpleNamespace:
    async def forward(request, kind, endpoint, *, principal):
        body = json.loads(await request.body())
        return JSONResponse(
            {"echo": body["n"], "usage": {"total_tokens": tokens_per_answer}},
            headers={"x-request-id": "r"},
        )

    router = SimpleNamespace(split_model=lambda m: (m, None), saturated=lambda m, sticky_key: False)
    return SimpleNamespace(router=router, flow=None, forward=forward)


def _runner(store: BatchStore, objects: LocalObjectStore, clock: Clock, **config: Any) -> BatchRunner:
    tpm = config.pop("tpm", None)
    runner = BatchRunner(
        store,
        objects,
        _proxy(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        BatchMetrics(CollectorRegistry()),
        RunnerConfig(**{"concurrency": 8, "chunk_lines": 50, "chunk_s": 1000.0, **config}),
        clock=clock,
    )
    tenant = Tenant(id="t-acme", name="acme", limits=Limits(tokens_per_min=tpm))
    runner._principals["k1"] = (float("inf"), Principal(key_id="k1", key_name="k", tenant=tenant))
    return runner


async def _new_batch(store: BatchStore, batch_id: str, n: int, now: float) -> None:
    row = {
        "id": batch_id,
        "tenant": "acme",
        "key_id": "k1",
        "endpoint": "/v1/chat/completions",
        "model": "tiny",
        "input_file_id": "file-in",
        "completion_window": "24h",
        "status": "in_progress",
        "metadata": None,
        "total": n,
        "created_at": now,
        "in_progress_at": now,
        "expires_at": now + 86400,
    }
    await store.create_batch(row, iter((f"c{i}", json.dumps({"n": i})) for i in range(n)))


async def _drain(runner: BatchRunner, clock: Clock, batch_id: str, store: BatchStore) -> dict[str, Any]:
    """Ticks (one simulated second apart) until the batch is finished."""
    for _ in range(500):
        clock.now += 1.0
        await runner.tick()
        await asyncio.sleep(0.01)
        batch = await store.get_batch(None, batch_id)
        if batch["status"] in ("completed", "cancelled", "expired"):
            return batch
    raise AssertionError(f"batch still {batch['status']}")


def _read(objects: LocalObjectStore, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in b"".join(objects.open_read(key)).decode().splitlines()]


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def env(request, tmp_path: Path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'gw.sqlite'}"
    else:
        url = create_database(request.getfixturevalue("postgres"), "b" + secrets.token_hex(6))

    async def make() -> tuple[GatewayStore, BatchStore, LocalObjectStore]:
        accounts = GatewayStore(url)
        await accounts.start()
        store = BatchStore(accounts)
        await store.start()
        return accounts, store, LocalObjectStore(tmp_path / "files")

    return make


def _file_key(accounts: GatewayStore, file_id: str) -> str:
    with accounts.engine.connect() as c:
        return c.execute(sa.select(files_table.c.object_key).where(files_table.c.id == file_id)).scalar_one()


def test_output_is_written_in_committed_chunks_and_the_files_concatenate_them(env, tmp_path):
    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        runner = _runner(store, objects, clock)
        await _new_batch(store, "batch_a", 230, clock.now)
        committed_before_finish: list[int] = []
        real_finish = store.finish

        async def finish(batch_id, *args, **kwargs):
            committed_before_finish.extend(c.out_lines for c in await store.chunks(batch_id))
            return await real_finish(batch_id, *args, **kwargs)

        store.finish = finish  # type: ignore[method-assign]
        done = await _drain(runner, clock, "batch_a", store)
        assert done["status"] == "completed" and done["completed"] == 230 and done["failed"] == 0
        # Chunks of at most 50 lines, written as lines finished, each in the manifest.
        assert sum(committed_before_finish) == 230 and max(committed_before_finish) <= 50
        assert len(committed_before_finish) >= 5
        out = _read(objects, _file_key(accounts, done["output_file_id"]))
        assert sorted(x["custom_id"] for x in out) == sorted(f"c{i}" for i in range(230))
        assert {x["response"]["body"]["echo"] for x in out} == set(range(230))
        with accounts.engine.connect() as c:
            # No result is left in the rows, and the manifest went with publication.
            assert (
                c.execute(sa.select(sa.func.count()).where(lines_table.c.result.is_not(None))).scalar() == 0
            )
            assert c.execute(sa.select(sa.func.count()).select_from(chunks_table)).scalar() == 0
        assert not (tmp_path / "files" / "batches" / "batch_a").exists()
        await runner.stop()

    asyncio.run(go())


def test_a_chunk_written_but_not_committed_is_ignored_and_its_lines_rechunked(env):
    """A runner killed between writing a chunk object and committing its manifest row: the
    object is there, no manifest row names it, its lines still hold their results. The runner
    that finalizes re-chunks those lines: each custom_id exactly once."""

    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        dying = _runner(store, objects, clock)
        await _new_batch(store, "batch_k", 120, clock.now)
        written: list[str] = []
        real_put = objects.put_file

        async def put_then_die(key, path):
            await real_put(key, path)
            written.append(key)
            raise asyncio.CancelledError  # SIGKILL before the commit

        objects.put_file = put_then_die  # type: ignore[method-assign]
        for _ in range(50):
            clock.now += 1.0
            await dying.tick()
            await asyncio.sleep(0.01)
            if written:
                break
        assert dying._chunk_task is not None
        await asyncio.gather(dying._chunk_task, return_exceptions=True)
        assert written, "the chunk object was written"
        assert await store.chunks("batch_k") == []  # ... and never committed
        objects.put_file = real_put  # type: ignore[method-assign]
        # The dying runner is gone without a word: its leases expire; another takes over.
        for task, _ in dying._tasks.values():
            task.cancel()
        dying._ready.clear()
        clock.now += 100.0
        heir = _runner(store, objects, clock)
        done = await _drain(heir, clock, "batch_k", store)
        assert done["status"] == "completed" and done["completed"] == 120
        out = _read(objects, _file_key(accounts, done["output_file_id"]))
        ids = [x["custom_id"] for x in out]
        assert len(ids) == len(set(ids)) == 120
        await heir.stop()

    asyncio.run(go())


def test_a_runner_that_loses_a_chunk_race_commits_nothing_and_deletes_its_object(env, tmp_path):
    async def go() -> None:
        _, store, objects = await env()
        clock = Clock()
        one, two = _runner(store, objects, clock), _runner(store, objects, clock)
        await _new_batch(store, "batch_r", 10, clock.now)
        leases = await store.lease("batch_r", one.owner, 10, clock.now, 30.0)
        await store.settle_many(
            one.owner, [(lease, "done", f'{{"n":{lease.line_no}}}', 0.0) for lease in leases]
        )
        rows = await store.unchunked("batch_r", 100)
        assert len(rows) == 10
        assert await one.write_chunk("batch_r", rows[:6])
        assert not await two.write_chunk("batch_r", rows[4:])  # lines 4 and 5 are taken
        chunks = await store.chunks("batch_r")
        assert [c.out_lines for c in chunks] == [6]
        assert [p.name for p in (tmp_path / "files" / "batches" / "batch_r" / "chunks").iterdir()] == [
            chunks[0].chunk_id
        ]
        assert [r[0] for r in await store.unchunked("batch_r", 100)] == [6, 7, 8, 9]

    asyncio.run(go())


def test_retention_deletes_finished_batches_with_their_rows_and_files(env, tmp_path):
    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        runner = _runner(store, objects, clock, retention_s=3600.0, sweep_s=10.0)
        await _new_batch(store, "batch_old", 20, clock.now)
        old = await _drain(runner, clock, "batch_old", store)
        old_key = _file_key(accounts, old["output_file_id"])
        clock.now += 1800
        await _new_batch(store, "batch_young", 20, clock.now)
        young = await _drain(runner, clock, "batch_young", store)
        await _new_batch(store, "batch_running", 5, clock.now)
        with accounts.engine.begin() as c:  # its lines are never leased
            c.execute(
                lines_table.update().where(lines_table.c.batch_id == "batch_running").values(next_at=1e12)
            )
        clock.now += 1800 + 60  # the old one is past 1 h, the young one is not
        await runner.tick()
        with pytest.raises(Exception, match="No such batch"):
            await store.get_batch(None, "batch_old")
        with pytest.raises(Exception, match="No such file"):
            await store.get_file("acme", old["output_file_id"])
        assert not (tmp_path / "files" / old_key).exists()
        with accounts.engine.connect() as c:
            left = c.execute(sa.select(lines_table.c.batch_id).distinct()).scalars().all()
        assert sorted(left) == ["batch_running", "batch_young"]
        assert (await store.get_batch(None, "batch_young"))["status"] == "completed"
        assert (tmp_path / "files" / _file_key(accounts, young["output_file_id"])).exists()
        clock.now += 10 * 24 * 3600
        await runner.tick()
        # Unfinished until now (past its window, it just expired): its retention starts now.
        assert (await store.get_batch(None, "batch_running"))["status"] == "expired"
        with pytest.raises(Exception, match="No such batch"):
            await store.get_batch(None, "batch_young")
        await runner.stop()

    asyncio.run(go())


def test_the_token_share_is_counted_over_every_replica(env):
    """Two replicas' runners on one database: the tokens one of them answered for a tenant's
    batch count against the share on the other, once committed."""

    async def go() -> None:
        _, store, objects = await env()
        clock = Clock()
        # 10 tokens an answer; a share of 0.5 of 200 tokens/min: 100 tokens, 10 answers.
        a = _runner(store, objects, clock, tpm=200, token_share=0.5, concurrency=4)
        b = _runner(store, objects, clock, tpm=200, token_share=0.5, concurrency=4)
        await _new_batch(store, "batch_t", 100, clock.now)
        batch = (await store.runnable(clock.now))[0]
        assert b._has_headroom(batch, clock.now)
        for _ in range(6):
            clock.now += 1.0
            await a.tick()
            await asyncio.sleep(0.01)
        used_by_a = a.tokens_used("acme")
        assert used_by_a >= 100, used_by_a  # a stopped itself at the share ...
        assert not a._has_headroom(batch, clock.now)
        clock.now += 1.0
        await b.tick()  # ... and b reads a's tokens from the database: no headroom either
        assert b.tokens_used("acme") >= 100
        assert not b._has_headroom(batch, clock.now)
        leased = await store.get_batch(None, "batch_t")
        assert leased["counts"].get("done", 0) * 10 == used_by_a  # b answered none
        # A minute later the window has moved on and the share opens again.
        clock.now += 121.0
        await b.tick()
        assert b.tokens_used("acme") < 100
        await a.stop()
        await b.stop()

    asyncio.run(go())


def test_a_tenant_has_at_most_max_active_unfinished_batches(env):
    """Each batch holds its lines in the database until it ends, and one file may be batched
    any number of times: past the bound a create is refused (the API's 429) and stores
    nothing; a finished batch frees its place."""

    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        row = {
            "tenant": "acme", "key_id": "k1", "endpoint": "/v1/chat/completions", "model": "tiny",
            "input_file_id": "file-in", "completion_window": "24h", "status": "in_progress",
            "metadata": None, "total": 1, "created_at": clock.now, "in_progress_at": clock.now,
            "expires_at": clock.now + 86400,
        }  # fmt: skip

        def one_line():
            return iter([("c0", json.dumps({"n": 0}))])

        await store.create_batch({**row, "id": "batch_a"}, one_line(), max_active=2)
        await store.create_batch({**row, "id": "batch_b"}, one_line(), max_active=2)
        with pytest.raises(TooManyBatches):
            await store.create_batch({**row, "id": "batch_c"}, one_line(), max_active=2)
        with pytest.raises(GatewayError):
            await store.get_batch(None, "batch_c")  # nothing of it stored
        await store.create_batch({**row, "id": "batch_o", "tenant": "other"}, one_line(), max_active=2)
        await _drain(_runner(store, objects, clock), clock, "batch_a", store)
        await store.create_batch({**row, "id": "batch_c"}, one_line(), max_active=2)
        await accounts.close()

    asyncio.run(go())


def test_concurrent_creates_never_pass_max_active_together(env):
    """Creates of one tenant at the same instant (many replicas, one database) count the
    batches one after another: exactly `max_active` of them are stored."""

    async def go() -> None:
        accounts, store, _objects = await env()
        now = Clock().now
        row = {
            "tenant": "acme", "key_id": "k1", "endpoint": "/v1/chat/completions", "model": "tiny",
            "input_file_id": "file-in", "completion_window": "24h", "status": "in_progress",
            "metadata": None, "total": 1, "created_at": now, "in_progress_at": now,
            "expires_at": now + 86400,
        }  # fmt: skip

        async def create(i: int) -> bool:
            try:
                await store.create_batch({**row, "id": f"batch_{i}"}, iter([("c0", "{}")]), max_active=3)
            except TooManyBatches:
                return False
            return True

        stored = await asyncio.gather(*(create(i) for i in range(12)))
        assert sum(stored) == 3
        listed, _ = await store.list_batches("acme", after=None, limit=100)
        assert len(listed) == 3
        await accounts.close()

    asyncio.run(go())


def test_two_replicas_sweeping_at_once_delete_each_batch_once(env, tmp_path):
    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        a = _runner(store, objects, clock, retention_s=60.0, sweep_batches=3)
        b = _runner(store, objects, clock, retention_s=60.0, sweep_batches=3)
        ids = [f"batch_{i}" for i in range(6)]
        for batch_id in ids:
            await _new_batch(store, batch_id, 3, clock.now)
        for batch_id in ids:
            await _drain(a, clock, batch_id, store)
        clock.now += 3600
        deleted: list[str] = []
        real = store.delete_batch

        async def counted(batch_id, file_ids):
            gone = await real(batch_id, file_ids)
            if gone:
                deleted.append(batch_id)
            return gone

        store.delete_batch = counted  # type: ignore[method-assign]
        for _ in range(3):  # 3 per sweep each: two rounds of both clear the 6
            await asyncio.gather(a._sweep(clock.now), b._sweep(clock.now))
        assert sorted(deleted) == ids  # each once
        with accounts.engine.connect() as c:
            for table in (lines_table, chunks_table, files_table):
                assert c.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0
        # No object is left: output files and chunk folders alike.
        assert [p for p in (tmp_path / "files").rglob("*") if p.is_file()] == []
        await a.stop()
        await b.stop()

    asyncio.run(go())


def test_expiring_files_are_deleted_by_the_sweep_and_outputs_expire_with_retention(env, tmp_path):
    async def go() -> None:
        _, store, objects = await env()
        clock = Clock()
        runner = _runner(store, objects, clock, retention_s=7200.0)
        await _new_batch(store, "batch_e", 4, clock.now)
        done = await _drain(runner, clock, "batch_e", store)
        output = await store.get_file("acme", done["output_file_id"])
        assert output["expires_at"] == done["completed_at"] + 7200
        src = tmp_path / "upload"
        src.write_bytes(b"{}\n")
        rows = {}
        for file_id, expires_at in (("file-soon", clock.now + 3600), ("file-kept", None)):
            rows[file_id] = {
                "id": file_id,
                "tenant": "acme",
                "purpose": "batch",
                "filename": "in.jsonl",
                "bytes": 3,
                "created_at": clock.now,
                "object_key": f"files/acme/{file_id}",
                "lines": 1,
                "url": "/v1/chat/completions",
                "model": "tiny",
            }
            await objects.put_file(rows[file_id]["object_key"], str(src))
            await store.add_file(rows[file_id], expires_at=expires_at)
        listed, _ = await store.list_files("acme", purpose=None, after=None, limit=10, ascending=True)
        assert {r["id"]: r["expires_at"] for r in listed}["file-soon"] == clock.now + 3600
        clock.now += 3601
        await runner._sweep(clock.now)
        with pytest.raises(Exception, match="No such file"):
            await store.get_file("acme", "file-soon")
        assert not (tmp_path / "files" / "files/acme/file-soon").exists()
        assert (await store.get_file("acme", "file-kept"))["expires_at"] is None
        assert (await store.get_file("acme", done["output_file_id"]))["id"]  # not yet
        clock.now += 3600
        await runner._sweep(clock.now)
        with pytest.raises(Exception, match="No such file"):
            await store.get_file("acme", done["output_file_id"])
        assert (tmp_path / "files" / "files/acme/file-kept").exists()
        await runner.stop()

    asyncio.run(go())


def test_a_finalize_outlasting_its_lease_keeps_it_and_is_not_taken_over(env):
    """A finalizer whose assembly takes longer than the finalize lease (a slow object store)
    renews it meanwhile: another replica's ticks, long past the lease it took, do not start the
    same files again, and the first publishes them."""

    async def go() -> None:
        accounts, store, objects = await env()
        clock = Clock()
        # Finalize lease 4 * 0.3 = 1.2 s of the simulated clock, renewed every 0.1 s.
        a = _runner(store, objects, clock, lease_s=0.3)
        b = _runner(store, objects, clock, lease_s=0.3)
        await _new_batch(store, "batch_slow", 30, clock.now)
        puts: list[str] = []
        blocked, release, renewed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        real_put, real_renew = objects.put_file, store.renew_finalize

        async def put_file(key, path):
            if not key.startswith("batches/"):  # the published file, not a chunk
                puts.append(key)
                blocked.set()
                await release.wait()
            return await real_put(key, path)

        async def renew_finalize(*args):
            ours = await real_renew(*args)
            renewed.set()
            return ours

        objects.put_file = put_file  # type: ignore[method-assign]
        store.renew_finalize = renew_finalize  # type: ignore[method-assign]
        drain = asyncio.ensure_future(_drain(a, clock, "batch_slow", store))
        await asyncio.wait_for(blocked.wait(), 60)
        for _ in range(4):  # 4 s: past the lease a took
            clock.now += 1.0
            renewed.clear()
            await asyncio.wait_for(renewed.wait(), 30)
            await b.tick()
            with accounts.engine.connect() as c:
                owner = c.execute(
                    sa.select(batches_table.c.finalize_owner).where(batches_table.c.id == "batch_slow")
                ).scalar_one()
            assert owner == a.owner
        assert len(puts) == 1, puts
        release.set()
        done = await asyncio.wait_for(drain, 60)
        assert done["status"] == "completed" and done["completed"] == 30
        assert len(puts) == 1, puts
        await a.stop()
        await b.stop()

    asyncio.run(go())


def test_finalizing_a_50000_line_batch_holds_one_chunk_at_a_time(tmp_path):
    """The finalizer of a 50,000-line batch whose answers are all still in their rows (a
    replica that died before writing any chunk): it reads, writes and concatenates them a chunk
    at a time, so its Python memory peak is a small part of the 20 MB output."""
    import tracemalloc

    async def go() -> None:
        accounts = GatewayStore(f"sqlite:///{tmp_path / 'gw.sqlite'}")
        await accounts.start()
        store = BatchStore(accounts)
        await store.start()
        objects = LocalObjectStore(tmp_path / "files")
        clock = Clock()
        runner = _runner(store, objects, clock, chunk_lines=1000)
        n, pad = 50_000, "x" * 380
        await _new_batch(store, "batch_big", n, clock.now)
        with accounts.engine.begin() as c:
            c.execute(
                lines_table.update()
                .where(lines_table.c.batch_id == "batch_big")
                .values(
                    state="done",
                    result=sa.literal('{"custom_id":"c')
                    + sa.cast(lines_table.c.line_no, sa.String)
                    + sa.literal(f'","pad":"{pad}"}}'),
                )
            )
        tracemalloc.start()
        try:
            await runner._finalize(clock.now)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        done = await store.get_batch(None, "batch_big")
        assert done["status"] == "completed" and done["completed"] == n
        output = await store.get_file("acme", done["output_file_id"])
        assert output["bytes"] > 20_000_000
        assert peak < output["bytes"] / 4, peak
        ids = [
            json.loads(x)["custom_id"]
            for x in (tmp_path / "files" / output["object_key"]).read_bytes().splitlines()
        ]
        assert len(ids) == len(set(ids)) == n
        await runner.stop()

    asyncio.run(go())
