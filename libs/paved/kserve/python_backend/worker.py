"""The server's side of one Python-model instance: its worker process and their channel.

A `Worker` starts `python -m paved.kserve.python_backend.stub` with one end of a socketpair,
reads every frame the worker sends on one task (responses, BLS requests, log lines, replies),
and logs the worker's stdout and stderr line by line, prefixed with `[model/instance]`.

Invariants the model (paved.kserve.python_backend.served) relies on:
- `execute` returns the worker's (responses, error) for a batch, or raises a KServeError
  (INTERNAL "Stub process ... is not healthy: <reason>") when the worker dies or hangs while
  executing it, or UNAVAILABLE when the worker could not be restarted. A worker
  hangs when it sends nothing for `execute_timeout_s` while executing and no BLS call of its
  own is in flight; it is then killed.
- When a worker dies (crash, kill, a failed frame), everything it had in flight fails once with
  the reason, `on_death` tells the model (which fails the requests still streaming from it),
  and a new process is started and initialized; `execute` waits for that restart, and if the
  restart failed, fails at once and tries again on the next call.
- A worker's death is seen from the channel's end or from its process's exit (a process the
  model forked may hold the channel open); the worker is its own process group, killed whole.
- `stop` asks the model to finalize (bounded wait), then kills; no process outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from paved.kserve.errors import KServeError, unavailable
from paved.kserve.python_backend import frames

logger = logging.getLogger(__name__)

STUB_MODULE = "paved.kserve.python_backend.stub"
# How long finalize() may take at shutdown before the process is killed.
FINALIZE_TIMEOUT_S = 5.0
# After the worker process exited (its process group killed), how long the frames it sent
# before it died may take to be read before the channel is given up for closed.
EXIT_DRAIN_S = 2.0
# How long a worker killed with SIGKILL may take to be gone before its death is handled anyway.
KILL_WAIT_S = 30.0
# How often a worker's process is checked for having exited (see _exited): from the first
# interval, doubling up to the last.
EXIT_POLL_S = (0.01, 0.5)
# pb_utils.LogLevel -> logging level.
_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}


class Worker:
    def __init__(
        self,
        *,
        model: str,
        name: str,
        cwd: str,
        args: dict[str, str],
        execute_timeout_s: float,
        initialize_timeout_s: float,
        on_message: Callable[[Worker, tuple], None],
        on_bls: Callable[[dict, Callable[[tuple], Awaitable[None]]], Awaitable[None]],
        on_death: Callable[[Worker, KServeError], None],
    ):
        self.model = model
        self.name = name  # the instance's name, as initialize(args) sees it
        self.tag = f"[{model}/{name}]"  # what the worker's log lines start with
        self.cwd = cwd
        self.args = args
        self.execute_timeout_s = execute_timeout_s
        self.initialize_timeout_s = initialize_timeout_s
        self._on_message = on_message
        self._on_bls = on_bls
        self._on_death = on_death
        self.process: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._tasks: set[asyncio.Task] = set()
        self._bls_tasks: set[asyncio.Task] = set()
        self._replies: dict[str, asyncio.Future] = {}
        self._executions: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._alive = False
        self._kill_reason = ""
        self._died = asyncio.Event()
        self._restart: asyncio.Task | None = None
        # Set while a death is being handled (see _handle_death): no restart starts meanwhile.
        self._dying: asyncio.Future | None = None
        self._broken = ""  # why the last restart failed ("" when running or restartable)
        self._stopping = False
        self.last_activity = time.monotonic()
        self.restarts = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the process (not yet initialized)."""
        parent, child = socket.socketpair()
        env = dict(os.environ)
        # The worker imports paved and whatever the model imports from this interpreter's path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["PYTHONUNBUFFERED"] = "1"
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                STUB_MODULE,
                str(child.fileno()),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.cwd,
                env=env,
                # Its own process group: what the model forks (multiprocessing's default start
                # on Linux) is killed with it, and holds no socket or pipe of a dead worker open.
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        self._alive = True
        self._kill_reason = ""
        self._died = asyncio.Event()
        self.last_activity = time.monotonic()
        for stream, level in ((self.process.stdout, logging.INFO), (self.process.stderr, logging.WARNING)):
            if stream is not None:
                self._spawn(self._log_lines(stream, level))
        self._spawn(self._watch_exit(self.process, self._spawn(self._read())))

    async def auto_complete(self, model_file: str, config_json: str) -> str:
        config, error = await self._call(
            ("auto_complete", model_file, config_json), "auto_completed", self.initialize_timeout_s
        )
        if error is not None:
            raise RuntimeError(f"auto_complete_config failed: {error}")
        return config

    async def initialize(self) -> None:
        (error,) = await self._call(("initialize", dict(self.args)), "initialized", self.initialize_timeout_s)
        if error is not None:
            raise RuntimeError(f"initialize failed: {error}")

    async def stop(self) -> None:
        self._stopping = True
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
        if self._alive:
            with contextlib.suppress(KServeError):  # killed (or dead) instead
                await self._call(("finalize",), "finalized", FINALIZE_TIMEOUT_S)
        await self._kill("was stopped")
        for task in list(self._tasks | self._bls_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._bls_tasks, return_exceptions=True)

    async def _kill(self, reason: str) -> None:
        if self.process is None:
            return
        if self._alive and not self._kill_reason:
            self._kill_reason = reason
        if self.process.returncode is None:
            _kill_group(self.process)
        await _exited(self.process)
        if self._alive:
            await self._died.wait()  # _watch_exit sees to it, whoever holds the socket

    # ---- requests ----------------------------------------------------------------------------
    async def execute(self, requests: list[dict]) -> tuple[list | None, str | None]:
        """Run one batch: the worker's responses (None: the model answers through response
        senders) and its error (None, or the text of what execute() raised)."""
        await self._ensure_running()
        exec_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._executions[exec_id] = future
        try:
            await self.send(("execute", exec_id, requests))
            self.last_activity = time.monotonic()
            return await self._watch(future, "execute()")
        finally:
            self._executions.pop(exec_id, None)

    async def send(self, message: tuple) -> None:
        if not self._alive or self._writer is None:
            raise unavailable(f"model '{self.model}' instance '{self.name}' is not running")
        self._writer.writelines(frames.encode(message))
        try:
            await self._writer.drain()
        except ConnectionError as e:
            raise unavailable(f"model '{self.model}' instance '{self.name}': the worker is gone ({e})") from e

    @property
    def bls_tasks(self) -> frozenset[asyncio.Task]:
        """The BLS calls of this worker's model being served now (each a task running on_bls)."""
        return frozenset(self._bls_tasks)

    def cancel(self, key: int) -> None:
        """Tell the model that request `key` was cancelled (its is_cancelled() turns true)."""
        if self._alive:
            self._spawn(self._send_quietly(("cancel", key)))

    async def _send_quietly(self, message: tuple) -> None:
        with contextlib.suppress(KServeError):  # the worker is gone: nothing left to tell
            await self.send(message)

    async def _watch(self, future: asyncio.Future, what: str) -> Any:
        """`future`'s result; the worker is killed if it goes silent for the timeout while no
        BLS call of its own is in flight (a BLS call may legitimately take long)."""
        timeout = self.execute_timeout_s
        while True:
            idle = time.monotonic() - self.last_activity
            remaining = timeout - idle if not self._bls_tasks else timeout
            if remaining <= 0:
                await self._kill(
                    f"did not finish {what} within {timeout:g} s (paved_execute_timeout_s) and was killed"
                )
                return await future  # failed by the death
            try:
                return await asyncio.wait_for(asyncio.shield(future), remaining)
            except TimeoutError:
                continue

    async def _call(self, message: tuple, reply: str, limit_s: float) -> tuple:
        future = asyncio.get_running_loop().create_future()
        self._replies[reply] = future
        try:
            await self.send(message)
            try:
                return await asyncio.wait_for(asyncio.shield(future), limit_s)
            except TimeoutError:
                await self._kill(f"did not answer {message[0]} within {limit_s:g} s and was killed")
                return await future
        finally:
            self._replies.pop(reply, None)

    async def _ensure_running(self) -> None:
        if self._dying is not None and not self._dying.done():
            await asyncio.shield(self._dying)
        if self._restart is not None and not self._restart.done():
            await asyncio.shield(self._restart)
        if self._alive:
            return
        if self._stopping:
            raise unavailable(f"model '{self.model}' is shutting down")
        reason = self._broken or "is not running"
        # Try again for the next request, so a transient failure does not last.
        self._broken = ""
        self._restart = asyncio.create_task(self._restart_process(), name=f"pb-restart-{self.name}")
        raise unavailable(f"model '{self.model}' instance '{self.name}' {reason}; restarting it")

    async def _restart_process(self) -> None:
        self.restarts += 1
        logger.warning("model %s: restarting instance %s", self.model, self.name)
        try:
            await self.start()
            await self.initialize()
            logger.info("model %s: instance %s restarted", self.model, self.name)
        except Exception as e:  # noqa: BLE001 - recorded, retried on the next request
            self._broken = f"could not be restarted: {e}"
            logger.error("model %s: instance %s %s", self.model, self.name, self._broken)
            if self._alive:
                await self._kill(self._broken)

    # ---- the channel -------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _receive(self) -> tuple:
        if self._reader is None:
            raise ConnectionError("not started")
        header = await self._reader.readexactly(frames.HEADER.size)
        return frames.decode(header, await self._reader.readexactly(frames.body_size(header)))

    async def _watch_exit(self, process: asyncio.subprocess.Process, reader: asyncio.Task) -> None:
        """The worker's death once its process exits, even while something else holds its end
        of the socket open (the channel's end would then never come: a process the model forked
        inherited it), and no process of its group left behind."""
        await _exited(process)
        _kill_group(process)
        await asyncio.wait({reader}, timeout=EXIT_DRAIN_S)
        # Not done, and not already handling the death: a descendant that left the group still
        # holds the socket.
        if not reader.done() and self._alive:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self._handle_death("")

    async def _read(self) -> None:
        broken = ""
        try:
            while True:
                message = await self._receive()
                self.last_activity = time.monotonic()
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a frame we cannot read: the worker is unusable
            broken = f"sent a frame that could not be read ({type(e).__name__}: {e})"
            logger.exception("model %s instance %s: bad frame", self.model, self.name)
        await self._handle_death(broken)

    def _dispatch(self, message: tuple) -> None:
        op = message[0]
        if op == "executed":
            future = self._executions.get(message[1])
            if future is not None and not future.done():
                future.set_result((message[2], message[3]))
        elif op == "bls":
            _, call_id, body = message
            task = asyncio.create_task(self._bls(call_id, body))
            self._bls_tasks.add(task)
            task.add_done_callback(self._bls_tasks.discard)
        elif op == "log":
            logger.log(_LOG_LEVELS.get(message[1], logging.INFO), "%s %s", self.tag, message[2])
        elif op in ("auto_completed", "initialized", "finalized"):
            future = self._replies.get(op)
            if future is not None and not future.done():
                future.set_result(message[1:])
        else:
            self._on_message(self, message)

    async def _bls(self, call_id: int, body: dict) -> None:
        async def reply(response: tuple) -> None:
            await self.send(("bls_response", call_id, *response))

        try:
            await self._on_bls(body, reply)
        except KServeError:
            pass  # the worker died meanwhile: nobody waits for the answer
        finally:
            # The model waited on the server meanwhile: its silence was not a hang.
            self.last_activity = time.monotonic()

    async def _log_lines(self, stream: asyncio.StreamReader, level: int) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the reader's limit: log what there is
                line = await stream.read(65536)
            if not line:
                return
            logger.log(level, "%s %s", self.tag, line.decode(errors="replace").rstrip())

    async def _handle_death(self, broken: str) -> None:
        """Fail what the dead worker had in flight, once, then restart it. What it acts on is
        taken before its first wait: an execute() arriving meanwhile waits for `_dying` instead
        of restarting, so this never closes, kills or fails the worker that replaces it."""
        if not self._alive:
            return
        self._alive = False
        dying = self._dying = asyncio.get_running_loop().create_future()
        process, writer = self.process, self._writer
        in_flight = [*self._executions.values(), *self._replies.values()]
        try:
            await self._end_process(broken, process, writer, in_flight)
        finally:
            dying.set_result(None)

    async def _end_process(
        self,
        broken: str,
        process: asyncio.subprocess.Process | None,
        writer: asyncio.StreamWriter | None,
        in_flight: list[asyncio.Future],
    ) -> None:
        code = None
        if process is not None:
            if broken:
                # A bad frame from a live worker: nothing it sends can be trusted, and its
                # requests must not wait out the exit grace below.
                _kill_group(process)
            if await _exited(process, 5) is None:
                _kill_group(process)
                # Bounded: a process in uninterruptible sleep (a driver call) outlives SIGKILL,
                # and execute() calls wait for this handling to end.
                await _exited(process, KILL_WAIT_S)
            code = process.returncode
        if process is not None and code is None:
            reason = f"did not exit {KILL_WAIT_S:g} s after SIGKILL (stuck in the kernel?)"
            logger.error("model %s instance %s %s", self.model, self.name, reason)
        elif self._kill_reason:
            reason = self._kill_reason
        elif broken:
            reason = broken
        elif code is not None and code < 0:
            reason = f"was killed by signal {signal.Signals(-code).name}"
        else:
            reason = f"exited with code {code}"
        if writer is not None:
            writer.close()
        # Triton's words for a dead stub, then why and what happens next.
        error = KServeError(
            grpc.StatusCode.INTERNAL,
            f"Stub process '{self.name}' is not healthy: the worker process of model '{self.model}' "
            f"{reason}" + ("" if self._stopping else "; it is being restarted"),
        )
        if not self._stopping:
            logger.error("%s", error.message)
        for future in in_flight:
            if not future.done():
                future.set_exception(error)
        for task in list(self._bls_tasks):
            task.cancel()
        self._on_death(self, error)
        self._died.set()
        if not self._stopping and (self._restart is None or self._restart.done()):
            self._restart = asyncio.create_task(self._restart_process(), name=f"pb-restart-{self.name}")


async def _exited(process: asyncio.subprocess.Process, within_s: float | None = None) -> int | None:
    """The process's exit code once it has exited (None if it has not within `within_s`).
    Polled: Python 3.11's Process.wait() returns only once the process's pipes are closed too,
    and a process the model forked may hold them open."""
    deadline = None if within_s is None else time.monotonic() + within_s
    interval, longest = EXIT_POLL_S
    while process.returncode is None:
        if deadline is not None and time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval)
        interval = min(2 * interval, longest)
    return process.returncode


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the worker and every process of its group (its own session: pgid == pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
