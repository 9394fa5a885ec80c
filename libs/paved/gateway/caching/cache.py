"""The gateway's answer caches: an exact cache (same canonical request, same answer) and a
semantic cache (a near-identical last question under an identical everything-else).

Keys (`cache_keys`): SHA-256 of the canonical JSON (sorted keys, no whitespace, integral floats
written as integers so 1 == 1.0, booleans kept apart from numbers) of the tenant, the model as
`alias@version`, the template as `name@N`, the endpoint and every body field that can change the
answer: everything but `IGNORED_FIELDS` and `model` (the resolved `alias@version` stands for
it). `scope` is the same hash with the last user message's text taken out (its role, name and
non-text parts kept); a semantic hit needs an identical scope, so it never crosses a tenant,
model version, template version, `response_format`, sampling parameter, tool list, system
prompt or earlier turn; nor, by default, a question with other numbers in it (`question_numbers`:
sentence embeddings cannot be trusted with them). The two hashes are domain-separated, so a
scope never equals an exact key.

Invariants callers rely on:
- Only `is_deterministic` requests are meant to be cached (temperature 0 given explicitly, or
  the operator's opt-in); only `is_cacheable_answer` answers stored: HTTP 200, a JSON object
  whose every choice finished with "stop" or "length" (never an error, a 4xx/5xx, a missing
  finish_reason, an aborted or partial answer). A stream is stored only through
  `answer_from_stream`, which returns None unless it saw `[DONE]`, no error event, and a
  finish_reason on every choice; `replay_sse` turns any stored answer back into a stream.
- Cache failures are misses: `RedisExactCache` bounds every call by `timeout_s` and turns Redis
  errors and timeouts into a miss (get), a no-op (put) or False (delete), logged at most every
  10 s, and skips Redis for `retry_after_s` after a failure (so an outage costs one timeout per
  second, not one per request); nothing here raises to the client for a cache outage.
- Bounded: the in-process exact cache by bytes (LRU) and per entry; Redis entries per entry and
  by TTL (SET PX); the semantic cache by `max_entries` and `max_bytes` (oldest first), per entry
  (`max_entry_bytes`) and by each entry's TTL (the route's `ttl_s`, as for the exact caches).
- Entry ids (`EntryIds`, the x-paved-cache-entry a false-hit report names) are
  `<kind>:<payload hex>.<HMAC-SHA256 hex>`, the MAC keyed by a server secret over the tenant, the
  kind and the payload: a tenant cannot forge one (not even for an exact key it can compute) nor
  use another tenant's, and `open` answers None alike for a forged, foreign or unknown-kind id,
  comparing MACs in constant time. The secret is shared by every replica on one state store (a
  row of `gateway_cache_secret`, created once) and never logged.
- Tenant isolation in the semantic cache is structural: one `VectorIndex` per (tenant, scope),
  so another tenant's vectors are never searched; every hit is re-checked against its entry's
  owner and scope; `evict` by another tenant fails. Entry ids are random 63-bit numbers (no
  tenant data, not guessable).
- Nothing here blocks the event loop: key hashing and the exact caches are O(request); a
  semantic search runs inline while its index scans few rows exactly (the IVF path measures
  well under 1 ms at 100k entries, docs/benchmarks.md "Gateway caches") and in a worker thread
  when a bulk load left many rows to scan exactly; index training runs on `ann`'s own thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import math
import re
import secrets
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import sqlalchemy as sa
from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError

from paved.gateway.caching.ann import FIRST_BLOCK_ROWS, VectorIndex
from paved.http.sse import event_json

if TYPE_CHECKING:
    import redis.asyncio

    from paved.gateway.access.state import GatewayStore

logger = logging.getLogger(__name__)

__all__ = [
    "IGNORED_FIELDS",
    "CacheKeys",
    "CachedAnswer",
    "EntryIds",
    "ExactCache",
    "InProcessExactCache",
    "OpenedEntry",
    "RedisExactCache",
    "SemanticCache",
    "SemanticHit",
    "answer_from_stream",
    "cache_keys",
    "is_cacheable_answer",
    "is_deterministic",
    "question_numbers",
    "replay_sse",
]

# Body fields that never change the answer's content: transport (stream, stream_options), the
# end-user id, and paved's extension fields (resolved into the messages before keying).
IGNORED_FIELDS: frozenset[str] = frozenset(
    ("stream", "stream_options", "user", "template", "variables", "conversation_id", "cache")
)
_CACHEABLE_FINISH = frozenset(("stop", "length"))
_DONE = b"[DONE]"


# ---- keys --------------------------------------------------------------------------------------
def is_deterministic(body: Mapping[str, Any], *, opt_in: bool) -> bool:
    """True when the answer may be reused: temperature 0 given explicitly (OpenAI's default is
    1, so an absent temperature is not deterministic), or the operator opted in."""
    if opt_in:
        return True
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0


@dataclass(frozen=True)
class CacheKeys:
    exact: bytes  # sha256 of the canonical request
    scope: bytes  # sha256 of the canonical request without the last user message's text
    text: str | None  # that text (what the semantic cache embeds); None: no semantic lookup


def _normal(value: Any) -> Any:
    """JSON value with integral floats as ints (1.0 -> 1, -0.0 -> 0); bools stay bools."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, Mapping):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    # Not JSON (a caller passing objects): keyed by type and repr, never equal to a JSON value.
    return {"$repr": f"{type(value).__name__}:{value!r}"}


def canonical_json(value: Any) -> bytes:
    """The canonical form keys hash: sorted keys, no whitespace, numbers normalised, UTF-8."""
    return json.dumps(_normal(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _text_of(content: Any) -> tuple[str | None, Any]:
    """(text, what stays in the scope) of one message's content: a string, or the text parts of
    a list joined with newlines (non-text parts, e.g. images, stay in the scope)."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        texts = [
            p["text"]
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        ]
        rest = [
            p
            for p in content
            if not (isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str))
        ]
        return ("\n".join(texts) if texts else None), rest
    return None, content


def _split_semantic(endpoint: str, fields: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(the text a semantic lookup embeds, the fields without it)."""
    if endpoint == "chat":
        messages = fields.get("messages")
        if not isinstance(messages, list):
            return None, fields
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            if isinstance(message, Mapping) and message.get("role") == "user":
                text, rest = _text_of(message.get("content"))
                if text is None or not text.strip():
                    return None, fields
                scoped = [*messages]
                scoped[i] = {**message, "content": rest}
                return text, {**fields, "messages": scoped}
        return None, fields
    if endpoint == "completions":
        prompt = fields.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            return prompt, {**fields, "prompt": None}
    return None, fields


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def question_numbers(text: str) -> list[str]:
    """The numbers of a question in order, thousands separators dropped ("$300,000" and
    "300000" agree): a semantic hit needs the same ones, because sentence embeddings barely
    tell "#48213" from "#48231" or "15 percent of 80" from "80 percent of 15"
    (docs/benchmarks.md, "Gateway caches")."""
    return [m.group(0).replace(",", "") for m in _NUMBER.finditer(text)]


def cache_keys(
    *,
    tenant: str,
    model: str,
    template: str | None,
    endpoint: str,
    body: Mapping[str, Any],
    numbers_in_scope: bool = True,
) -> CacheKeys:
    """The exact key, the semantic scope and the semantic text of one request (see the module
    docstring). `model` is the resolved `alias@version`, `template` `name@N` or None. With
    `numbers_in_scope` (the default) the scope also covers `question_numbers(text)`."""
    fields = {k: v for k, v in body.items() if k not in IGNORED_FIELDS and k != "model"}
    head = {"tenant": tenant, "model": model, "template": template, "endpoint": endpoint}
    exact = hashlib.sha256(canonical_json({"kind": "exact", **head, "body": fields})).digest()
    text, scoped = _split_semantic(endpoint, fields)
    numbers = question_numbers(text) if numbers_in_scope and text is not None else None
    scope = hashlib.sha256(
        canonical_json({"kind": "scope", **head, "body": scoped, "numbers": numbers})
    ).digest()
    return CacheKeys(exact=exact, scope=scope, text=text)


# ---- answers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachedAnswer:
    body: bytes  # the complete non-streaming upstream JSON (chat.completion / text_completion)
    created_at: float  # time.time() when it was stored


def is_cacheable_answer(status: int, body: bytes) -> bool:
    """200 with a JSON object whose every choice (at least one) finished with stop or length."""
    if status != 200:
        return False
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(value, dict) or value.get("error") is not None:
        return False
    choices = value.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("finish_reason") in _CACHEABLE_FINISH for c in choices)


def _dumps(value: Any) -> bytes:
    # One line for every client: the replayed events are read as the frontend's were.
    return event_json(value).encode()


class _NotMergeable(Exception):
    """The stream cannot be turned into an answer reliably: do not cache it."""


def _event_data(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), None for a comment-only event."""
    lines = [line for line in event.strip().split(b"\n") if line.strip()]
    data = []
    for line in lines:
        if line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif not line.startswith(b":") and not line.startswith((b"event:", b"id:", b"retry:")):
            raise _NotMergeable
    return b"\n".join(data) if data else None


class _Choice:
    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] | None = None  # None: no content field seen
        self.strings: dict[str, list[str]] = {}  # reasoning_content, refusal, ...
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, list[Any] | None] | None = None
        self.finish_reason: str | None = None
        self.extra: dict[str, Any] = {}  # other choice fields (vLLM's stop_reason)

    def merge_logprobs(self, logprobs: Any) -> None:
        if logprobs is None:
            return
        if not isinstance(logprobs, dict):
            raise _NotMergeable
        merged: dict[str, list[Any] | None] = self.logprobs if self.logprobs is not None else {}
        for key, part in logprobs.items():
            if part is None:
                merged.setdefault(key, None)
                continue
            if not isinstance(part, list):
                raise _NotMergeable
            merged[key] = (merged.get(key) or []) + part
        self.logprobs = merged

    def merge_tool_calls(self, calls: Any) -> None:
        if not isinstance(calls, list):
            raise _NotMergeable
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("index"), int):
                raise _NotMergeable
            state = self.tool_calls.setdefault(
                call["index"], {"id": None, "type": None, "name": [], "args": []}
            )
            for field in ("id", "type"):
                value = call.get(field)
                if value is None:
                    continue
                if not isinstance(value, str) or (state[field] is not None and state[field] != value):
                    raise _NotMergeable
                state[field] = value
            function = call.get("function")
            if function is None:
                continue
            if not isinstance(function, dict):
                raise _NotMergeable
            for field, into in (("name", "name"), ("arguments", "args")):
                value = function.get(field)
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise _NotMergeable
                state[into].append(value)

    def merge_delta(self, delta: Any) -> None:
        if delta is None:
            return
        if not isinstance(delta, dict):
            raise _NotMergeable
        for key, value in delta.items():
            if value is None:
                continue
            if key == "role":
                if not isinstance(value, str) or (self.role is not None and self.role != value):
                    raise _NotMergeable
                self.role = value
            elif key == "content":
                if not isinstance(value, str):
                    raise _NotMergeable
                (self.content if self.content is not None else self.start_content()).append(value)
            elif key == "tool_calls":
                self.merge_tool_calls(value)
            elif isinstance(value, str):
                self.strings.setdefault(key, []).append(value)
            else:
                # function_call (legacy) or a field we do not know how to concatenate.
                raise _NotMergeable

    def start_content(self) -> list[str]:
        self.content = []
        return self.content

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": None if self.content is None else "".join(self.content),
        }
        for key, parts in self.strings.items():
            message[key] = "".join(parts)
        if self.tool_calls:
            if sorted(self.tool_calls) != list(range(len(self.tool_calls))):
                raise _NotMergeable
            calls = []
            for index in range(len(self.tool_calls)):
                state = self.tool_calls[index]
                if state["id"] is None or not state["name"]:
                    raise _NotMergeable
                calls.append(
                    {
                        "id": state["id"],
                        "type": state["type"] or "function",
                        "function": {"name": "".join(state["name"]), "arguments": "".join(state["args"])},
                    }
                )
            message["tool_calls"] = calls
        return message


def answer_from_stream(endpoint: str, events: Sequence[bytes]) -> bytes | None:
    """The non-streaming JSON answer equivalent to a complete stream, else None (not cached).

    Complete: `data: [DONE]` seen, no error event, at least one choice, choice indices 0..n-1,
    each with a finish_reason. Content, role, other string deltas, tool-call deltas (by index:
    id and type set once, name and arguments concatenated) and logprobs lists are merged; a
    delta it cannot merge reliably (e.g. legacy function_call) makes it None."""
    chat = endpoint == "chat"
    if endpoint not in ("chat", "completions"):
        return None
    try:
        return _from_stream(chat, events)
    except _NotMergeable:
        return None


def _from_stream(chat: bool, events: Sequence[bytes]) -> bytes | None:
    head: dict[str, Any] = {}
    usage: dict[str, Any] | None = None
    choices: dict[int, _Choice] = {}
    done = False
    for event in events:
        data = _event_data(event)
        if data is None:
            continue
        if data == _DONE:
            done = True
            break
        try:
            chunk = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(chunk, dict) or chunk.get("error") is not None:
            return None
        for key, value in chunk.items():
            if key in ("object", "choices", "usage") or value is None:
                continue
            # The first chunk's id/created/model name the answer; other fields: the last one seen.
            if key in ("id", "created", "model"):
                head.setdefault(key, value)
            else:
                head[key] = value
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        parts = chunk.get("choices")
        if parts is None:
            continue
        if not isinstance(parts, list):
            return None
        for part in parts:
            if not isinstance(part, dict):
                return None
            index = part.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                return None
            state = choices.setdefault(index, _Choice())
            for key, value in part.items():
                if key in ("index", "logprobs", "finish_reason", "delta", "text"):
                    continue
                if value is not None:
                    state.extra[key] = value
            if chat:
                state.merge_delta(part.get("delta"))
            else:
                text = part.get("text")
                if text is not None:
                    if not isinstance(text, str):
                        return None
                    (state.content if state.content is not None else state.start_content()).append(text)
            state.merge_logprobs(part.get("logprobs"))
            finish = part.get("finish_reason")
            if finish is not None:
                state.finish_reason = finish
    if not done or not choices or sorted(choices) != list(range(len(choices))):
        return None
    if any(c.finish_reason is None for c in choices.values()):
        return None
    out_choices = []
    for index in range(len(choices)):
        state = choices[index]
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = state.message()
        else:
            choice["text"] = "".join(state.content or [])
        choice["logprobs"] = state.logprobs
        choice["finish_reason"] = state.finish_reason
        choice.update(state.extra)
        out_choices.append(choice)
    answer: dict[str, Any] = {
        "id": head.pop("id", None),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.pop("created", int(time.time())),
        "model": head.pop("model", None),
        "choices": out_choices,
    }
    answer.update(head)
    if usage is not None:
        answer["usage"] = usage
    return _dumps(answer)


def _pieces(text: str, count: int = 4) -> list[str]:
    """`text` cut into at most `count` pieces at word boundaries (concatenation is `text`)."""
    if len(text) <= 16:
        return [text] if text else []
    cuts = [0]
    for i in range(1, count):
        at = text.find(" ", len(text) * i // count)
        if at > cuts[-1]:
            cuts.append(at)
    cuts.append(len(text))
    return [text[a:b] for a, b in itertools.pairwise(cuts) if b > a]


def replay_sse(endpoint: str, answer: CachedAnswer, *, include_usage: bool) -> list[bytes]:
    """SSE events (each ending with a blank line) streaming `answer` the way the upstream would:
    per choice a role delta, the content in a few deltas, tool calls, then the finish_reason;
    a usage-only chunk if `include_usage`; then `data: [DONE]`."""
    data = json.loads(answer.body)
    chat = endpoint == "chat"
    head = {k: v for k, v in data.items() if k not in ("object", "choices", "usage")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events: list[bytes] = []

    def emit(choice: dict[str, Any]) -> None:
        chunk = {**head, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        events.append(b"data: " + _dumps(chunk) + b"\n\n")

    for position, choice in enumerate(data.get("choices") or []):
        index = choice.get("index", position)
        extra = {
            k: v
            for k, v in choice.items()
            if k not in ("index", "message", "text", "logprobs", "finish_reason", "delta")
        }
        logprobs = choice.get("logprobs")
        if chat:
            message = choice.get("message") or {}
            content = message.get("content")
            first: dict[str, Any] = {"role": message.get("role", "assistant")}
            if isinstance(content, str):
                first["content"] = ""
            emit({"index": index, "delta": first, "logprobs": None, "finish_reason": None})
            for key, value in message.items():
                if key not in ("role", "content", "tool_calls") and isinstance(value, str):
                    emit({"index": index, "delta": {key: value}, "logprobs": None, "finish_reason": None})
            for piece in _pieces(content) if isinstance(content, str) else []:
                emit(
                    {"index": index, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": None}
                )
                logprobs = None
            for n, call in enumerate(message.get("tool_calls") or []):
                emit({
                    "index": index,
                    "delta": {"tool_calls": [{"index": n, **call}]},
                    "logprobs": None,
                    "finish_reason": None,
                })  # fmt: skip
            last: dict[str, Any] = {"index": index, "delta": {}, "logprobs": logprobs}
        else:
            for piece in _pieces(choice.get("text") or ""):
                emit({"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None})
                logprobs = None
            last = {"index": index, "text": "", "logprobs": logprobs}
        emit({**last, "finish_reason": choice.get("finish_reason"), **extra})
    if include_usage and isinstance(data.get("usage"), dict):
        events.append(b"data: " + _dumps({**head, "choices": [], "usage": data["usage"]}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


# ---- exact caches ------------------------------------------------------------------------------
class ExactCache(Protocol):
    async def get(self, key: bytes) -> CachedAnswer | None: ...

    async def put(self, key: bytes, answer: CachedAnswer, ttl_s: float) -> None: ...

    async def delete(self, key: bytes) -> bool: ...


_ENTRY_OVERHEAD = 160  # bytes an in-process entry costs beyond its body and key (objects, links)


class InProcessExactCache:
    """LRU + TTL, bounded in bytes (bodies + keys + a fixed per-entry overhead) and per entry."""

    def __init__(
        self,
        *,
        max_bytes: int = 64 << 20,
        max_entry_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[CachedAnswer, float, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: bytes) -> CachedAnswer | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            self._pop(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: bytes, answer: CachedAnswer, ttl_s: float) -> None:
        size = len(answer.body) + len(key) + _ENTRY_OVERHEAD
        if not ttl_s > 0 or len(answer.body) > self.max_entry_bytes or size > self.max_bytes:
            return
        self._pop(key)
        self._entries[key] = (answer, self._clock() + ttl_s, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._pop(next(iter(self._entries)))

    async def delete(self, key: bytes) -> bool:
        return self._pop(key)

    def _pop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry[2]
        return True


_REDIS_VALUE = struct.Struct("<Bd")  # format version, created_at; then the body
_REDIS_VERSION = 1
_LOG_EVERY_S = 10.0


class RedisExactCache:
    """The exact cache in Redis, shared by gateway replicas: one key per entry (prefix + hex of
    the key), value = version byte + created_at + body, expiry by `SET PX`. Every call is bounded
    by `timeout_s`; a failure is a miss (logged, counted in `failures`), never an error, and for
    `retry_after_s` after one the cache is not tried at all (misses at once, `skipped`)."""

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        *,
        prefix: str = "paved:cache:",
        max_entry_bytes: int = 1 << 20,
        timeout_s: float = 0.2,
        retry_after_s: float = 1.0,
    ):
        self.redis = redis
        self.prefix = prefix.encode()
        self.max_entry_bytes = max_entry_bytes
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.failures = 0  # calls that failed (error or timeout)
        self.skipped = 0  # calls not made: Redis failed less than retry_after_s ago
        self._down_until = -math.inf
        self._logged_at = -math.inf
        self._unlogged = 0

    def _key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _skip(self) -> bool:
        """True while Redis is presumed down: the call is a miss at once instead of costing
        every request `timeout_s` (a down or hung Redis must not slow the gateway)."""
        if time.monotonic() < self._down_until:
            self.skipped += 1
            return True
        return False

    def _failed(self, op: str, error: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        self._down_until = now + self.retry_after_s
        if now - self._logged_at < _LOG_EVERY_S:
            self._unlogged += 1
            return
        logger.warning(
            "exact cache: Redis %s failed (%s: %s); treated as a miss (%d more failures not logged)",
            op, type(error).__name__, error, self._unlogged,
        )  # fmt: skip
        self._logged_at, self._unlogged = now, 0

    async def get(self, key: bytes) -> CachedAnswer | None:
        if self._skip():
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self.redis.get(self._key(key))
        except (RedisError, OSError, TimeoutError) as e:
            self._failed("GET", e)
            return None
        if raw is None:
            return None
        if not isinstance(raw, bytes) or len(raw) < _REDIS_VALUE.size:
            return None
        version, created_at = _REDIS_VALUE.unpack_from(raw)
        if version != _REDIS_VERSION:
            return None  # written by another format: a miss, overwritten on the next put
        return CachedAnswer(body=raw[_REDIS_VALUE.size :], created_at=created_at)

    async def put(self, key: bytes, answer: CachedAnswer, ttl_s: float) -> None:
        if not ttl_s > 0 or len(answer.body) > self.max_entry_bytes:
            return
        if self._skip():
            return
        value = _REDIS_VALUE.pack(_REDIS_VERSION, answer.created_at) + answer.body
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.redis.set(self._key(key), value, px=max(1, int(ttl_s * 1000)))
        except (RedisError, OSError, TimeoutError) as e:
            self._failed("SET", e)

    async def delete(self, key: bytes) -> bool:
        if self._skip():
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                return bool(await self.redis.delete(self._key(key)))
        except (RedisError, OSError, TimeoutError) as e:
            self._failed("DEL", e)
            return False


# ---- entry ids ---------------------------------------------------------------------------------
_ROW_NAME = "cache-entry-ids"  # gateway_cache_secret.name of the entry-id MAC key
_SECRET_BYTES = 32
_ENTRY_KINDS = {"e": 32, "s": 8}  # exact: the 32-byte key; semantic: the 8-byte entry number
_SIGNED_ENTRY = re.compile(r"([es]):([0-9a-f]{16}|[0-9a-f]{64})\.([0-9a-f]{64})")

secret_metadata = sa.MetaData()
secret_table = sa.Table(
    "gateway_cache_secret",
    secret_metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(128), nullable=False),
)


class EntryIds:
    """Signs and opens x-paved-cache-entry ids (see the module docstring).

    With a store, `start()` reads the secret every replica on that store shares (creating it
    once); without one the secret is this process's own, which is enough for caches that live
    in this process only (an id from another replica names nothing here anyway)."""

    def __init__(self, store: GatewayStore | None = None, *, secret: bytes | None = None):
        if secret is not None and len(secret) < 16:
            raise ValueError("the cache entry secret must have at least 16 bytes")
        self._store = store
        self._secret: bytes | None = secret
        if secret is None and store is None:
            self._secret = secrets.token_bytes(_SECRET_BYTES)

    def __repr__(self) -> str:  # never the secret
        return f"EntryIds(shared={self._store is not None})"

    async def start(self) -> None:
        if self._secret is None and self._store is not None:
            await self._store.create_tables(secret_metadata)
            self._secret = await self._store.run(self._load_or_create_sync, self._store)

    @staticmethod
    def _load_or_create_sync(store: GatewayStore) -> bytes:
        query = sa.select(secret_table.c.value).where(secret_table.c.name == _ROW_NAME)
        for _ in range(2):
            with store.engine.connect() as conn:
                found = conn.execute(query).scalar()
            if found is not None:
                return bytes.fromhex(found)
            try:
                with store.engine.begin() as conn:
                    fresh = secrets.token_bytes(_SECRET_BYTES)
                    conn.execute(secret_table.insert().values(name=_ROW_NAME, value=fresh.hex()))
                return fresh
            except IntegrityError:
                continue  # another replica created it first: read theirs
        raise RuntimeError("the cache entry secret could be neither read nor created")

    def _mac(self, tenant: str, kind: str, payload: bytes) -> str:
        if self._secret is None:
            raise RuntimeError("EntryIds.start() was not awaited")
        name = tenant.encode()
        message = b"%s\0%d\0%s%s" % (kind.encode(), len(name), name, payload)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _sign(self, tenant: str, kind: str, payload: bytes) -> str:
        return f"{kind}:{payload.hex()}.{self._mac(tenant, kind, payload)}"

    def exact(self, tenant: str, key: bytes) -> str:
        return self._sign(tenant, "e", key)

    def semantic(self, tenant: str, entry_id: str) -> str:
        match = _ENTRY_ID.fullmatch(entry_id)
        if match is None:
            raise ValueError("not a semantic cache entry id")
        return self._sign(tenant, "s", bytes.fromhex(match.group(1)))

    @staticmethod
    def _parse(entry: object) -> tuple[str, bytes, str] | None:
        match = _SIGNED_ENTRY.fullmatch(entry) if isinstance(entry, str) else None
        if match is None or len(match.group(2)) != 2 * _ENTRY_KINDS[match.group(1)]:
            return None
        return match.group(1), bytes.fromhex(match.group(2)), match.group(3)

    @classmethod
    def well_formed(cls, entry: object) -> bool:
        """Whether `entry` has the shape of an entry id (says nothing of whose it is)."""
        return cls._parse(entry) is not None

    def open(self, tenant: str, entry: object) -> OpenedEntry | None:
        """What `entry` names when it was signed for `tenant`; None otherwise (forged, another
        tenant's, malformed: all alike)."""
        parsed = self._parse(entry)
        if parsed is None:
            return None
        kind, payload, mac = parsed
        if not hmac.compare_digest(self._mac(tenant, kind, payload), mac):
            return None
        if kind == "e":
            return OpenedEntry(exact_key=payload)
        return OpenedEntry(semantic_id=_entry_id(int.from_bytes(payload, "big")))


@dataclass(frozen=True)
class OpenedEntry:
    """An entry id a tenant may act on: one of an exact cache key or a SemanticCache id."""

    exact_key: bytes | None = None
    semantic_id: str | None = None


# ---- semantic cache ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SemanticHit:
    answer: CachedAnswer
    score: float  # cosine similarity of the query to the cached question
    entry_id: str  # for a false-hit report (SemanticCache.evict)


@dataclass(slots=True)
class _Entry:
    owner: tuple[str, bytes]  # (tenant, scope): the only index it lives in
    answer: CachedAnswer
    expires_at: float
    size: int  # what it counts against max_bytes


_ENTRY_ID = re.compile(r"sc-([0-9a-f]{16})")
# A search scanning more rows exactly than this (a bulk load left a big delta) goes to a thread.
_INLINE_EXACT_ROWS = 16384
_NEIGHBOURS = 4  # candidates per lookup: the best may have expired
# Bytes an entry costs beyond its body: the entry, its id, owner and expiry records, and its
# index's row map and id set.
_SEMANTIC_ENTRY_OVERHEAD = 384


def _vector_cost(dim: int) -> int:
    """Bytes one float32 vector of `dim` (and its int64 id) costs its index, counted three
    times: an index holds memory for at most 3 rows per live one, however entries came and went
    (paved.gateway.caching.ann: its exact parts shrink, its IVF part is rebuilt compact)."""
    return 3 * (4 * dim + 8)


def _index_cost(dim: int) -> int:
    """Bytes an index costs before any entry: its first block (FIRST_BLOCK_ROWS rows, however
    few it holds) and its bookkeeping. Many small scopes each pay it."""
    return FIRST_BLOCK_ROWS * (4 * dim + 8) + 4096


def _entry_id(key: int) -> str:
    return f"sc-{key:016x}"


class SemanticCache:
    """Cached answers found by the cosine similarity of the last question's embedding, within
    one (tenant, scope); see the module docstring for the isolation rules.

    Each entry lives for the TTL it was inserted with (`insert`'s `ttl_s`: the route's; else
    this cache's `ttl_s`): expired entries are dropped in deadline order on every insert (and
    when a lookup meets one). Entries are dropped oldest first when `max_entries` is reached or
    what they hold would pass `max_bytes`: each entry's body, its vector (with its index's
    room: three times) and a fixed overhead, and each (tenant, scope) index's own fixed cost, so many
    scopes or wide embeddings are bounded as large answers are (`bytes`; an index rebuilding
    into IVF briefly holds a second copy). An answer over `max_entry_bytes` is not stored. One
    embedding model per instance: an index's dimension is fixed by its first vector."""

    def __init__(
        self,
        *,
        max_entries: int = 1_000_000,
        max_bytes: int = 1 << 30,
        max_entry_bytes: int = 1 << 20,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        index_factory: Callable[[int], VectorIndex] | None = None,
    ):
        if max_entries <= 0 or max_bytes <= 0 or max_entry_bytes <= 0 or not ttl_s > 0:
            raise ValueError("max_entries, max_bytes, max_entry_bytes and ttl_s must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.ttl_s = ttl_s
        self.bytes = 0  # what the entries and indexes count against max_bytes
        self._clock = clock
        self._index_factory = index_factory or VectorIndex
        self._indexes: dict[tuple[str, bytes], VectorIndex] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # insertion order: oldest first
        # (expires_at, key) of the entries, a heap; a dropped entry's record stays until it
        # surfaces or the heap is rebuilt (at twice the live entries).
        self._expiry: list[tuple[float, int]] = []
        self._per_tenant: Counter[str] = Counter()

    def entries(self, tenant: str | None = None) -> int:
        return len(self._entries) if tenant is None else self._per_tenant.get(tenant, 0)

    def index(self, tenant: str, scope: bytes) -> VectorIndex | None:
        """The index of one (tenant, scope), for introspection (benchmarks, tests)."""
        return self._indexes.get((tenant, scope))

    async def lookup(
        self, tenant: str, scope: bytes, vector: np.ndarray, threshold: float
    ) -> SemanticHit | None:
        """The best entry of exactly (tenant, scope) with cosine >= threshold, not expired."""
        if not -1.0 <= threshold <= 1.0:
            raise ValueError("threshold must be within [-1, 1]")
        owner = (tenant, scope)
        index = self._indexes.get(owner)
        if index is None:
            return None
        query = _unit(vector)
        if query is None or query.shape[0] != index.dim:
            return None
        if index.exact_rows > _INLINE_EXACT_ROWS:
            found = await asyncio.to_thread(index.search, query, _NEIGHBOURS)
        else:
            found = index.search(query, _NEIGHBOURS)
        now = self._clock()
        for key, score in found:
            if score < threshold:
                break
            entry = self._entries.get(key)
            # Structurally impossible (one index per owner); checked so it stays impossible.
            if entry is None or entry.owner != owner:
                continue
            if entry.expires_at <= now:
                self._drop(key)
                continue
            return SemanticHit(answer=entry.answer, score=min(score, 1.0), entry_id=_entry_id(key))
        return None

    async def insert(
        self,
        tenant: str,
        scope: bytes,
        vector: np.ndarray,
        answer: CachedAnswer,
        *,
        ttl_s: float | None = None,
    ) -> str | None:
        """Store `answer` under the question `vector` in (tenant, scope) for `ttl_s` (None: this
        cache's ttl_s); returns its entry id, or None when the answer is too large to keep."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl < math.inf:
            raise ValueError("ttl_s must be positive and finite")
        query = _unit(vector)
        if query is None:
            raise ValueError("the vector must be finite, non-zero and one-dimensional")
        owner = (tenant, scope)
        index = self._indexes.get(owner)
        if index is not None and index.dim != query.shape[0]:
            raise ValueError(f"the vector has {query.shape[0]} dimensions, this cache {index.dim}")
        dim = query.shape[0]
        size = len(answer.body) + _SEMANTIC_ENTRY_OVERHEAD + _vector_cost(dim)
        if len(answer.body) > self.max_entry_bytes or size + _index_cost(dim) > self.max_bytes:
            return None
        now = self._clock()
        self.expire(now)

        def need() -> int:  # a drop may close this owner's index: then it is paid for again
            return size + (0 if owner in self._indexes else _index_cost(dim))

        while self._entries and (
            len(self._entries) >= self.max_entries or self.bytes + need() > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        key = secrets.randbits(63)
        while key in self._entries:
            key = secrets.randbits(63)
        index = self._indexes.get(owner)
        new = index is None
        if index is None:
            index = self._index_factory(dim)
        try:
            index.add(np.array([key], dtype=np.int64), query.reshape(1, -1))
        except BaseException:
            if new:
                index.close()  # not registered yet: nothing counts it
            raise
        if new:
            self._indexes[owner] = index
            self.bytes += _index_cost(dim)
        expires_at = now + ttl
        self._entries[key] = _Entry(owner=owner, answer=answer, expires_at=expires_at, size=size)
        self.bytes += size
        self._per_tenant[tenant] += 1
        heapq.heappush(self._expiry, (expires_at, key))
        if len(self._expiry) > 2 * len(self._entries) + 64:
            self._expiry = [(e.expires_at, k) for k, e in self._entries.items()]
            heapq.heapify(self._expiry)
        return _entry_id(key)

    async def evict(self, tenant: str, entry_id: str) -> bool:
        """Remove an entry (a false-hit report); False if unknown or owned by another tenant."""
        match = _ENTRY_ID.fullmatch(entry_id) if isinstance(entry_id, str) else None
        if match is None:
            return False
        key = int(match.group(1), 16)
        entry = self._entries.get(key)
        if entry is None or entry.owner[0] != tenant:
            return False
        self._drop(key)
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop expired entries (earliest deadline first); returns how many."""
        now = self._clock() if now is None else now
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            # Absent or another entry under a reused id: this record is a dropped entry's.
            if entry is not None and entry.expires_at == expires_at:
                self._drop(key)
                dropped += 1
        return dropped

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry.size
        tenant = entry.owner[0]
        self._per_tenant[tenant] -= 1
        if self._per_tenant[tenant] <= 0:
            del self._per_tenant[tenant]
        index = self._indexes.get(entry.owner)
        if index is not None:
            index.remove((key,))
            if len(index) == 0:
                index.close()
                del self._indexes[entry.owner]
                self.bytes -= _index_cost(index.dim)


def _unit(vector: np.ndarray) -> np.ndarray | None:
    query = np.asarray(vector, dtype=np.float32).reshape(-1)
    if query.size == 0 or not np.isfinite(query).all():
        return None
    norm = float(np.linalg.norm(query))
    if norm == 0.0:
        return None
    return query / norm
