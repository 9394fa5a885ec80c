"""Per-request constraint state kept in step with vLLM's token history.

vLLM never tells a logits processor "this token was accepted"; it exposes the request's
running output-token list. The list, not the calls we receive, is the source of truth:
  * chunked (partial) prefill runs apply() for rows whose sampled token is then discarded;
    the token never enters the list, so the state never advances on it;
  * preemption either truncates the list or re-adds the request with its generated tokens
    folded into the prompt; both are detected and the state is reset and replayed.
  * async scheduling (vLLM 0.33's GPU default) appends -1 placeholders for tokens still on
    the device. vLLM's V1 runner replaces them with the sampled ids before the sampler runs
    only for processors named in `logits_processors` (InputBatch.update_async_output_token_ids,
    gated by `logitsprocs_need_output_token_ids`), which is why paved's engine names its
    processor there (see vllm_processor); Model Runner V2 has no placeholders (it reads the
    device's token history). Driven on CPU through vLLM's own InputBatch by
    constraints_async_test. A placeholder that is still there (a client that loads paved
    only through the entry point) stops the sync at it: that step is masked from the last
    known state, a later sync catches up if the id arrives, and if a step let through a
    token the constraint forbids, the row is marked broken (EOS only): such an output ends
    at once instead of continuing invalid.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

logger = logging.getLogger(__name__)


class TrackedRequest:
    """One request's State plus the exact token sequence it has consumed.

    `sync(outputs)` must be called before the state's mask is used for a step. Appending is
    O(new tokens); any divergence from what was consumed resets and replays, O(length).
    """

    __slots__ = ("_consumed", "_prefix", "broken", "state")

    def __init__(self, state, replay_prefix: Sequence[int] = ()):
        self.state = state
        # Tokens generated before a preemption that vLLM folded into the re-added prompt.
        self._prefix = list(replay_prefix)
        self._consumed: list[int] = []
        # Set when the history contains a token the constraint forbids (another processor
        # or a desync forced it); the row is then restricted to EOS so the request ends.
        self.broken = False

    def sync(self, outputs: Sequence[int]) -> None:
        history_len = len(self._prefix) + len(outputs)
        n = len(self._consumed)
        if n > history_len or (n > 0 and self._token_at(n - 1, outputs) != self._consumed[-1]):
            self._reset()
            n = 0
        for i in range(n, history_len):
            token = self._token_at(i, outputs)
            if token < 0:  # async scheduling placeholder: the real id is not known yet
                return
            self._consume(token)

    def sync_tail(self, num_outputs: int, last_output: int) -> bool:
        """Cheap sync when only the count and the newest output are known (Model Runner V2).

        Returns False when that is not enough (the history diverged); call `sync` then.
        """
        have = len(self._consumed) - len(self._prefix)
        if num_outputs <= 0:
            return have == 0
        if num_outputs == have:
            return self._consumed[-1] == last_output
        if num_outputs == have + 1 and last_output >= 0:
            self._consume(last_output)
            return True
        return False

    def _consume(self, token: int) -> None:
        self._consumed.append(token)
        if not self.broken and not self.state.advance(token):
            logger.error("paved constraint: token %d is not allowed here; ending the request", token)
            self.broken = True

    def _token_at(self, i: int, outputs: Sequence[int]) -> int:
        p = len(self._prefix)
        return self._prefix[i] if i < p else outputs[i - p]

    def _reset(self) -> None:
        self.state.reset()
        self._consumed.clear()
        self.broken = False


def _failed_future(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def first_seen(params, prompt_len: int, budget: int | None) -> tuple[int, int | None]:
    """(original prompt length, budget) of the request that owns `params`, as on its first add.

    vLLM's BatchUpdate carries no request id; a request re-added after preemption arrives with
    the same SamplingParams object (its prompt may have grown by the folded outputs). The
    first values are stored on that object's own `extra_args` (the engine core's private copy),
    so they live and die with the request: nothing is pinned after it ends and no id() can be
    mistaken for another request's.
    """
    extra = params.extra_args
    seen = extra.get(_FIRST_SEEN)
    if seen is None:
        seen = extra[_FIRST_SEEN] = (prompt_len, budget)
    return seen


_FIRST_SEEN = "_paved_first_seen"
# A DFA row is 256 int32 transitions plus an accepting flag; a catalogue trie node ~16 bytes.
_BYTES_PER_STATE = {"json_schema": 1025, "regex": 1025, "choice": 16}


def estimated_bytes(constraint) -> int:
    """Host memory a compiled constraint holds: its automaton plus its filled mask cache."""
    stats = constraint.stats()
    return stats["dfa_states"] * _BYTES_PER_STATE.get(stats["kind"], 1025) + stats["cache_bytes"]


class CompileCache:
    """Compiled constraints by spec key, bounded by entries and by one byte budget, shared by
    threads (the engine core's step thread and the precompile pool).

    A Constraint is immutable and shared by all requests with the same spec, including its
    lazily filled per-state mask cache, so repeated schemas compile once per engine. A failed
    compile is remembered too (compiles are deterministic for a vocabulary; as many entries
    as the capacity): asking again fails at once instead of compiling again. Sizes are
    re-measured on every hit (mask caches grow as requests walk new states); least recently
    used entries go first when the total is over budget. An evicted constraint stays alive for
    the requests already holding it; only new requests compile it again.
    """

    def __init__(
        self,
        compile_fn: Callable[[dict], object],
        capacity: int = 64,
        max_bytes: int | None = None,
        size_of: Callable[[object], int] = estimated_bytes,
    ):
        self._compile = compile_fn
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._size_of = size_of
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[str, Future] = {}
        self._failed: OrderedDict[str, BaseException] = OrderedDict()

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: str):
        """The compiled constraint if cached (refreshing its LRU place and size), else None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
        self._resize(key, hit[0])
        return hit[0]

    def inflight(self, key: str) -> Future | None:
        """The running compile of `key`, or its remembered failure, if any."""
        with self._lock:
            running = self._inflight.get(key)
            failed = self._failed.get(key)
        if running is None and failed is not None:
            return _failed_future(failed)
        return running

    def get(self, key: str, spec: dict):
        """The compiled constraint for `spec`, compiling it here on a miss (or waiting for the
        compile already running in the background). Raises what the compile raises."""
        hit = self.peek(key)
        if hit is not None:
            return hit
        return self.start(key, spec, None).result()

    def start(self, key: str, spec: dict, executor) -> Future:
        """A future of the compiled constraint: done at once when cached; otherwise the compile
        runs on `executor` (None: in this thread before returning). Concurrent starts of one
        key share one compile."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                done: Future = Future()
                done.set_result(hit[0])
                return done
            failed = self._failed.get(key)
            if failed is not None:
                return _failed_future(failed)
            running = self._inflight.get(key)
            if running is not None:
                return running
            future = self._inflight[key] = Future()
        if executor is None:
            self._run(key, spec, future)
        else:
            executor.submit(self._run, key, spec, future)
        return future

    def _run(self, key: str, spec: dict, future: Future) -> None:
        try:
            compiled = self._compile(spec)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            with self._lock:
                self._inflight.pop(key, None)
                if isinstance(e, Exception):
                    self._failed[key] = e
                    while len(self._failed) > self._capacity:
                        self._failed.popitem(last=False)
            future.set_exception(e)
            return
        size = self._size_of(compiled)
        with self._lock:
            self._inflight.pop(key, None)
            self._entries[key] = (compiled, size)
            self._bytes += size
            self._evict()
        future.set_result(compiled)

    def _resize(self, key: str, compiled) -> None:
        size = self._size_of(compiled)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not compiled:
                return
            self._bytes += size - entry[1]
            self._entries[key] = (compiled, size)
            self._evict()

    def _evict(self) -> None:
        # Keep the newest entry even when it alone is over budget: its requests need it.
        while len(self._entries) > 1 and (
            len(self._entries) > self._capacity
            or (self._max_bytes is not None and self._bytes > self._max_bytes)
        ):
            _, (_, size) = self._entries.popitem(last=False)
            self._bytes -= size
