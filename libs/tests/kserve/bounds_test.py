"""Every KServe edge is bounded: each test holds a bound's worth of work and shows that one more
is refused with an error naming the limit (states, not timings)."""

import asyncio
import threading

import grpc
import numpy as np
import pytest

from paved.kserve.batcher import DEFAULT_MAX_QUEUE_ROWS, DynamicBatcher
from paved.kserve.errors import KServeError


# ---- DynamicBatcher: the queue bound counts rows ---------------------------------------------------
def test_batcher_queue_bound_counts_rows_not_requests():
    gate = threading.Event()

    def run(batch):
        gate.wait(10)
        return batch

    async def main():
        batcher = DynamicBatcher(run, name="m", max_batch_size=4, max_queue_size=6)
        running = asyncio.ensure_future(batcher.submit(np.zeros((1, 1))))
        while not batcher.batches:  # the first call holds the only instance now
            await asyncio.sleep(0.01)
        # Two requests of 3 rows fill the 6-row queue (two requests: a request count would not).
        queued = [asyncio.ensure_future(batcher.submit(np.full((3, 1), i))) for i in (1, 2)]
        await asyncio.sleep(0)
        assert batcher._pending_rows == 6
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.zeros((1, 1)))
        gate.set()
        results = await asyncio.gather(running, *queued)
        # Drained: the same request is admitted now.
        again = await batcher.submit(np.zeros((1, 1)))
        await batcher.close()
        return info.value, results, again

    error, results, again = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "Exceeds maximum queue size" in error.message and "6 rows" in error.message
    assert [r.shape[0] for r in results] == [1, 3, 3] and again.shape == (1, 1)


def test_batcher_default_bound_and_an_oversized_request_alone():
    gate = threading.Event()

    def run(batch):
        gate.wait(10)
        return batch

    async def main():
        batcher = DynamicBatcher(run, name="m", max_batch_size=8)
        assert batcher.max_queue_size == DEFAULT_MAX_QUEUE_ROWS
        running = asyncio.ensure_future(batcher.submit(np.zeros((1, 1))))
        while not batcher.batches:
            await asyncio.sleep(0.01)
        # Larger than the bound, but the queue is empty: it waits alone rather than never running.
        big = asyncio.ensure_future(batcher.submit(np.zeros((DEFAULT_MAX_QUEUE_ROWS + 1, 1))))
        await asyncio.sleep(0)
        with pytest.raises(KServeError) as info:
            await batcher.submit(np.zeros((1, 1)))
        gate.set()
        await asyncio.gather(running, big)
        await batcher.close()
        return info.value

    assert f"limit is {DEFAULT_MAX_QUEUE_ROWS} rows" in asyncio.run(main()).message
    with pytest.raises(ValueError):
        DynamicBatcher(lambda b: b, name="m", max_batch_size=1, max_queue_size=-1)
