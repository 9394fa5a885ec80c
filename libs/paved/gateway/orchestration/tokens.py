"""Prompt token counts for admission: what a request reserves against tokens/min before it is
forwarded, and the leading tokens prefix affinity hashes.

A route naming a `tokenizer` (the model's Hugging Face directory) is counted with that
tokenizer exactly as paved's engines count it: chat messages (and tools) rendered with the
model's chat template, then encoded without special tokens; completions prompts encoded with
them. Without a tokenizer the count is a byte bound: each completions prompt's UTF-8 length
plus 2 (BOS, EOS); for chat, every message's content, other fields (as JSON) and role plus
_MARKUP_TOKENS for the template's markup around it, the tools (as JSON) and the generation
prompt. It is an upper bound for byte-level BPE tokenizers (each token covers at least one
byte) under templates that add at most _MARKUP_TOKENS tokens of markup per message (ChatML,
the tiny model's, the simulated engine's): admission then never reserves less than the request
can use. A template that adds text of its own (a default system prompt, a date line, tool-use
instructions) can exceed it: name the route's tokenizer for an exact count. The upstream's
reported usage reconciles the difference on finish either way.

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
        # As the engines render it: the tools too (a template lists them in the prompt).
        extra = {"tools": body["tools"]} if body.get("tools") else {}
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
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
        return _chat_byte_count(body, affinity_tokens)
    encoded = [_utf8(t) for t in texts]
    first = encoded[0][: 4 * affinity_tokens] if encoded else b""
    return PromptCount(sum(len(d) + 2 for d in encoded), False, first or None)


# The tokens a chat template may add around one message besides its role name (ChatML adds 4:
# <|im_start|>, a newline, <|im_end|>, a newline), and with the generation prompt (whose role,
# "assistant", is counted too) and a BOS token: a margin above the markup of the templates paved
# serves, so that the byte bound stays an upper bound over them. (Without it the bound was 1
# below the simulated engine's count: its generation prompt, "<assistant>", is 11 bytes.)
_MARKUP_TOKENS = 16


def _chat_byte_count(body: dict[str, Any], affinity_tokens: int) -> PromptCount:
    """The chat byte bound: each message's content (text, or its parts as JSON), its other
    fields as JSON (name, tool calls, tool call id) and its role, plus _MARKUP_TOKENS; the tools
    as JSON; the generation prompt. Every token of a byte-level BPE covers at least one byte."""
    contents: list[bytes] = []
    extra = 0
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            extra += len(_json_bytes(message)) + _MARKUP_TOKENS
            continue
        content = message.get("content")
        contents.append(_utf8(content) if isinstance(content, str) else _json_bytes(content))
        role = message.get("role")
        extra += (len(_utf8(role)) if isinstance(role, str) else len(_json_bytes(role))) + _MARKUP_TOKENS
        others = {k: v for k, v in message.items() if k not in ("role", "content")}
        if others:
            extra += len(_json_bytes(others))
    if body.get("tools"):
        extra += len(_json_bytes(body["tools"]))
    extra += len("assistant") + _MARKUP_TOKENS
    data = b"".join(contents)
    return PromptCount(len(data) + extra, False, data[: 4 * affinity_tokens] or None)


def _utf8(text: str) -> bytes:
    return text.encode(errors="surrogatepass")


def _json_bytes(value: Any) -> bytes:
    # ensure_ascii (the default) writes a non-ASCII character as 6 or 12 bytes, never fewer
    # than its UTF-8 bytes, so the bound holds for templates that render JSON unescaped too.
    return json.dumps(value).encode()


def _ids_bytes(ids: list[int]) -> bytes | None:
    if not ids:
        return None
    return b"".join(int(i).to_bytes(4, "little", signed=False) for i in ids if isinstance(i, int) and i >= 0)
