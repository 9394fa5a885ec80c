"""Engine outputs -> OpenAI response bodies and server-sent events.

Non-streaming bodies are the pydantic models of `paved.frontend.schemas`. Streaming chunks
are built as plain dicts of exactly those shapes (ChatCompletionChunk, Completion) because
they are serialized once per token; tests validate them against the models.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paved.engine.protocol import GenerateOutput, TokenLogprob
from paved.frontend import schemas
from paved.frontend.errors import to_api_error
from paved.frontend.structured import ToolMode
from paved.http.errors import error_body
from paved.http.sse import event_json, line_safe

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


# The string encoder json.dumps(..., ensure_ascii=False) itself uses (C when available).
_encode_str = json.encoder.encode_basestring


def _json_str(text: str) -> str:
    """`event_json(text)` for a str, without json.dumps's per-call encoder set-up."""
    return line_safe(_encode_str(text))


def sse(payload: dict[str, Any]) -> bytes:
    """One `data:` event, on one line whatever its strings hold (see `paved.http.sse`)."""
    return b"data: " + event_json(payload).encode() + b"\n\n"


class _Chunks:
    """The `data:` events of one stream, `sse({**base, "choices": [...]})` byte for byte, built
    per token without json.dumps: the constant head is encoded once, and a choice without
    logprobs is a template around its text (the frontend's CPU per streamed token competes with
    the engine for the cores; see docs/benchmarks.md, //bench:frontend)."""

    def __init__(self, base: dict[str, Any]):
        # `data: {"id":...,"model":...` + `,"choices":[`
        self.head = "data: " + event_json(base)[:-1] + ',"choices":['

    def event(self, choices: list[str]) -> bytes:
        """One event from choices already encoded (`event_json` or a template)."""
        return (self.head + ",".join(choices) + "]}\n\n").encode()


def _finish_json(finish_reason: str | None) -> str:
    return "null" if finish_reason is None else _json_str(finish_reason)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- accumulation ---------------------------------------------------------------------------
@dataclass
class ChoiceResult:
    text_parts: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class Result:
    """One engine request's accumulated output (all of its n choices)."""

    choices: list[ChoiceResult]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    prompt_text: str | None = None

    def add(self, out: GenerateOutput) -> None:
        if out.prompt_tokens is not None:
            self.prompt_tokens = out.prompt_tokens
            self.cached_tokens = out.cached_prompt_tokens or 0
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_text = out.prompt_text
        for delta in out.choices:
            choice = self.choices[delta.index]
            if delta.text:
                choice.text_parts.append(delta.text)
            choice.tokens += delta.token_count
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason


async def collect(stream: AsyncIterator[GenerateOutput], n: int) -> Result:
    result = Result([ChoiceResult() for _ in range(n)])
    async for out in stream:
        result.add(out)
    return result


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> schemas.Usage:
    return schemas.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=cached_tokens),
    )


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return usage(prompt_tokens, completion_tokens, cached_tokens).model_dump()


# ---- logprobs -------------------------------------------------------------------------------
def _top_entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_top_entry(e.token, e.logprob),
                "top_logprobs": [_top_entry(t.token, t.logprob) for t in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """Legacy completions format; a prompt's first token has a null logprob."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top_logprobs.append(None if e.logprob is None else {t.token: t.logprob for t in e.top})
        text_offset += len(e.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


# ---- tool calls -----------------------------------------------------------------------------
def tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """The tool calls in a constrained output, or None if it is incomplete (cut by length)."""
    if mode.kind == "named":
        return [
            {"id": tool_call_id(), "type": "function", "function": {"name": mode.name, "arguments": text}}
        ]
    try:
        calls = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # a recursive tool schema can nest that deep
        return None
    if not isinstance(calls, list):
        return None
    return [
        {
            "id": tool_call_id(),
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": json.dumps(call["parameters"], separators=(",", ":"), ensure_ascii=False),
            },
        }
        for call in calls
        if isinstance(call, dict) and "name" in call and "parameters" in call
    ]


def chat_message(choice: ChoiceResult, mode: ToolMode | None) -> tuple[dict[str, Any], str | None]:
    """(assistant message, finish_reason) for one finished choice."""
    text = choice.text
    finish = choice.finish_reason
    if mode is None:
        return {"role": "assistant", "content": text}, finish
    calls = tool_calls(text, mode) if finish != "length" or mode.kind == "named" else None
    if calls is None:
        # Cut off before the calls were complete: hand back what was generated, as OpenAI does.
        return {"role": "assistant", "content": text}, finish
    # OpenAI reports "stop" for a forced named function and "tool_calls" for "required".
    reason = "tool_calls" if mode.kind == "required" and finish == "stop" else finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, reason


def chat_completion(
    request_id: str, created: int, model: str, result: Result, mode: ToolMode | None, with_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for index, choice in enumerate(result.choices):
        message, finish = chat_message(choice, mode)
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(choice.logprobs) if with_logprobs else None,
                "finish_reason": finish,
            }
        )
    completion_tokens = sum(c.tokens for c in result.choices)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_dict(result.prompt_tokens, completion_tokens, result.cached_tokens),
    }


# ---- streaming ------------------------------------------------------------------------------
async def guarded_sse(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Stream `events`; an error after the 200 went out becomes an OpenAI error event."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - headers are sent: the error can only go in the stream
        error = to_api_error(e)
        yield sse(error_body(error.status, error.message, error.param, error.code))


# Called with (stream index, output) for every engine output an event stream reads: the
# request's token counts (paved.frontend.tracing.RequestLog.add_output) without another
# generator layer per token.
OutputObserver = Callable[[int, GenerateOutput], None]


async def chat_events(
    stream: AsyncIterator[GenerateOutput],
    *,
    request_id: str,
    model: str,
    n: int,
    mode: ToolMode | None,
    with_logprobs: bool,
    include_usage: bool,
    on_output: OutputObserver | None = None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    chunks = _Chunks(base)
    yield chunks.event(
        [
            event_json(
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            for i in range(n)
        ]
    )
    prompt_tokens = cached = completion_tokens = 0
    # "required" tool calls are parsed once complete; named ones stream their arguments.
    buffered = [ChoiceResult() for _ in range(n)] if mode is not None and mode.kind == "required" else None
    named_started = [False] * n
    async for out in stream:
        if on_output is not None:
            on_output(0, out)
        if out.prompt_tokens is not None:
            prompt_tokens, cached = out.prompt_tokens, out.cached_prompt_tokens or 0
        choices: list[str] = []
        for d in out.choices:
            completion_tokens += d.token_count
            if buffered is not None:
                b = buffered[d.index]
                b.text_parts.append(d.text)
                if with_logprobs and d.logprobs:
                    b.logprobs.extend(d.logprobs)
                b.finish_reason = d.finish_reason
                if d.finish_reason is None:
                    continue
                message, finish = chat_message(b, mode)
                delta: dict[str, Any] = {}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                    ]
                else:
                    delta["content"] = message["content"]
                # The whole choice's logprobs with its one delta, as the answer without stream has.
                lp = chat_logprobs(b.logprobs) if with_logprobs and b.logprobs else None
                choices.append(
                    event_json({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish})
                )
                continue
            logprobs = event_json(chat_logprobs(d.logprobs)) if with_logprobs and d.logprobs else "null"
            if mode is not None:  # named function: the text is its arguments
                call: dict[str, Any] = {"index": 0, "function": {"arguments": d.text}}
                if not named_started[d.index]:
                    named_started[d.index] = True
                    call.update(id=tool_call_id(), type="function")
                    call["function"] = {"name": mode.name, "arguments": d.text}
                delta_json = event_json({"tool_calls": [call]}) if d.text or call.get("id") else "{}"
            elif d.text:
                delta_json = '{"content":' + _json_str(d.text) + "}"
            else:
                delta_json = "{}"
            if delta_json == "{}" and d.finish_reason is None:
                continue
            choices.append(
                f'{{"index":{d.index},"delta":{delta_json},"logprobs":{logprobs},'
                f'"finish_reason":{_finish_json(d.finish_reason)}}}'
            )
        if choices:
            yield chunks.event(choices)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    yield SSE_DONE


# Outputs merge() holds between the engine streams and the client: a slow client pauses the
# engines' streams (backpressure) instead of piling up their deltas in memory.
MERGE_QUEUE_SIZE = 64


async def merge(
    streams: Sequence[AsyncIterator[GenerateOutput]], max_queued: int = MERGE_QUEUE_SIZE
) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Interleave several engine streams as outputs arrive, tagging each with its stream index.

    At most `max_queued` outputs wait for the consumer; a stream's pump then waits too, so
    nothing is dropped and nothing is read ahead of the client without bound."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=max_queued)
    done = object()

    async def pump(i: int, stream: AsyncIterator[GenerateOutput]) -> None:
        # Not in a `finally`: a cancelled pump must not wait for room in a queue nobody reads.
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        # The streams themselves are closed (aborted if unfinished) by their owner.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def completion_events(
    streams: Sequence[AsyncIterator[GenerateOutput]],
    *,
    request_id: str,
    model: str,
    n: int,
    echo: bool,
    logprobs: int | None,
    include_usage: bool,
    on_output: OutputObserver | None = None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    chunks = _Chunks(base)
    offsets = [0] * (n * len(streams))
    # Per prompt: its text and logprobs, echoed at the head of each of its n choices.
    prompts: list[tuple[str, list[TokenLogprob]] | None] = [None] * len(streams)
    echoed = [False] * (n * len(streams))
    prompt_tokens = completion_tokens = cached = 0

    def event(s: int, out: GenerateOutput) -> bytes | None:
        nonlocal prompt_tokens, completion_tokens, cached
        if on_output is not None:
            on_output(s, out)
        if out.prompt_tokens is not None:
            prompt_tokens += out.prompt_tokens
            cached += out.cached_prompt_tokens or 0
            prompts[s] = (out.prompt_text or "", list(out.prompt_logprobs or []))
        choices: list[str] = []
        for d in out.choices:
            index = s * n + d.index
            completion_tokens += d.token_count
            text = d.text
            entries: Sequence[TokenLogprob] = d.logprobs or ()
            if echo and not echoed[index]:
                echoed[index] = True
                prompt_text, prompt_entries = prompts[s] or ("", [])
                text = prompt_text + text
                entries = [*prompt_entries, *entries]
            if not text and d.finish_reason is None and not entries:
                continue
            lp = "null"
            if logprobs is not None:
                lp = event_json(completion_logprobs(entries, offsets[index]))
                offsets[index] += len(text)
            choices.append(
                f'{{"index":{index},"text":{_json_str(text)},"logprobs":{lp},'
                f'"finish_reason":{_finish_json(d.finish_reason)}}}'
            )
        return chunks.event(choices) if choices else None

    # One prompt (the common case) reads its stream directly rather than through merge().
    if len(streams) == 1:
        async for out in streams[0]:
            encoded = event(0, out)
            if encoded is not None:
                yield encoded
    else:
        async for s, out in merge(streams):
            encoded = event(s, out)
            if encoded is not None:
                yield encoded
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    yield SSE_DONE
