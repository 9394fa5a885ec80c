"""A dynamic batcher in the manner of Triton's: coalesce concurrent requests into one model call.

Model instances are slots; a batch is formed only when a slot is free, so while every instance
is busy requests queue up and the next call takes them together (this, more than the queue
delay, is where the throughput comes from under load). Once a slot is free and a request is
waiting, the batcher waits up to `max_queue_delay_s` after that request arrived for more rows,
dispatching early when the pending rows reach the largest preferred batch size (or
`max_batch_size`). Requests are never split; rows keep their arrival order, and every
request gets exactly its own rows of the result back.

Before a batch is formed, the loop turns a few times (SETTLE_TURNS) so that requests it has
already received but not yet submitted join: microseconds when idle, and under load the
batches grow with what is in flight (a Python-backend batch awaited on the loop had no thread
hop left to absorb them: its batches shrank to ~2 rows at concurrency 32 without this).

The queue delay is kept to the microsecond, as Triton's scheduler thread keeps it: asyncio's
timers wait at least a millisecond (epoll's resolution, rounded up by `selectors`), which made
a 500 us `max_queue_delay_microseconds` cost 1-2 ms at concurrency 1. A timer thread per
batcher (`_DeadlineTimer`, started on the first delayed batch) sets the batcher's wake event at
the deadline; asyncio's own timeout stays as the fallback, so a wait is never longer than it
was without it.

The queue delay is a maximum, in Triton as here, and paved stops paying it where it buys
nothing: after FRUITLESS_WAITS waits in a row in which no request joined (a lone client, or one
that waits for each answer before sending again), batches leave at once. Waiting resumes as soon
as a request arrives while another is queued or executing (there is concurrency to gather), or
when a wait gathers one; every PROBE_EVERY-th batch waits anyway, rarely enough to stay out of
the latency's 99th percentile. At concurrency 1 a 500 us delay had cost 500-900 us on every
request and batched nothing. A model parameter `paved_adaptive_queue_delay: "false"` keeps
Triton's always-wait behaviour.

`run(batch)` is called in a worker thread (predict calls of CPU libraries release the GIL),
one thread per instance; a coroutine function `run` (a model whose work happens elsewhere, as
the Python backend's worker processes) is awaited on the event loop instead, without the two
thread hops. With `coalesce=False` each request is its own batch, which is
Triton's default scheduler (and the baseline the benchmark compares against).

The queue is bounded in rows, not requests (a request of 64 rows costs 64 times the memory
and model time of one row): `max_queue_size` rows may wait, `DEFAULT_MAX_QUEUE_ROWS` when it is
0 (Triton's "unbounded"). It is bounded in bytes too, since rows are not all alike (4096 rows of
a model taking 1M floats a row are 16 GiB): `max_queue_bytes` of the waiting requests' tensors,
`DEFAULT_MAX_QUEUE_BYTES` unless the model parameter `paved_max_queue_bytes` says otherwise. A
request that would take the waiting rows or bytes past a bound is refused with UNAVAILABLE
"Exceeds maximum queue size" (and Retry-After) at once; one request larger than a bound is still
admitted into an empty queue, so a model whose requests are big is slowed, never unusable.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np
from tritonclient.grpc import model_config_pb2

from paved.kserve.errors import unavailable
from paved.kserve.model_config import bool_parameter, int_parameter
from paved.kserve.statistics import RequestTiming, current_timing

logger = logging.getLogger(__name__)

# Rows that may wait for an instance when the config sets no max_queue_size.
DEFAULT_MAX_QUEUE_ROWS = 4096
# Bytes of tensors that may wait, unless the model parameter QUEUE_BYTES_PARAMETER sets another.
DEFAULT_MAX_QUEUE_BYTES = 1 << 30
QUEUE_BYTES_PARAMETER = "paved_max_queue_bytes"
# Turns of the event loop a batch waits for requests already received (see _form_batch).
SETTLE_TURNS = 3
# Queue-delay waits in a row that gathered nothing before batches stop waiting, and how often
# (in batches) a wait is tried anyway meanwhile (see the module docstring).
FRUITLESS_WAITS = 4
PROBE_EVERY = 256
ADAPTIVE_DELAY_PARAMETER = "paved_adaptive_queue_delay"


class _DeadlineTimer:
    """Sets an asyncio.Event at a time.monotonic() deadline, from a thread of its own (a
    condition variable's timed wait is precise to tens of microseconds; the event loop's
    timers to a millisecond). One deadline at a time: `arm` replaces it, `disarm` drops it."""

    def __init__(self, event: asyncio.Event, name: str):
        self._loop = asyncio.get_running_loop()
        self._event = event
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"batch-timer-{name}", daemon=True)
        self._thread.start()

    def arm(self, deadline: float) -> None:
        with self._cv:
            self._deadline = deadline
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._deadline = None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    # Capped: a delay of centuries (the config's field is a uint64 of
                    # microseconds) is past what a timed wait takes, which would end the thread.
                    self._cv.wait(min(remaining, 3600.0))
                    continue
                self._deadline = None
                try:
                    self._loop.call_soon_threadsafe(self._event.set)
                except RuntimeError:  # the loop is closed: nothing waits any more
                    return


# eq=False: a queued request is itself, found by identity (field equality would compare the
# rows' arrays, whose truth value numpy refuses: a cancelled request raised instead of leaving).
@dataclass(eq=False)
class _Pending:
    rows: np.ndarray
    nbytes: int
    future: asyncio.Future
    enqueued: float
    # The request's statistics record (paved.kserve.statistics), when the repository runs it.
    timing: RequestTiming | None = None


class DynamicBatcher:
    def __init__(
        self,
        run: Callable[[np.ndarray], np.ndarray] | Callable[[np.ndarray], Awaitable[np.ndarray]],
        *,
        name: str,
        max_batch_size: int,
        max_queue_delay_s: float = 0.0,
        preferred_batch_sizes: Sequence[int] = (),
        max_queue_size: int = 0,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        instances: int = 1,
        coalesce: bool = True,
        adaptive_delay: bool = True,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if any(not 1 <= p <= max_batch_size for p in preferred_batch_sizes):
            raise ValueError(f"preferred batch sizes must be in [1, {max_batch_size}]")
        if max_queue_size < 0:
            raise ValueError("max_queue_size must be >= 0 (0: the default bound)")
        if max_queue_bytes < 1:
            raise ValueError("max_queue_bytes must be >= 1")
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        # In rows.
        self.max_queue_size = max_queue_size or DEFAULT_MAX_QUEUE_ROWS
        self.max_queue_bytes = max_queue_bytes
        self.coalesce = coalesce
        self.adaptive_delay = adaptive_delay
        # Queue-delay waits in a row that gathered no request, and batches sent without a wait
        # since (see the module docstring).
        self._fruitless = 0
        self._unwaited = 0
        self._arrivals = 0  # requests submitted, ever
        # Dispatch as soon as this many rows wait.
        self._target = max(preferred_batch_sizes) if preferred_batch_sizes else max_batch_size
        self._run = run
        self._run_on_loop = inspect.iscoroutinefunction(run)
        self._executor = ThreadPoolExecutor(max_workers=instances, thread_name_prefix=f"batch-{name}")
        self._slots = asyncio.Semaphore(instances)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_rows = 0
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._timer: _DeadlineTimer | None = None
        self._scheduler: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        # Model calls in progress (not the tasks, which outlive their call a little: its callers
        # may already be sending their next requests).
        self._executing = 0
        self._closed = False
        # Batch sizes dispatched (rows), and queue-delay waits begun, for tests and the benchmark.
        self.batches: collections.Counter[int] = collections.Counter()
        self.waits = 0

    @classmethod
    def for_config(
        cls,
        run: Callable[[np.ndarray], np.ndarray] | Callable[[np.ndarray], Awaitable[np.ndarray]],
        config: model_config_pb2.ModelConfig,
        *,
        name: str,
        instances: int,
    ) -> DynamicBatcher:
        """The scheduler a Triton config asks for: with `dynamic_batching`, its queue delay,
        preferred sizes and queue bound over `max_batch_size`; without it, Triton's default
        scheduler (each request its own execution, no coalescing); with `dynamic_batching` but
        `max_batch_size` 0, Triton's loads it and runs each request alone: that scheduler, with
        the queue bound."""
        queue_bytes = int_parameter(config, QUEUE_BYTES_PARAMETER, DEFAULT_MAX_QUEUE_BYTES)
        if config.HasField("dynamic_batching") and config.max_batch_size > 0:
            db = config.dynamic_batching
            return cls(
                run,
                name=name,
                max_batch_size=config.max_batch_size,
                max_queue_delay_s=db.max_queue_delay_microseconds / 1e6,
                preferred_batch_sizes=list(db.preferred_batch_size),
                max_queue_size=db.default_queue_policy.max_queue_size,
                max_queue_bytes=queue_bytes,
                instances=instances,
                adaptive_delay=bool_parameter(config, ADAPTIVE_DELAY_PARAMETER, True),
            )
        return cls(
            run,
            name=name,
            max_batch_size=max(config.max_batch_size, 1),
            max_queue_size=config.dynamic_batching.default_queue_policy.max_queue_size,
            max_queue_bytes=queue_bytes,
            instances=instances,
            coalesce=False,
        )

    async def submit(self, rows: np.ndarray, nbytes: int | None = None) -> np.ndarray:
        """Run `rows` (first dimension = batch) through the model; returns its rows of the output.
        `nbytes`: what the request holds while it waits, when `rows` only carries it (an object
        array of envelopes); `rows.nbytes` by default."""
        if self._closed:
            raise unavailable(f"model '{self.name}' is shutting down")
        size = rows.nbytes if nbytes is None else nbytes
        if self._pending and self._pending_rows + len(rows) > self.max_queue_size:
            raise unavailable(
                f"Exceeds maximum queue size for model '{self.name}': {self._pending_rows} rows wait, "
                f"this request adds {len(rows)}, the limit is {self.max_queue_size} rows "
                "(max_queue_size)",
                retry_after_s=1,
            )
        if self._pending and self._pending_bytes + size > self.max_queue_bytes:
            raise unavailable(
                f"Exceeds maximum queue size for model '{self.name}': {self._pending_bytes} bytes of "
                f"tensors wait, this request adds {size}, the limit is {self.max_queue_bytes} bytes "
                f"(parameter {QUEUE_BYTES_PARAMETER})",
                retry_after_s=1,
            )
        if self._scheduler is None:
            # A context of its own: not the first request's (its statistics timing, say).
            self._scheduler = asyncio.create_task(
                self._schedule(), name=f"batcher-{self.name}", context=contextvars.Context()
            )
        if self._pending or self._executing:
            self._fruitless = 0  # concurrency: a wait may gather what else is on its way
        item = _Pending(
            rows, size, asyncio.get_running_loop().create_future(), time.monotonic(), current_timing.get()
        )
        self._pending.append(item)
        self._pending_rows += len(rows)
        self._pending_bytes += size
        self._arrivals += 1
        self._wake.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            # A request not yet dispatched leaves the queue; one in flight just loses its result.
            if item in self._pending:
                self._pending.remove(item)
                self._pending_rows -= len(item.rows)
                self._pending_bytes -= item.nbytes
            raise

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.close()
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(unavailable(f"model '{self.name}' is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- scheduling ----------------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._form_batch()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _form_batch(self) -> list[_Pending]:
        while not self._pending:
            self._wake.clear()
            await self._wake.wait()
        if not self.coalesce:
            item = self._pending.popleft()
            self._pending_rows -= len(item.rows)
            self._pending_bytes -= item.nbytes
            return [item]
        # Requests the loop has already received but not yet submitted (a gRPC call takes a
        # few turns of the loop from its arrival to submit) join this batch: a few turns cost
        # microseconds when idle, and under load they take in what is in flight, so the
        # batches grow with the load rather than with a wait.
        for _ in range(SETTLE_TURNS):
            if self._pending_rows >= self._target:
                break
            await asyncio.sleep(0)
        if not self._pending:  # everything waiting was cancelled meanwhile
            return await self._form_batch()
        deadline = self._pending[0].enqueued + self.max_queue_delay_s
        waited = self._pending_rows < self._target and deadline > time.monotonic()
        if waited and self.adaptive_delay and self._fruitless >= FRUITLESS_WAITS:
            self._unwaited += 1
            if self._unwaited < PROBE_EVERY:
                deadline = 0.0  # waiting has gathered nothing lately: leave now
                waited = False
            else:
                self._unwaited = 0
        before = self._arrivals
        self.waits += waited
        while self._pending_rows < self._target:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wake.clear()
            if self._timer is None:
                self._timer = _DeadlineTimer(self._wake, self.name)
            self._timer.arm(deadline)
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                break
            finally:
                self._timer.disarm()
            if not self._pending:  # everything waiting was cancelled meanwhile
                return await self._form_batch()
        if waited:
            if self._arrivals > before:
                self._fruitless, self._unwaited = 0, 0
            else:
                self._fruitless += 1
        limit = self._target if self._pending_rows >= self._target else self.max_batch_size
        batch: list[_Pending] = []
        rows = 0
        while self._pending and rows + len(self._pending[0].rows) <= limit:
            item = self._pending.popleft()
            rows += len(item.rows)
            batch.append(item)
        if not batch:  # the oldest request alone exceeds the preferred size: it still goes
            batch.append(self._pending.popleft())
            rows = len(batch[0].rows)
        self._pending_rows -= rows
        self._pending_bytes -= sum(item.nbytes for item in batch)
        return batch

    async def _execute(self, batch: list[_Pending]) -> None:
        try:
            inputs = batch[0].rows if len(batch) == 1 else np.concatenate([item.rows for item in batch])
            self.batches[len(inputs)] += 1
            loop = asyncio.get_running_loop()
            dispatched = time.monotonic_ns()
            for item in batch:
                if item.timing is not None:
                    item.timing.dispatched(int(item.enqueued * 1e9), dispatched)
            self._executing += 1
            try:
                if self._run_on_loop:
                    outputs = await cast(Callable[[np.ndarray], Awaitable[np.ndarray]], self._run)(inputs)
                else:
                    run = cast(Callable[[np.ndarray], np.ndarray], self._run)
                    outputs = await loop.run_in_executor(self._executor, run, inputs)
            finally:
                self._executing -= 1
                _record(batch, len(inputs), dispatched)
            offset = 0
            for item in batch:
                n = len(item.rows)
                if not item.future.done():
                    item.future.set_result(outputs[offset : offset + n])
                offset += n
        except Exception as e:
            logger.exception("model %s: batch of %d request(s) failed", self.name, len(batch))
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e)
        finally:
            self._slots.release()


def _record(batch: list[_Pending], rows: int, dispatched_ns: int) -> None:
    """Statistics of one execution (failed ones count too, as in Triton): once for the model
    (one batcher, one model), and its end for each request."""
    ended = time.monotonic_ns()
    model = None
    for item in batch:
        if item.timing is not None:
            item.timing.execution_ended(ended)
            model = item.timing.statistics
    if model is not None:
        model.execution(rows, ended - dispatched_ns)
