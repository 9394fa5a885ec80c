"""OpenAI-compatible routes: models, chat completions, completions, embeddings, and paved's
ranking extension. Handlers translate between the wire schemas and the engine protocol;
they never touch an engine implementation."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paved.engine.protocol import (
    ChatPrompt,
    EmbedRequest,
    EngineOverloadedError,
    GenerateRequest,
    GenerateStream,
    InvalidRequestError,
    ModelCard,
    PromptTooLongError,
    SamplingOptions,
    TextPrompt,
    TokenPrompt,
)
from paved.engine.streams import gather_or_cancel
from paved.frontend import responses, schemas, structured
from paved.frontend.bodies import OffLoopBodyRoute
from paved.frontend.errors import APIError
from paved.frontend.registry import ServedModel, Ticket
from paved.frontend.state import AppState
from paved.frontend.tracing import counted, engine_request_id, request_log
from paved.http.json_body import JSONBodyError, JSONTooDeepError, parse_json
from paved.http.off_loop import off_loop_if_large

router = APIRouter(route_class=OffLoopBodyRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorResponse, "description": text}
    for code, text in (
        (400, "Invalid request"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (503, "Overloaded, loading or shutting down (see Retry-After)"),
    )
}
T = TypeVar("T")


def _state(request: Request) -> AppState:
    return request.app.state.paved


# ---- models ---------------------------------------------------------------------------------
def _model_object(card: ModelCard) -> schemas.ModelObject:
    return schemas.ModelObject(
        id=card.id, created=card.created, owned_by=card.owned_by, max_model_len=card.max_model_len
    )


@router.get("/v1/models", response_model=schemas.ModelList, responses=_ERRORS)
async def list_models(request: Request) -> schemas.ModelList:
    return schemas.ModelList(data=[_model_object(card) for card in _state(request).models.cards()])


@router.get("/v1/models/{model:path}", response_model=schemas.ModelObject, responses=_ERRORS)
async def get_model(model: str, request: Request) -> schemas.ModelObject:
    return _model_object(_state(request).models.get(model).card)


# ---- shared request handling ------------------------------------------------------------------
def _generative(state: AppState, model: str) -> ServedModel:
    served = state.models.get(model)
    if served.card.kind != "generate":
        raise APIError(400, f"model {model!r} is an embedding model; use /v1/embeddings", param="model")
    return served


def _check_logprobs(card: ModelCard, count: int | None, param: str) -> None:
    if count is not None and count > card.max_logprobs:
        raise APIError(400, f"{param} must be at most {card.max_logprobs} for model {card.id!r}", param=param)


async def _resolve(state: AppState, body: schemas.SamplingFields, card: ModelCard) -> structured.Resolved:
    try:
        resolved = await structured.resolve_async(body, card)
    except EngineOverloadedError as e:
        e.model = e.model or card.id
        raise
    if resolved.constraint is not None:
        state.metrics.constrained.labels(card.id, resolved.constraint.backend).inc()
    return resolved


class _Admitted:
    """An admitted request: its admission ticket and engine streams, released together once."""

    def __init__(self, ticket: Ticket):
        self.ticket = ticket
        self.streams: list[GenerateStream] = []

    async def close(self) -> None:
        streams, self.streams = self.streams, []
        try:
            for stream in streams:
                await stream.aclose()  # aborts the engine request unless it finished
        finally:
            self.ticket.release()


async def _admit(
    state: AppState, served: ServedModel, requests: Sequence[GenerateRequest], weight: int, param: str = "n"
) -> _Admitted:
    """Admit and start every engine request, or none of them."""
    try:
        ticket = state.models.admit(served, weight, param)
    except EngineOverloadedError as e:
        e.model = e.model or served.card.id
        raise
    admitted = _Admitted(ticket)
    try:
        for r in requests:
            admitted.streams.append(await served.engine.generate(r))
    except BaseException as e:
        await admitted.close()
        if isinstance(e, EngineOverloadedError):
            e.model = e.model or served.card.id
        raise
    return admitted


class _SSEResponse(StreamingResponse):
    """Server-sent events whose engine requests are closed however the response ends:
    completed, failed, or cut short by a client disconnect (even before the first byte)."""

    def __init__(self, events: AsyncIterator[bytes], admitted: _Admitted, headers: dict[str, str]):
        super().__init__(
            responses.guarded_sse(events),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._admitted = admitted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._admitted.close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (frees the engine request);
    APIError 499 then. `request`'s body must have been read already.

    Streaming responses get this from Starlette; non-streaming handlers have to watch for it.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    disconnected = False
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        disconnected = task not in done
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the cancellation reach the engine stream (it aborts the request) first.
            await asyncio.gather(task, return_exceptions=True)
    # (A cancelled gather of several prompts ends with a CancelledError exception, not
    # cancelled: what decides is that the client went first.)
    if disconnected or task.cancelled():
        # Nobody is listening any more; the status only shows up in metrics and logs.
        raise APIError(499, "client closed the request")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _headers(resolved: structured.Resolved) -> dict[str, str]:
    if resolved.constraint is None:
        return {}
    return {structured.BACKEND_HEADER: resolved.constraint.backend}


# ---- chat completions -----------------------------------------------------------------------
def _message_dict(message: schemas.ChatMessage, index: int) -> dict[str, Any]:
    # Chat templates rarely know "developer"; it is OpenAI's newer name for "system".
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    out["content"] = message.text() or ""
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            # HF templates index arguments as a mapping; OpenAI sends them as JSON text (text
            # that is not JSON is passed on as it is; JSON nested past the bound is refused).
            try:
                arguments: Any = parse_json(call.function.arguments)
            except JSONTooDeepError as e:
                raise APIError(
                    400,
                    f"the tool call's arguments are {e}",
                    param=f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None
            except JSONBodyError:
                arguments = call.function.arguments
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out


def _chat_prompt(body: schemas.ChatCompletionRequest, size: int) -> ChatPrompt:
    return ChatPrompt(
        messages=[_message_dict(m, i) for i, m in enumerate(body.messages)],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        size_hint=size,
    )


@router.post("/v1/chat/completions", response_model=schemas.ChatCompletion, responses=_ERRORS)
async def chat_completions(body: schemas.ChatCompletionRequest, request: Request):
    state = _state(request)
    log = request_log(request)
    log.model = body.model
    served = _generative(state, body.model)
    card = served.card
    _check_logprobs(card, body.top_logprobs, "top_logprobs")
    if len(body.messages) > card.max_model_len:  # refused before rendering them all
        raise InvalidRequestError(
            f"{len(body.messages)} messages cannot fit this model's maximum context length of "
            f"{card.max_model_len} tokens (each message takes at least one)",
            param="messages",
            code="context_length_exceeded",
        )
    resolved = await _resolve(state, body, card)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    size = len(await request.body())  # (read already: the body is cached)
    # Messages and tools of a large body are converted off the loop (parsing tool call
    # arguments, dumping tool schemas: O(body) in Python).
    prompt = await off_loop_if_large(size, _chat_prompt, body, size)
    request_id = engine_request_id("chatcmpl", request)
    generate = GenerateRequest(
        request_id=request_id,
        model=body.model,
        prompt=prompt,
        sampling=structured.sampling_options(
            body, max_tokens=body.output_budget(), logprobs=logprobs, prompt_logprobs=None, resolved=resolved
        ),
        stream=bool(body.stream),
    )
    admitted = await _admit(state, served, [generate], body.n)
    (stream,) = admitted.streams
    headers = _headers(resolved)
    if body.stream:
        events = responses.chat_events(
            stream,
            request_id=request_id,
            model=body.model,
            n=body.n,
            mode=resolved.tool_mode,
            with_logprobs=logprobs is not None,
            include_usage=body.include_usage(),
            on_output=log.add_output,
        )
        return _SSEResponse(events, admitted, headers)
    try:
        result = await unless_disconnected(request, responses.collect(counted(stream, log), body.n))
    finally:
        await admitted.close()
    payload = responses.chat_completion(
        request_id, int(time.time()), body.model, result, resolved.tool_mode, logprobs is not None
    )
    return JSONResponse(payload, headers=headers)


# ---- completions ----------------------------------------------------------------------------
def _prompts(prompt: Any, max_model_len: int, param: str) -> list[TextPrompt | TokenPrompt]:
    """The engine prompts; token-id prompts longer than the context are refused here, before
    an engine checks every id against its vocabulary."""
    if isinstance(prompt, str):
        return [TextPrompt(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [TextPrompt(p) for p in prompt]
    token_lists = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    for ids in token_lists:
        if len(ids) > max_model_len:
            raise PromptTooLongError(
                prompt_tokens=len(ids), max_tokens=0, max_model_len=max_model_len, param=param
            )
    return [TokenPrompt(ids) for ids in token_lists]


@router.post("/v1/completions", response_model=schemas.Completion, responses=_ERRORS)
async def completions(body: schemas.CompletionRequest, request: Request):
    state = _state(request)
    log = request_log(request)
    log.model = body.model
    served = _generative(state, body.model)
    card = served.card
    _check_logprobs(card, body.logprobs, "logprobs")
    resolved = await _resolve(state, body, card)
    prompts = _prompts(body.prompt, card.max_model_len, "prompt")
    request_id = engine_request_id("cmpl", request)
    sampling = structured.sampling_options(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        # echo + logprobs scores the prompt too (with max_tokens 0: prefill-only scoring).
        prompt_logprobs=body.logprobs if body.echo else None,
        resolved=resolved,
    )
    generates = [
        GenerateRequest(
            f"{request_id}-{i}", body.model, p, sampling, stream=bool(body.stream), echo=body.echo
        )
        for i, p in enumerate(prompts)
    ]
    admitted = await _admit(
        state, served, generates, body.n * len(prompts), "n" if len(prompts) == 1 else "prompt"
    )
    headers = _headers(resolved)
    if body.stream:
        events = responses.completion_events(
            admitted.streams,
            request_id=request_id,
            model=body.model,
            n=body.n,
            echo=body.echo,
            logprobs=body.logprobs,
            include_usage=body.include_usage(),
            on_output=log.add_output,
        )
        return _SSEResponse(events, admitted, headers)
    streams = [counted(s, log, i) for i, s in enumerate(admitted.streams)]
    try:
        results = await unless_disconnected(
            request, gather_or_cancel(*(responses.collect(s, body.n) for s in streams))
        )
    finally:
        await admitted.close()
    choices = []
    for p, result in enumerate(results):
        for i, choice in enumerate(result.choices):
            text, entries = choice.text, list(choice.logprobs)
            if body.echo:
                text = (result.prompt_text or "") + text
                entries = list(result.prompt_logprobs or []) + entries
            choices.append(
                {
                    "index": p * body.n + i,
                    "text": text,
                    "logprobs": responses.completion_logprobs(entries, 0)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": choice.finish_reason,
                }
            )
    prompt_tokens = sum(r.prompt_tokens for r in results)
    completion_tokens = sum(c.tokens for r in results for c in r.choices)
    payload = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": responses.usage_dict(
            prompt_tokens, completion_tokens, sum(r.cached_tokens for r in results)
        ),
    }
    return JSONResponse(payload, headers=headers)


# ---- embeddings -----------------------------------------------------------------------------
@router.post("/v1/embeddings", response_model=schemas.EmbeddingList, responses=_ERRORS)
async def embeddings(body: schemas.EmbeddingRequest, request: Request):
    state = _state(request)
    log = request_log(request)
    log.model = body.model
    served = state.models.get(body.model)
    if served.card.kind != "embed":
        raise APIError(400, f"model {body.model!r} is not an embedding model", param="model")
    inputs = _prompts(body.input, served.card.max_model_len, "input")
    admitted = await _admit(state, served, [], len(inputs), "input")
    try:
        embed = EmbedRequest(
            engine_request_id("embd", request), body.model, inputs, dimensions=body.dimensions
        )
        result = await unless_disconnected(request, served.engine.embed(embed))
    finally:
        await admitted.close()
    log.prompt_tokens = result.prompt_tokens
    data = []
    for i, vector in enumerate(result.embeddings):
        if body.encoding_format == "base64":
            # OpenAI's base64 format: little-endian float32 bytes.
            value: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        else:
            value = vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    payload = {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
    return JSONResponse(payload)


# ---- ranking (extension) --------------------------------------------------------------------
@router.post(
    "/v1/rank",
    response_model=schemas.RankList,
    responses=_ERRORS,
    summary="Rank candidate continuations by log-likelihood (paved extension)",
)
async def rank(body: schemas.RankRequest, request: Request):
    """Score each candidate as the sum of its tokens' logprobs given `context`.

    The context and each candidate are tokenized separately and concatenated, so every
    candidate is scored on the same context tokens (no merge across the boundary). All
    candidates are admitted together and the engine schedules them as one batched prefill
    (one token is sampled and dropped per candidate). Results are sorted best first.
    vLLM recomputes the context per candidate: prompt logprobs need every position's
    logits, so such requests skip prefix-cache reads.
    """
    state = _state(request)
    log = request_log(request)
    log.model = body.model
    served = _generative(state, body.model)
    engine = served.engine
    max_model_len = served.card.max_model_len
    context = await engine.tokenize(body.model, body.context, add_special_tokens=True)
    if not context:
        raise InvalidRequestError("context tokenizes to nothing", param="context")
    # Refused before any prompt is built: each candidate's prompt is a copy of the context,
    # so a context that cannot fit would otherwise cost up to 256 copies of itself first.
    if len(context) >= max_model_len:  # every candidate adds at least one token
        raise PromptTooLongError(
            prompt_tokens=len(context) + 1, max_tokens=0, max_model_len=max_model_len, param="context"
        )
    # Each checked as soon as it is tokenized: a candidate too long refuses the request before
    # the rest are tokenized (256 of them can be tens of megabytes).
    candidates: list[list[int]] = []
    for i, text in enumerate(body.candidates):
        ids = await engine.tokenize(body.model, text, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError(f"candidates[{i}] tokenizes to nothing", param="candidates")
        if len(context) + len(ids) > max_model_len:
            raise PromptTooLongError(
                prompt_tokens=len(context) + len(ids),
                max_tokens=0,
                max_model_len=max_model_len,
                param="candidates",
            )
        candidates.append(ids)
    request_id = engine_request_id("rank", request)
    sampling = SamplingOptions(max_tokens=0, prompt_logprobs=0)
    generates = [
        GenerateRequest(f"{request_id}-{i}", body.model, TokenPrompt([*context, *ids]), sampling)
        for i, ids in enumerate(candidates)
    ]
    admitted = await _admit(state, served, generates, len(generates), "candidates")
    try:
        results = await unless_disconnected(
            request,
            gather_or_cancel(
                *(responses.collect(counted(s, log, i), 1) for i, s in enumerate(admitted.streams))
            ),
        )
    finally:
        await admitted.close()
    ranked: list[dict[str, Any]] = []
    for i, (ids, result) in enumerate(zip(candidates, results, strict=True)):
        scored = (result.prompt_logprobs or [])[len(context) :]
        logprob = math.fsum(e.logprob for e in scored if e.logprob is not None)
        ranked.append({"index": i, "text": body.candidates[i], "logprob": logprob, "tokens": len(ids)})
    ranked.sort(key=lambda r: r["logprob"], reverse=True)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    payload = {
        "object": "list",
        "model": body.model,
        "data": ranked,
        "usage": responses.usage_dict(prompt_tokens, 0),
    }
    return JSONResponse(payload)
