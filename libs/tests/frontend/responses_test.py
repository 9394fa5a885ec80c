"""The streamed events of paved.frontend.responses, byte for byte.

The per-token events are built from templates rather than json.dumps (they are the frontend's
hottest path); these tests hold them to exactly what json.dumps of the documented chunk shapes
gives, for texts that stress JSON escaping and SSE line breaks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from paved.engine.protocol import ChoiceDelta, GenerateOutput, TokenLogprob, TopLogprob
from paved.frontend import responses

# Quotes, backslashes, control characters (escaped by JSON), the three line breaks JSON leaves
# raw (U+0085, U+2028, U+2029), non-ASCII text, astral characters, and nothing at all.
TEXTS = [
    "plain",
    ' "quoted" ',
    "back\\slash",
    "tab\tnew\nline\r\x00\x1f",
    "\x85",
    "a\u2028b\u2029c",
    "é 漢字",
    "🦊",
    "",
]


def _expected(base: dict[str, Any], choices: list[dict[str, Any]]) -> bytes:
    """What the events were before the templates: one json.dumps per event."""
    text = json.dumps({**base, "choices": choices}, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return b"data: " + text.encode() + b"\n\n"


def _logprob(text: str, i: int) -> TokenLogprob:
    return TokenLogprob(text, i, -0.5 * i, [TopLogprob(text, i, -0.5 * i), TopLogprob("x\u2028", 7, -9.25)])


def _outputs(with_logprobs: bool) -> list[GenerateOutput]:
    outs = []
    for i, text in enumerate(TEXTS):
        finish = "length" if i == len(TEXTS) - 2 else None
        logprobs = [_logprob(text, i)] if with_logprobs else None
        out = GenerateOutput(
            [ChoiceDelta(index=0, text=text, token_ids=[i], logprobs=logprobs, finish_reason=finish)]
        )
        if i == 0:
            out.prompt_tokens = 3
        outs.append(out)
    # A finish reason alone (no text), as engines end a stream.
    outs.append(GenerateOutput([ChoiceDelta(index=0, finish_reason="stop")], finished=True))
    return outs


async def _stream(outs: list[GenerateOutput]):
    for out in outs:
        yield out


def _collect(events) -> list[bytes]:
    async def run() -> list[bytes]:
        return [e async for e in events]

    return asyncio.run(run())


def test_completion_events_match_json_dumps_byte_for_byte():
    for logprobs in (None, 2):
        outs = _outputs(logprobs is not None)
        seen: list[tuple[int, GenerateOutput]] = []
        events = _collect(
            responses.completion_events(
                [_stream(outs)],
                request_id="cmpl-\u2028x",
                model="m\u2029",
                n=1,
                echo=False,
                logprobs=logprobs,
                include_usage=False,
                on_output=lambda s, out, seen=seen: seen.append((s, out)),
            )
        )
        created = json.loads(events[0][6:])["created"]
        base = {"id": "cmpl-\u2028x", "object": "text_completion", "created": created, "model": "m\u2029"}
        expected, offset = [], 0
        for out in outs:
            d = out.choices[0]
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue  # nothing to say: no event
            lp = None
            if logprobs is not None:
                lp = responses.completion_logprobs(list(d.logprobs or []), offset)
                offset += len(d.text)
            choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
            expected.append(_expected(base, [choice]))
        assert events == [*expected, responses.SSE_DONE]
        # Every event is one line, whatever its strings held.
        assert all(e.count(b"\n") == 2 and e.endswith(b"\n\n") for e in events)
        assert [out for _, out in seen] == outs and {s for s, _ in seen} == {0}


def test_chat_events_match_json_dumps_byte_for_byte():
    for with_logprobs in (False, True):
        outs = _outputs(with_logprobs)
        events = _collect(
            responses.chat_events(
                _stream(outs),
                request_id="chatcmpl-1",
                model="m",
                n=1,
                mode=None,
                with_logprobs=with_logprobs,
                include_usage=False,
            )
        )
        created = json.loads(events[0][6:])["created"]
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": created, "model": "m"}
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        expected = [_expected(base, [role])]
        for out in outs:
            d = out.choices[0]
            delta = {"content": d.text} if d.text else {}
            if not delta and d.finish_reason is None:
                continue
            lp = responses.chat_logprobs(d.logprobs) if with_logprobs and d.logprobs else None
            expected.append(
                _expected(
                    base, [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}]
                )
            )
        assert events == [*expected, responses.SSE_DONE]
