"""Prompt token counts for admission: what a request reserves against tokens/min before it is
forwarded, and the leading tokens prefix affinity hashes.

A route naming a `tokenizer` (the model's Hugging Face directory) is counted with that
tokenizer exactly as paved's engines count it: chat messages rendered with the model's chat
template, then encoded without special tokens; completions prompts encoded with them. Without
a tokenizer the count is the prompt's UTF-8 byte length, an upper bound for the byte-level BPE
tokenizers paved serves (each token covers at least one byte), so admission never reserves
less than the request can use; the upstream's reported usage reconciles the difference on
finish either way.

Invariants: `count` never raises for a body the upstream might accept (a template or encoding
failure falls back to the byte bound, and the upstream answers the real error), and never
blocks the event loop: tokenizers load and long prompts encode in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Prompts shorter than this are encoded on the loop: a thread hop costs more than the encode.
_INLINE_CHARS = 2048


@dataclass(frozen=True)
class PromptCount:
    tokens: int  # prompt tokens (summed over a batch of prompts)
    exact: bool  # counted with the model's tokenizer (else the byte upper bound)
    affinity: bytes | None  # the leading tokens (or bytes) prefix affinity hashes


class TokenCounter:
    """Counts prompt tokens per route; loads each tokenizer directory once, off the loop."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._loading: dict[str, asyncio.Future[Any]] = {}
        self._failed: set[str] = set()
        self._prefetches: set[asyncio.Future[Any]] = set()

    def prefetch(self, paths: list[str]) -> None:
        """Start loading tokenizers a new routes table names, so no request waits for it."""
        for path in paths:
            if path not in self._tokenizers and path not in self._failed:
                task = asyncio.ensure_future(self._tokenizer(path))
                self._prefetches.add(task)
                task.add_done_callback(self._prefetches.discard)

    async def _tokenizer(self, path: str) -> Any | None:
        if path in self._tokenizers:
            return self._tokenizers[path]
        if path in self._failed:
            return None
        pending = self._loading.get(path)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._load, path))
            self._loading[path] = pending
        try:
            tok = await asyncio.shield(pending)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer dir must not fail requests
            logger.warning("tokenizer %s failed to load (%s); counting prompt bytes instead", path, e)
            self._failed.add(path)
            return None
        finally:
            self._loading.pop(path, None)
        self._tokenizers[path] = tok
        return tok

    @staticmethod
    def _load(path: str) -> Any:
        # transformers (and torch with it) is imported only when a route names a tokenizer.
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    async def count(
        self, tokenizer: str | None, endpoint: str, body: dict[str, Any], affinity_tokens: int
    ) -> PromptCount:
        texts = _prompt_texts(endpoint, body)
        tok = await self._tokenizer(tokenizer) if tokenizer else None
        if tok is None:
            return _byte_count(texts, body, affinity_tokens)
        size = sum(len(t) for t in texts) if texts is not None else len(json.dumps(body.get("messages")))
        try:
            if size <= _INLINE_CHARS:
                return _encode(tok, endpoint, body, texts, affinity_tokens)
            return await asyncio.to_thread(_encode, tok, endpoint, body, texts, affinity_tokens)
        except Exception:  # noqa: BLE001 - the upstream reports the real error
            return _byte_count(texts, body, affinity_tokens)


def _prompt_texts(endpoint: str, body: dict[str, Any]) -> list[str] | None:
    """Completions/embeddings prompts as strings (token-id prompts as their decimal text);
    None for chat, whose messages are rendered by the template."""
    if endpoint == "chat":
        return None
    value = body.get("input" if endpoint == "embeddings" else "prompt", "")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return [" ".join(map(str, value))]
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [json.dumps(value)]


def _encode(
    tok: Any, endpoint: str, body: dict[str, Any], texts: list[str] | None, affinity_tokens: int
) -> PromptCount:
    if texts is None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ValueError("messages is not a list")
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        return PromptCount(len(ids), True, _ids_bytes(ids[:affinity_tokens]))
    value = body.get("input" if endpoint == "embeddings" else "prompt")
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return PromptCount(len(value), True, _ids_bytes(value[:affinity_tokens]))
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return PromptCount(sum(len(v) for v in value), True, _ids_bytes(value[0][:affinity_tokens]))
    total, first = 0, None
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        total += len(ids)
        if first is None:
            first = ids[:affinity_tokens]
    return PromptCount(total, True, _ids_bytes(first or []))


def _byte_count(texts: list[str] | None, body: dict[str, Any], affinity_tokens: int) -> PromptCount:
    if texts is None:
        parts = []
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                content = message.get("content")
                parts.append(content if isinstance(content, str) else json.dumps(content))
        # Template markup adds a few tokens per message on top of the content.
        data = "".join(parts).encode(errors="surrogatepass")
        return PromptCount(len(data) + 8 * len(parts) + 8, False, data[: 4 * affinity_tokens] or None)
    encoded = [t.encode(errors="surrogatepass") for t in texts]
    first = encoded[0][: 4 * affinity_tokens] if encoded else b""
    return PromptCount(sum(len(d) + 2 for d in encoded), False, first or None)


def _ids_bytes(ids: list[int]) -> bytes | None:
    if not ids:
        return None
    return b"".join(int(i).to_bytes(4, "little", signed=False) for i in ids if isinstance(i, int) and i >= 0)
