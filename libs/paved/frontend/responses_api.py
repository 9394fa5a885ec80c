"""`POST /v1/responses` on an instance: the Responses API's stateless subset (`store: false`),
run as this frontend's own chat completions stream and translated by the translation the
gateway uses too (paved.http.openai_responses). Stored responses, `background`,
`previous_response_id` and resumable streams are the gateway's: asking an instance for them is a
400 naming the field (and saying to call the gateway)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paved.frontend import openai_api, schemas
from paved.frontend.errors import APIError
from paved.http import openai_responses as oai
from paved.http.json_body import JSONBodyError, parse_json
from paved.http.off_loop import off_loop_if_large

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    raw = await request.body()
    parsed, chat = await off_loop_if_large(len(raw), _decode, raw)
    try:
        answer = await openai_api.chat_completions(chat, request)
    except APIError as e:
        if e.param is not None and e.param.startswith("messages."):
            e.param = "input"  # the chat messages were built from `input` (and instructions)
        raise
    if not isinstance(answer, StreamingResponse):
        return answer  # an error answered as JSON
    run = oai.ResponseStream(parsed, oai.new_id("resp"))
    if parsed.stream:
        return _Translated(_events(run, answer), answer)
    try:
        # Watched as chat's non-streaming answers are: a client that leaves aborts the engine
        # request and frees its admission at once (499), not when the generation ends.
        await openai_api.unless_disconnected(request, _drain(_events(run, answer)))
    finally:
        await _close(answer)
    return JSONResponse(run.response)


def _decode(raw: bytes) -> tuple[oai.ParsedRequest, schemas.ChatCompletionRequest]:
    try:
        body = parse_json(raw)
    except JSONBodyError as e:
        raise APIError(400, f"the request body is {e}") from None
    try:
        parsed = oai.parse_request(body, stateless=True)
    except oai.ResponsesError as e:
        raise APIError(e.status, e.message, param=e.param, code=e.code) from None
    chat_body = parsed.chat_body()
    try:
        chat = schemas.ChatCompletionRequest.model_validate(chat_body)
    except pydantic.ValidationError as e:
        raise RequestValidationError(
            e.errors(include_url=False, include_input=False), body=chat_body
        ) from None
    return parsed, chat


async def _drain(events: AsyncIterator[bytes]) -> None:
    async for _ in events:
        pass


async def _events(run: oai.ResponseStream, answer: StreamingResponse) -> AsyncIterator[bytes]:
    for event in run.start() + run.running():
        yield oai.sse(event)
    error = None
    buffer = b""
    async for piece in answer.body_iterator:
        buffer += piece.encode() if isinstance(piece, str) else bytes(piece)
        while (end := buffer.find(b"\n\n")) >= 0:
            frame, buffer = buffer[:end], buffer[end + 2 :]
            chunk = _chunk(frame)
            if chunk is None:
                continue
            message = oai.chat_error_message(chunk)
            if message is not None:
                error = message
                continue
            for out in run.feed(chunk):
                yield oai.sse(out)
    for out in run.finish(error=error):
        yield oai.sse(out)


def _chunk(event: bytes) -> dict[str, Any] | None:
    if not event.startswith(b"data:") or event[5:].strip() == b"[DONE]":
        return None
    try:
        value = json.loads(event[5:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _close(answer: StreamingResponse) -> None:
    admitted = getattr(answer, "_admitted", None)
    if admitted is not None:
        await admitted.close()


class _Translated(StreamingResponse):
    """The translated stream; the chat stream's engine requests are closed however it ends
    (a client leaving aborts the generation: nothing here is resumable)."""

    def __init__(self, events: AsyncIterator[bytes], answer: StreamingResponse):
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self._answer)
