"""RedisLimiter admissions whose reply never reached the caller: the caller was cancelled (a
gRPC client's deadline, a client gone) or the limiter's own deadline passed while the script
had already run in Redis. Nobody holds those reservations, so nobody finishes them: they held
their concurrency slots and tokens for the whole lease (10 min), a key with max_concurrent N
locked out after N of them. Each is now undone by its id.

A real redis-server behind a loopback relay that holds the replies of EVALSHA while the test
keeps its gate closed, so the script runs in Redis and its reply is delivered only after the
caller has gone: every outcome is decided by that order, not by timing."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from paved.gateway.access.limits import _ACQUIRE, RedisLimiter, _plan
from paved.gateway.errors import GatewayError
from paved.gateway.types import Limits, Principal, Tenant
from paved.testing.redis import redis_server

CONCURRENT, TPM = 100, 10_000
P = Principal(
    "k1", "name", Tenant("t1", "Tenant"), key_limits=Limits(max_concurrent=CONCURRENT, tokens_per_min=TPM)
)


@pytest.fixture(scope="module")
def url():
    with redis_server() as u:
        yield u


class _HeldReplies:
    """A TCP relay to Redis that holds each EVALSHA's reply until `gate` opens."""

    def __init__(self, url: str):
        self._port = int(url.rsplit(":", 1)[1].split("/")[0])
        self.gate = asyncio.Event()
        self.gate.set()
        self.evals_sent = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._relay(client_r, client_w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._port)
        evals = 0

        async def up() -> None:
            nonlocal evals
            while data := await client_r.read(65536):
                if b"EVALSHA" in data:
                    evals += 1
                    self.evals_sent += 1
                server_w.write(data)
                await server_w.drain()

        async def down() -> None:
            nonlocal evals
            while data := await server_r.read(65536):
                if evals:
                    evals = 0
                    await self.gate.wait()
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client_w.close()
            server_w.close()

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _in_use_and_tokens(direct: RedisLimiter) -> tuple[int, int]:
    snap = await direct.snapshot(P)
    return snap["key"]["max_concurrent"]["in_use"], snap["key"]["tokens_per_min"]["remaining"]


async def _until(direct: RedisLimiter, check, what: str) -> None:
    for _ in range(500):  # ~10 s at most: a bound on a wait, never a measured duration
        if check(*await _in_use_and_tokens(direct)):
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"{what}: {await _in_use_and_tokens(direct)} (slots in use, tokens remaining)")


def test_acquires_whose_caller_left_or_timed_out_after_the_script_ran_take_nothing_in_the_end(url):
    async def go() -> None:
        prefix = f"test:{uuid.uuid4().hex}:"
        relay = _HeldReplies(url)
        direct = RedisLimiter(url, key_prefix=prefix, timeout_s=5.0)
        held = RedisLimiter(await relay.start(), key_prefix=prefix, timeout_s=0.3)
        try:
            await held.finish(await held.acquire(P, 0), 0)  # connected, scripts loaded
            assert await _in_use_and_tokens(direct) == (0, TPM)
            for i in range(10):
                relay.gate.clear()
                sent = relay.evals_sent
                if i % 2 == 0:
                    # The caller is cancelled while the admission's reply is on its way.
                    task = asyncio.ensure_future(held.acquire(P, 100))
                    await _until(direct, lambda n, _t: n == 1, "the script never ran")
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:
                    # The limiter's own deadline passes while the reply is on its way: a 503.
                    with pytest.raises(GatewayError) as refused:
                        await held.acquire(P, 100)
                    assert refused.value.code == "limiter_unavailable"
                    await _until(direct, lambda n, _t: n >= 1, "the script never ran")
                assert relay.evals_sent > sent
                relay.gate.set()
                # Nobody holds this reservation: its slot and its tokens come back.
                await _until(direct, lambda n, t: n == 0 and t >= TPM - 1, "the lost admission was kept")
        finally:
            relay.gate.set()
            await held.close()
            await direct.close()
            await relay.close()

    asyncio.run(go())


def test_an_undo_that_overtakes_its_acquire_makes_it_admit_nothing(url):
    """The undo can reach Redis before the acquire it undoes (still in a socket buffer): it
    leaves a tombstone, and the acquire that arrives later takes nothing."""

    async def go() -> None:
        prefix = f"test:{uuid.uuid4().hex}:"
        lim = RedisLimiter(url, key_prefix=prefix, timeout_s=5.0)
        try:
            limits = _plan(P, 100)
            rid = uuid.uuid4().hex
            await lim._undo(rid, [lim_ for lim_ in limits if lim_.kind != "rpm"])
            args: list[str | int | float] = ["600.0", rid, 1500]
            for lim_ in limits:
                args += [lim_.kind, lim_.capacity, lim_.need]
            reply = await lim._eval(_ACQUIRE, [lim._marker(rid), *map(lim._key, limits)], args)
            assert [int(v) for v in reply] == [0]
            assert await _in_use_and_tokens(lim) == (0, TPM)
            # An ordinary admission is unaffected.
            res = await lim.acquire(P, 100)
            assert await _in_use_and_tokens(lim) == (1, TPM - 100)
            await lim.finish(res, None)
            assert await _in_use_and_tokens(lim) == (0, TPM)
        finally:
            with contextlib.suppress(Exception):
                await lim.close()

    asyncio.run(go())
