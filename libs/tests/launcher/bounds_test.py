"""The launcher's bounds: the gate's connection cap and idle timeout, the cache lock's deadline
(its error names the holder's pid), and validation of their flags."""

import asyncio
import json
import subprocess
import sys

import pytest

from paved.launcher.build import build_package
from paved.launcher.cache import Cache, FileLock, LockTimeout
from paved.launcher.gate import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, Gate, Route
from paved.launcher.main import main
from paved.launcher.testing import minimal_hf_dir, subprocess_env


# ---- the gate ------------------------------------------------------------------------------------
async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def _connect_and_echo(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping")
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"  # relayed end to end
    return reader, writer


@pytest.mark.parametrize("route_name", ["http", "grpc"])
def test_gate_connection_cap_refuses_the_next_while_held(route_name):
    async def run():
        upstream, up_port = await _echo_server()
        gate = Gate([Route(route_name, "127.0.0.1", 0, up_port)], max_connections=2, idle_timeout_s=0)
        await gate.open()
        port = gate.bound[route_name][1]
        try:
            held = [await _connect_and_echo(port) for _ in range(2)]
            assert gate.open_connections == 2
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            refused = await asyncio.wait_for(reader.read(), 10)  # until the gate closes it
            writer.close()
            assert gate.refused == 1 and gate.open_connections == 2
            # One held connection ends: a new one is relayed again.
            held[0][1].close()
            await _until(lambda: gate.open_connections == 1, "a slot to free")
            again = await _connect_and_echo(port)
            for _, w in [held[1], again]:
                w.close()
            return refused
        finally:
            await gate.abort()
            upstream.close()

    refused = asyncio.run(run())
    if route_name == "http":
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
        error = json.loads(body)["error"]
        assert error["code"] == "overloaded" and "--max-connections" in error["message"]
        assert "2 connections" in error["message"]
    else:
        assert refused == b""  # not HTTP/2: closed


def test_a_grpc_client_over_the_cap_reads_unavailable_naming_the_limit():
    import grpc

    async def run():
        upstream, up_port = await _echo_server()
        gate = Gate([Route("grpc", "127.0.0.1", 0, up_port)], max_connections=1, idle_timeout_s=0)
        await gate.open()
        port = gate.bound["grpc"][1]
        try:
            held = await _connect_and_echo(port)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"", timeout=10)
            assert gate.refused >= 1 and gate.open_connections == 1
            held[1].close()
            return e.value
        finally:
            await gate.abort()
            upstream.close()

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "1 connections open" in error.details() and "--max-connections" in error.details(), error


def test_gate_closes_idle_connections_and_keeps_busy_ones():
    async def run():
        upstream, up_port = await _echo_server()
        gate = Gate([Route("http", "127.0.0.1", 0, up_port)], max_connections=8, idle_timeout_s=1.5)
        await gate.open()
        port = gate.bound["http"][1]
        try:
            idle_reader, idle_writer = await _connect_and_echo(port)
            busy_reader, busy_writer = await _connect_and_echo(port)
            # The busy one moves a byte every 50 ms, far more often than the 1.5 s timeout.
            for _ in range(60):
                busy_writer.write(b"b")
                await busy_writer.drain()
                assert await asyncio.wait_for(busy_reader.readexactly(1), 10) == b"b"
                await asyncio.sleep(0.05)
                if gate.idle_closed:
                    break
            # The idle one is closed by the gate (EOF), the busy one is still relayed.
            assert await asyncio.wait_for(idle_reader.read(), 30) == b""
            assert gate.idle_closed == 1 and gate.open_connections == 1
            busy_writer.write(b"still")
            await busy_writer.drain()
            assert await asyncio.wait_for(busy_reader.readexactly(5), 10) == b"still"
            idle_writer.close()
            busy_writer.close()
        finally:
            await gate.abort()
            upstream.close()

    asyncio.run(run())


def test_gate_defaults_and_bad_values():
    gate = Gate([])
    assert (gate.max_connections, gate.idle_timeout_s) == (DEFAULT_MAX_CONNECTIONS, DEFAULT_IDLE_TIMEOUT_S)
    assert (DEFAULT_MAX_CONNECTIONS, DEFAULT_IDLE_TIMEOUT_S) == (1024, 600.0)
    with pytest.raises(ValueError):
        Gate([], max_connections=0)
    with pytest.raises(ValueError):
        Gate([], idle_timeout_s=-1)


# ---- the cache lock ------------------------------------------------------------------------------
HOLDER = r"""
import sys
from paved.launcher.cache import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin
lock.release()
"""


class Holder:
    """Another process holding `path` exclusively until closed."""

    def __init__(self, path: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        assert self.proc.stdout.readline().strip() == "held"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def test_lock_deadline_names_the_holders_pid(tmp_path):
    path = str(tmp_path / "pkg-x.lock")
    holder = Holder(path)
    try:
        with pytest.raises(LockTimeout) as info:
            FileLock(path, timeout_s=0.2).acquire()
        message = str(info.value)
        assert f"held by pid {holder.proc.pid}" in message and "0.2 s" in message and path in message
        assert FileLock(path).holder() == holder.proc.pid
        assert FileLock(path).acquire(blocking=False) is False  # still held: not a stale report
    finally:
        holder.close()
    lock = FileLock(path, timeout_s=0.2)
    assert lock.acquire() is True  # released: acquired at once
    lock.release()
    assert FileLock(path).holder() is None  # no stale pid left behind


def test_cache_locks_take_the_cache_deadline(tmp_path):
    cache = Cache(str(tmp_path / "c"), lock_timeout_s=0.1)
    assert cache.lock("gc").timeout_s == 0.1
    assert Cache(str(tmp_path / "d")).lock("gc").timeout_s == 3600.0


def test_launcher_fails_with_the_holders_pid_when_the_lock_deadline_passes(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    build_package(minimal_hf_dir(tmp_path / "hf"), str(pkg), "fake", "1")
    cache_dir = tmp_path / "cache"
    Cache(str(cache_dir))
    # An evicting launcher holds the gc lock exclusively: materializing must wait for it.
    holder = Holder(str(cache_dir / "locks" / "gc.lock"))
    try:
        code = main([str(pkg), "--cache-dir", str(cache_dir), "--materialize-only", "--lock-timeout", "0.3"])
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert code == 1 and f"held by pid {holder.proc.pid}" in err and "lock timeout" in err
    code = main([str(pkg), "--cache-dir", str(cache_dir), "--materialize-only", "--lock-timeout", "0.3"])
    assert code == 0


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-connections", "0"], "--max-connections must be >= 1"),
        (["--idle-timeout", "-1"], "--idle-timeout must be >= 0"),
        (["--lock-timeout", "0"], "--lock-timeout must be > 0"),
        (["--lock-timeout", "nan"], "--lock-timeout must be > 0"),
        (["--port", "65536"], "--port must be 0..65535 (0: any free port), got 65536"),
        (["--port", "-1"], "--port must be 0..65535"),
        (["--grpc-port", "70000"], "--grpc-port must be 0..65535"),
        (["--admin-port", "-5"], "--admin-port must be 0..65535"),
        (["--start-timeout", "nan"], "--start-timeout must be > 0 seconds, got nan"),
        (["--start-timeout", "0"], "--start-timeout must be > 0 seconds"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0 seconds, got -1.0"),
        (["--drain-timeout", "inf"], "--drain-timeout must be >= 0 seconds"),
        (["--stop-grace", "nan"], "--stop-grace must be >= 0 seconds"),
        (["--child-cmd", "{python} -m x --port {htp_port}"], "--child-cmd: unknown placeholder {htp_port}"),
        (["--child-cmd", "{python} -c 'print(1)"], "--child-cmd: No closing quotation"),
        (["--child-cmd", "{python} {0}"], "--child-cmd: '{0}': Replacement index 0"),
        (["--child-cmd", "  "], "--child-cmd: empty command"),
    ],
)
def test_bad_bound_flags_exit_2(tmp_path, capsys, flags, needle):
    """Checked before anything starts (the package, tmp_path, is no package at all)."""
    assert main([str(tmp_path), "--cache-dir", str(tmp_path / "c"), *flags]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--part-size", "9" * 400], "argument --part-size: too large"),
        (["--part-size", "9" * 400 + ".5GiB"], "argument --part-size: too large"),
        (["--cache-max-bytes", "9" * 20], "argument --cache-max-bytes: too large"),
    ],
)
def test_out_of_range_sizes_are_usage_errors(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--cache-dir", str(tmp_path / "c"), *flags])
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_bad_cache_budget_in_the_environment_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PAVED_CACHE_MAX_BYTES", "lots")
    assert main([str(tmp_path), "--cache-dir", str(tmp_path / "c")]) == 2
    assert "$PAVED_CACHE_MAX_BYTES (--cache-max-bytes): not a size: 'lots'" in capsys.readouterr().err
