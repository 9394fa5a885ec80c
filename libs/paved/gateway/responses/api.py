"""The Responses API (`/v1/responses`) and resumable chat streams, over the gateway's own chat
path: every generation is `OpenAIProxy.forward` for a chat completions request made in-process
(`run_chat`), so templates, conversations, caches, limits, queueing and routing apply as to a
client's chat request, and its tokens are charged there, once, whoever reads the events.

A generation runs in a task of its own, not in the client's request: its events go to a
`LiveStream` (this replica's readers) and the shared event log (any replica's resumes). Who
may stop it:
- a non-resumable stream (`store: false`): the client leaving aborts it, as before;
- a resumable one: only when no reader is attached for `grace_s` (on any replica: remote
  readers keep a heartbeat in the log);
- a background response: only `cancel` (on any replica: the owner's lease renewal sees it).

A background response whose replica died (its lease lapsed) is continued by the replica whose
sweep claims it (`_take_over`): it replays the events already in the log to rebuild the
response, asks the chat path for the rest (the partial output as a final assistant message with
vLLM's `continue_final_message`, or without it where the backend refuses that extension; from
the start when nothing was output yet), for the same tenant, and appends to the same log with
the next sequence numbers. A follower sees one sequence; the stored output is the emitted one.

Invariants:
- An id names a response or stream of one tenant; any other tenant gets the 404 an unknown id
  gets.
- A stored response's final status is written after its last event is in the log, so a reader
  who sees it finished can replay every event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paved.gateway.errors import GatewayError, ModelNotAllowedError
from paved.gateway.forwarding.proxy import decode_body
from paved.gateway.responses.events import FENCED, HOLE, MAX_SEQ, LiveStream, LiveStreams, StreamTrimmed
from paved.gateway.responses.store import ACTIVE, Claimed, ResponseStore, failed_body
from paved.gateway.types import well_formed_id
from paved.http import openai_responses as oai
from paved.http.errors import error_body
from paved.http.json_body import JSONBodyError, parse_json
from paved.http.off_loop import off_loop_if_large

if TYPE_CHECKING:
    from paved.gateway.access.auth import Authenticator
    from paved.gateway.forwarding.proxy import OpenAIProxy
    from paved.gateway.types import Principal

logger = logging.getLogger("paved.gateway.responses")

STREAM_HEADER = "x-paved-stream-id"
CHAT_PATH = "/v1/chat/completions"
_NOT_FOUND = "no response with that id (it may have expired or been deleted)"
_CANNOT_CONTINUE = "the gateway replica generating this response stopped, and it could not be continued"
_EVENTS_GONE = "the events of this response are no longer kept (they expired or the event store was lost)"
# The client headers a chat request made in-process keeps (auth, priority, tracing).
_PASSED = (b"authorization", b"x-paved-priority", b"traceparent", b"x-request-id", b"x-paved-conversation")
# The vLLM extension a continuation asks for; a backend without it names it in its 400.
_EXTENSION = b"continue_final_message"


class _Chat:
    """What an in-process chat request answered: its status and headers, then its body."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.body = b""
        self.streaming = False
        # The chat path took the request but `on_start` could not (its stream log or its row
        # would not open): the chat was aborted, and this is the client's answer.
        self.refused: GatewayError | None = None


async def run_chat(
    proxy: OpenAIProxy,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    abort: asyncio.Event,
    chat: _Chat,
    on_event: Callable[[bytes], Awaitable[None] | None],
    principal: Principal | None = None,
    on_start: Callable[[], Awaitable[None]] | None = None,
    parsed: dict[str, Any] | None = None,
) -> None:
    """POST `body` to the gateway's own chat path as a client with `headers` would, with no
    client: `abort` set is that client leaving. SSE events go to `on_event` whole (without
    their blank line); a non-stream answer's body is kept in `chat.body`. `principal`: the
    caller is already known (a takeover has no Authorization to send). `on_start`: awaited
    once the chat path accepted the request (it answered 200 with an event stream), before
    `chat.started` is set and before any event; when it raises, the chat is aborted, its
    events are dropped and `chat.refused` says why. `parsed`: `body` already decoded
    (paved.gateway.forwarding.proxy.decode_body), not decoded again."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await abort.wait()
        return {"type": "http.disconnect"}

    buffer = b""

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal buffer
        if message["type"] == "http.response.start":
            chat.status = message["status"]
            chat.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", ())}
            chat.streaming = chat.status == 200 and chat.headers.get("content-type", "").startswith(
                "text/event-stream"
            )
            if chat.streaming and on_start is not None:
                try:
                    await on_start()
                except Exception as e:  # noqa: BLE001 - the client gets it; the chat must stop
                    if not isinstance(e, GatewayError):
                        logger.warning("could not start recording a chat stream: %s", e)
                        e = GatewayError(
                            503, "the stream store is unavailable", code="stream_store_unavailable"
                        )
                    chat.refused = e
                    abort.set()
            if chat.streaming and not chat.started.done():
                chat.started.set_result(None)
            return
        if message["type"] != "http.response.body" or chat.refused is not None:
            return
        data = message.get("body", b"")
        if not chat.streaming:
            chat.body += data
            return
        buffer += data
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            if event:
                result = on_event(event)
                if result is not None:
                    await result

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(),
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"content-type", b"application/json"), *headers],
    }  # fmt: skip
    try:
        response = await proxy.forward(
            Request(scope, receive), "chat", CHAT_PATH, principal=principal, body=parsed
        )
        await response(scope, receive, send)
    finally:
        if not chat.started.done():
            chat.started.set_result(None)


def _parse_text_json(raw: bytes) -> Any:
    return parse_json(raw, unicode_text=True)


def _passed_headers(request: Request) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in request.scope["headers"] if k in _PASSED]


def _error(e: GatewayError | oai.ResponsesError) -> JSONResponse:
    headers = getattr(e, "headers", None) or None
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status, headers=headers)


def _chat_error(chat: _Chat) -> str:
    try:
        value = json.loads(chat.body)
        return str(value["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"the model's backend answered {chat.status}"


class ResponsesAPI:
    """`/v1/responses` and the chat stream resume endpoint, for one gateway replica."""

    def __init__(
        self,
        *,
        proxy: OpenAIProxy,
        authenticator: Authenticator,
        store: ResponseStore,
        streams: LiveStreams,
        resumable_chat: bool = False,
        max_takeovers: int = 3,
    ):
        self.proxy = proxy
        self.authenticator = authenticator
        self.store = store
        self.streams = streams
        self.resumable_chat = resumable_chat
        self.max_takeovers = max_takeovers
        # Set by a read that found a lapsed lease: the sweep runs at once, not a lease later.
        self._wake = asyncio.Event()
        self._stopping = False
        # This replica's running generations by response id: a local cancel stops one at once.
        self._running: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.store.start()
        start = getattr(self.streams.log, "start", None)
        if start is not None:
            await start()
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        """Stop every generation: a background one is handed off (its events so far in the
        log, its lease released: another replica continues it at its next sweep), any other
        ends as its client leaving would end it."""
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for abort in self._running.values():
            abort.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self.streams.log.close()

    async def _sweep(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.store.bounds.lease_s / 2)
            self._wake.clear()
            try:
                claimed = await self.store.sweep(self.max_takeovers)
            except Exception as e:  # noqa: BLE001 - the next round retries
                logger.warning("could not sweep stored responses: %s", e)
                continue
            for one in claimed:
                logger.info("continuing response %s (takeover %d)", one.id, one.takeovers)
                self._spawn(self._take_over(one))

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self._guard(self.create), methods=["POST"]),
            Route("/v1/responses/{id}", self._guard(self.retrieve), methods=["GET"]),
            Route("/v1/responses/{id}", self._guard(self.delete), methods=["DELETE"]),
            Route("/v1/responses/{id}/cancel", self._guard(self.cancel), methods=["POST"]),
            Route("/v1/responses/{id}/input_items", self._guard(self.input_items), methods=["GET"]),
            Route(CHAT_PATH + "/streams/{id}", self._guard(self.resume_chat), methods=["GET"]),
        ]

    @staticmethod
    def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except (GatewayError, oai.ResponsesError) as e:
                return _error(e)

        return run

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _principal(self, request: Request) -> Principal:
        return await self.authenticator.authenticate(request.headers.get("authorization"))

    # ---- create -----------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        principal = await self._principal(request)
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise GatewayError(499, "client closed the request", code="client_closed_request") from None
        try:
            # Strings are stored and streamed as UTF-8: a lone surrogate is the client's 400.
            body = await off_loop_if_large(len(raw), _parse_text_json, raw) if raw else None
        except JSONBodyError as e:
            raise GatewayError(400, f"the request body is {e}") from None
        parsed = oai.parse_request(body)
        alias, _ = self.proxy.router.split_model(parsed.model)
        if not principal.allows(alias):
            raise ModelNotAllowedError(parsed.model)
        tenant = principal.tenant.name
        if parsed.previous_response_id is not None:
            previous = None
            if well_formed_id(parsed.previous_response_id):
                previous = await self.store.get(tenant, parsed.previous_response_id)
            if previous is None:
                raise GatewayError(404, _NOT_FOUND, param="previous_response_id", code="response_not_found")
            if previous.status in ACTIVE:
                raise GatewayError(
                    400, "the previous response has not finished yet", param="previous_response_id"
                )
            parsed.history = list(previous.messages)
        response_id = oai.new_id("resp")
        run = oai.ResponseStream(parsed, response_id, queued=parsed.background)
        # Resumable when stored and streamed (or in the background: any later reader may stream).
        logged = parsed.store and (parsed.stream or parsed.background)
        spec = None
        if logged:
            # What another replica needs to continue it if this one dies (never the key itself):
            # kept for every response with a log (background, or streamed: resumable).
            passed = [(k, v) for k, v in _passed_headers(request) if k != b"authorization"]
            spec = {
                "key_id": principal.key_id, "request": body, "chat": parsed.chat_body(),
                "base": [*parsed.history, *parsed.input_messages],
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in passed],
            }  # fmt: skip
        abort = asyncio.Event()
        job = _Job(self, parsed, run, None, abort, _passed_headers(request), tenant)
        if parsed.background:
            # Answered (with its id) before the chat path runs: stored and logged now, and a
            # refusal by the chat path ends it `failed`.
            await job.accept(logged, spec)
        else:
            # Stored and logged only once the chat path accepted it: a request it refuses (a
            # limit, the model, max_tokens) must not count toward the tenant's caps.
            job.defer(logged, spec)
        self._running[response_id] = abort
        task = self._spawn(job.run())
        if parsed.background:
            if parsed.stream:
                return self._follow_response(response_id)
            return JSONResponse(run.response)
        await job.chat.started
        if not job.chat.streaming or job.chat.refused is not None:
            # Refused before any output (limits, model, backend): the chat path's own answer.
            await task
            if job.chat.refused is not None:
                raise job.chat.refused
            if job.chat.status:
                return Response(job.chat.body, job.chat.status, media_type="application/json")
            raise GatewayError(502, job.error or "the gateway failed before the model answered")
        if job.live is not None:
            self._spawn(self._grace(job.live, abort, task))
        if parsed.stream:
            if job.live is not None:
                return self._follow_response(job.live.id)
            return StreamingResponse(
                _until_gone(job.local_events(), abort), media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )  # fmt: skip
        await _unless_disconnected(request, asyncio.shield(task), abort)
        return JSONResponse(run.response)

    def _follow_response(self, stream_id: str) -> Response:
        events = self.streams.follow(stream_id, -1)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", STREAM_HEADER: stream_id},
        )

    # ---- takeover of a response whose replica died ---------------------------------------
    async def _take_over(self, claimed: Claimed) -> None:
        """Continue a background response this replica claimed after its owner's lease lapsed:
        the same tenant, the same stream, the next sequence numbers. A failure before the
        generation starts (the database unreachable) leaves the claim to lapse: a later sweep
        claims it again, within the takeover bound."""
        abort = asyncio.Event()
        self._running[claimed.id] = abort
        try:
            await self._continue(claimed, abort)
        except Exception as e:  # noqa: BLE001 - a spawned task: nobody else would see it
            logger.warning("could not continue response %s: %s", claimed.id, e)
        finally:
            if self._running.get(claimed.id) is abort:  # (a later takeover here has its own)
                del self._running[claimed.id]

    async def _continue(self, claimed: Claimed, abort: asyncio.Event) -> None:
        job, response_id = claimed.job, claimed.id
        # Fenced before it is read: a predecessor still running (its renewals failed, it did
        # not die) can append nothing more, so what is read here is all it ever logged.
        if await self.streams.log.fence(response_id, claimed.takeovers) == FENCED:
            logger.warning("response %s: a later takeover already writes it; this one stops", response_id)
            return
        try:
            parsed = oai.parse_request(job["request"])
            run = oai.ResponseStream.resumed(parsed, response_id, await self._logged_events(response_id))
        except (oai.ResponsesError, ValueError, KeyError, TypeError, StreamTrimmed, GatewayError) as e:
            logger.warning("response %s cannot be continued: %s", response_id, e)
            body = failed_body(claimed.body, _CANNOT_CONTINUE + " (its events were lost or are incomplete)")
            await self.store.finish(response_id, "failed", body, [], epoch=claimed.takeovers)
            return
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in job["headers"]]
        principal = await self.store.principal(job["key_id"])
        taking = _Job(
            self, parsed, run, None, abort, headers, claimed.tenant, log_id=response_id, principal=principal,
            base=job["base"], epoch=claimed.takeovers,
        )  # fmt: skip
        bodies = None if run.done else self._continuation(job["chat"], run, taking)
        if principal is None:
            taking.error = _CANNOT_CONTINUE + " (the API key that created it was revoked or expired)"
        if run.done:
            # The log ended before the owner stored the outcome: store it, change nothing else.
            await taking._end()
            return
        work = asyncio.ensure_future(taking.run(bodies))
        if not parsed.background:
            self._spawn(self._log_grace(response_id, abort, work))
        await work

    async def _log_grace(self, stream_id: str, abort: asyncio.Event, task: asyncio.Future[Any]) -> None:
        """A continued stream (not background) goes on while a reader heartbeat in the log is
        under grace_s old, counting the takeover as one (its readers were cut off with the
        replica that died and may only be reconnecting); then it is aborted, as `_grace`
        aborts a stream of this replica's own."""
        grace = self.streams.grace_s
        since = time.time()
        while not task.done():
            await asyncio.wait({task}, timeout=max(0.5, grace / 3))
            if task.done():
                return
            with contextlib.suppress(Exception):
                info = await self.streams.log.info(stream_id)
                if info is None or time.time() - max(info.reader_at, since) > grace:
                    abort.set()
                    return

    @staticmethod
    def _continuation(chat: dict[str, Any], run: oai.ResponseStream, job: _Job) -> list[bytes]:
        """The chat bodies that generate the rest of `run`'s output (first choice first)."""
        text = run.text
        if run.has_calls:
            job.error = _CANNOT_CONTINUE + " in the middle of a function call"
            return []
        if text and chat.get("response_format"):
            job.error = _CANNOT_CONTINUE + " in the middle of a structured output"
            return []
        body = dict(chat)
        if isinstance(body.get("max_tokens"), int):
            body["max_tokens"] -= run.prior_tokens
            if body["max_tokens"] < 1:
                run.hit_limit()
                return []
        if not text:
            return [json.dumps(body, ensure_ascii=False).encode()]
        body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        extended = {**body, "continue_final_message": True, "add_generation_prompt": False}
        return [json.dumps(b, ensure_ascii=False).encode() for b in (extended, body)]

    async def _logged_events(self, stream_id: str) -> list[dict[str, Any]]:
        """Every event of a stream in the log, parsed; GatewayError when the log lost it."""
        if await self.streams.log.info(stream_id) is None:
            raise GatewayError(404, _EVENTS_GONE)
        events: list[dict[str, Any]] = []
        after = -1
        while batch := await self.streams.log.read(stream_id, after, 0):
            for seq, data, _ in batch:
                events.append(_event_of(data))
                after = seq
        return events

    # ---- retrieve, cancel, delete, input items ----------------------------------------------
    async def _stored(self, request: Request) -> tuple[Principal, Any]:
        principal = await self._principal(request)
        response_id = request.path_params["id"]
        found = None
        if well_formed_id(response_id):
            found = await self.store.get(principal.tenant.name, response_id)
        if found is None:
            raise GatewayError(404, _NOT_FOUND, code="response_not_found")
        return principal, found

    async def retrieve(self, request: Request) -> Response:
        principal, found = await self._stored(request)
        if found.lapsed:
            self._wake.set()
        query = request.query_params
        if query.get("stream") not in ("true", "1"):
            return JSONResponse(found.body)
        after = _int_param(query.get("starting_after"), "starting_after", -1)
        info = await self.streams.log.info(found.id) if found.streamed else None
        if info is None:
            if found.status in ACTIVE or not found.streamed:
                raise GatewayError(404, _EVENTS_GONE if found.streamed else
                                   "this response was not streamed: it has no events to replay",
                                   code="response_events_not_found")  # fmt: skip
            # Its log is gone but it finished: the terminal event, rebuilt from the stored object.
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                found.status, "response.failed"
            )
            return _one_event({"type": kind, "sequence_number": max(after + 1, 0), "response": found.body})
        if info.tenant != principal.tenant.name:
            raise GatewayError(404, _NOT_FOUND, code="response_not_found")
        return await self._follow_checked(found.id, after)

    async def _follow_checked(self, stream_id: str, after: int) -> Response:
        events = self.streams.follow(stream_id, after)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except StreamTrimmed:
            raise GatewayError(
                404, "the events after that point are no longer kept (the stream's bound or retention)",
                param="starting_after", code="stream_events_expired",
            ) from None  # fmt: skip

        async def all_events() -> AsyncIterator[bytes]:
            if first is not None:
                yield first
            async for event in events:
                yield event

        return StreamingResponse(
            all_events(),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", STREAM_HEADER: stream_id},
        )

    async def cancel(self, request: Request) -> Response:
        principal, found = await self._stored(request)
        if not found.body.get("background"):
            raise GatewayError(400, "only background responses can be cancelled", code="not_cancellable")
        cancelled = await self.store.cancel(principal.tenant.name, found.id)
        if cancelled is None:
            raise GatewayError(404, _NOT_FOUND, code="response_not_found")
        abort = self._running.get(found.id)
        if abort is not None:
            abort.set()
        return JSONResponse(cancelled.body)

    async def delete(self, request: Request) -> Response:
        principal = await self._principal(request)
        response_id = request.path_params["id"]
        tenant = principal.tenant.name
        if not well_formed_id(response_id) or not await self.store.delete(tenant, response_id):
            raise GatewayError(404, _NOT_FOUND, code="response_not_found")
        abort = self._running.get(response_id)
        if abort is not None:
            abort.set()
        with contextlib.suppress(Exception):
            await self.streams.log.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        _, found = await self._stored(request)
        query = request.query_params
        limit = _int_param(query.get("limit"), "limit", 20, low=1, high=100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError(400, "order must be asc or desc", param="order")
        items = list(found.input_items)
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after is not None:
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise GatewayError(400, "after names no item of this response", param="after")
            # After its last occurrence: ids are unique since they are checked, but a response
            # stored before may repeat one, and a page must never lead back to itself.
            items = items[len(ids) - ids[::-1].index(after) :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit,
            }
        )  # fmt: skip

    # ---- resumable chat streams -------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions: a stream becomes resumable (each event an `id:`, the
        stream's id in `x-paved-stream-id`); anything else is forwarded as before."""
        try:
            raw = await request.body()
        except ClientDisconnect:
            return await self.proxy.forward(request, "chat", CHAT_PATH)
        try:
            body = await decode_body(raw)
        except GatewayError:
            # The chat path answers it, as it answers any body it cannot take.
            return await self.proxy.forward(request, "chat", CHAT_PATH)
        if not self.resumable_chat or body.get("stream") is not True:
            return await self.proxy.forward(request, "chat", CHAT_PATH, body=body)
        principal = await self._principal(request)
        stream_id = oai.new_id("chatstream")
        abort = asyncio.Event()
        chat = _Chat()
        # Opened only once the chat path accepted the request: a refused one (a limit, an
        # unknown model) must not count toward the tenant's stream cap.
        live: LiveStream | None = None

        async def accept() -> None:
            nonlocal live
            live = await self.streams.create(stream_id, principal.tenant.name)

        def on_event(event: bytes) -> None:
            if live is None:  # (run_chat delivers events only once accepted)
                return
            end = event.startswith(b"data: [DONE]")
            self.streams.push(live, b"id: %d\n" % live.next_seq + event + b"\n\n", end=end)

        async def generate() -> None:
            try:
                headers = _passed_headers(request)
                await run_chat(self.proxy, headers, raw, abort, chat, on_event, on_start=accept, parsed=body)
            except Exception as e:  # noqa: BLE001 - the stream must still end
                logger.warning("chat stream %s failed: %s", stream_id, e)
            finally:
                if live is not None:
                    if not live.ended:
                        # Ended without [DONE] (an error event, an abort): a comment closes the log.
                        self.streams.push(live, b"id: %d\n: end\n\n" % live.next_seq, end=True)
                    await self.streams.flushed(live)

        task = self._spawn(generate())
        await chat.started
        if live is None or chat.refused is not None:
            await task
            if chat.refused is not None:
                return _error(chat.refused)
            headers = {k: v for k, v in chat.headers.items() if k.lower() not in ("content-length",)}
            return Response(chat.body, chat.status or 502, headers=headers)
        self._spawn(self._grace(live, abort, task))
        headers = {
            k: v for k, v in chat.headers.items() if k.lower() not in ("content-length", "content-type")
        }
        headers[STREAM_HEADER] = stream_id
        return StreamingResponse(
            self.streams.follow(stream_id, -1), media_type="text/event-stream", headers=headers
        )

    async def _grace(self, live: LiveStream, abort: asyncio.Event, task: asyncio.Task[Any]) -> None:
        """Abort a resumable generation once no reader was attached anywhere for grace_s."""
        grace = self.streams.grace_s
        while not task.done():
            idle = asyncio.ensure_future(live.idle.wait())
            done, _ = await asyncio.wait({task, idle}, return_when="FIRST_COMPLETED")
            idle.cancel()
            if task in done:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), grace)
                return
            if live.readers:
                continue
            info = await self.streams.log.info(live.id)
            if info is not None and time.time() - info.reader_at < grace:
                await asyncio.sleep(grace - (time.time() - info.reader_at))
                if live.readers:
                    continue
                info = await self.streams.log.info(live.id)
                if info is not None and time.time() - info.reader_at < grace:
                    continue
            abort.set()
            return

    async def resume_chat(self, request: Request) -> Response:
        principal = await self._principal(request)
        stream_id = request.path_params["id"]
        info = await self.streams.log.info(stream_id) if well_formed_id(stream_id) else None
        if info is None or info.tenant != principal.tenant.name:
            raise GatewayError(
                404, "no chat stream with that id (it may have expired, or its store was lost)",
                code="stream_not_found",
            )  # fmt: skip
        last = request.headers.get("last-event-id") or request.query_params.get("after")
        return await self._follow_checked(stream_id, _int_param(last, "Last-Event-ID", -1))


class _Job:
    """One response's generation: runs the chat path, translates its events, records them.

    Its events go to `live` (a stream this replica created), else straight to the log under
    `log_id` (a takeover: the stream was created by a replica that died), else to the local
    queue (`store: false`). A response created by a client is stored (and its stream opened)
    by `accept`: at once (background), or, when `defer`red, only once the chat path accepted
    the request; until then its events wait in `_pending`."""

    def __init__(
        self,
        api: ResponsesAPI,
        parsed: oai.ParsedRequest,
        run: oai.ResponseStream,
        live: LiveStream | None,
        abort: asyncio.Event,
        headers: list[tuple[bytes, bytes]],
        tenant: str,
        *,
        log_id: str | None = None,
        principal: Principal | None = None,
        base: list[dict[str, Any]] | None = None,
        epoch: int = 0,
    ):
        self.api, self.parsed, self.run_, self.live, self.abort = api, parsed, run, live, abort
        self.headers, self.tenant, self.log_id, self.principal = headers, tenant, log_id, principal
        # This writer's epoch in the log (a takeover's: its claim's count; see events.fence).
        self.epoch = epoch
        # The conversation before this response's output (stored for previous_response_id).
        self.base = base if base is not None else [*parsed.history, *parsed.input_messages]
        self.chat = _Chat()
        self.error: str | None = None
        # Without a log (store: false) the client's own stream reads from here.
        self._local: asyncio.Queue[bytes | None] = asyncio.Queue()
        # A takeover's events not yet appended to the log; lost: the log no longer keeps them.
        self._unwritten: list[tuple[int, bytes, bool]] = []
        self._log_lost = False
        self.cancelled = False
        # Another replica took this response over (our lease lapsed): we write nothing more.
        self.taken = False
        # The chat stream ended by itself ([DONE] or an error): nothing is left to hand off.
        self.answered = False
        # Stored with a log (and a job row): another replica can continue it.
        self.logged = parsed.store and (live is not None or log_id is not None)
        # Its row (when stored) and its log (when logged) exist: a takeover's always do.
        self.accepted = log_id is not None or live is not None
        # Set by `defer`: (logged, job spec) to `accept` with once the chat path started.
        self._deferred: tuple[bool, dict[str, Any] | None] | None = None
        self._pending: list[tuple[bytes, bool]] = []
        self._lease: asyncio.Task[None] | None = None
        # A continued response that was already in progress emits no second response.in_progress.
        self._started = run.response["status"] == "in_progress" and log_id is not None

    def _emit(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            data = oai.sse(event)
            end = event["type"] in oai.TERMINAL_EVENTS
            if self.live is not None:
                self.api.streams.push(self.live, data, end=end)
            elif self.log_id is not None:
                self._unwritten.append((event["sequence_number"], data, end))
            elif self._deferred is not None and self._deferred[0]:
                self._pending.append((data, end))
            else:
                self._local.put_nowait(data)
        if self.run_.done and self.live is None and self.log_id is None:
            self._local.put_nowait(None)

    def defer(self, logged: bool, spec: dict[str, Any] | None) -> None:
        """Store the response (and open its log when `logged`) only when the chat path
        starts answering; a request it refuses leaves nothing behind."""
        self._deferred = (logged, spec)

    async def start_accepted(self) -> None:
        """run_chat's on_start: the deferred `accept`."""
        if self._deferred is not None:
            logged, spec = self._deferred
            await self.accept(logged, spec)
            self._deferred = None

    async def accept(self, logged: bool, spec: dict[str, Any] | None) -> None:
        """Open the response's log (`logged`) and store it (`store`), leased to this replica,
        with `spec`, what another replica needs to continue it. Raises GatewayError (503) when
        either store is unavailable, and then leaves neither behind."""
        api, response_id = self.api, self.run_.response["id"]
        if logged:
            self.live = await api.streams.create(response_id, self.tenant)
            pending, self._pending = self._pending, []
            for data, end in pending:
                api.streams.push(self.live, data, end=end)
        if self.parsed.store:
            try:
                await api.store.create(
                    self.tenant, dict(self.run_.response), self.parsed.input_items, logged, spec
                )
            except BaseException:
                if self.live is not None:
                    # Nobody reads it: the flusher finds it gone, and it counts toward no cap.
                    with contextlib.suppress(Exception):
                        await api.streams.log.delete(response_id)
                raise
            self._lease = asyncio.create_task(self._keep_lease(response_id))
        self.logged = self.parsed.store and logged
        self.accepted = True

    async def _write(self) -> None:
        """A takeover's events into the log, in order, before the next chunk is read (the
        backpressure of a rare path; a LiveStream's flusher batches them on the usual one)."""
        if self.log_id is None or not self._unwritten or self.taken:
            return
        batch, self._unwritten = self._unwritten, []
        if self._log_lost:
            return
        log = self.api.streams.log
        try:
            held = await log.append(
                self.log_id, [(seq, data) for seq, data, _ in batch], batch[-1][2], epoch=self.epoch
            )
        except Exception as e:  # noqa: BLE001 - a log outage costs resumability, not the response
            logger.warning("could not write stream %s to the event log: %s", self.log_id, e)
            held = HOLE
        if held == FENCED:
            # A later takeover writes it now (our lease lapsed): stop, leave the log to it.
            self.taken = True
            self.abort.set()
            return
        if held < 0:
            # The log lost the stream (or would get a gap): no more of it there, and no stream
            # at all rather than one with a hole (readers get a clear 404, as LiveStreams does).
            self._log_lost = True
            with contextlib.suppress(Exception):
                await log.delete(self.log_id)

    async def local_events(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._local.get()
            if item is None:
                return
            yield item

    def _on_event(self, event: bytes) -> None:
        if not event.startswith(b"data:"):
            return
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.answered = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        message = oai.chat_error_message(chunk)
        if message is not None:
            self.error = message
            self.answered = True
            return
        self._emit(self.run_.feed(chunk))

    async def run(self, bodies: list[bytes] | None = None) -> None:
        """Generate, then store the outcome. `bodies`: chat bodies to try in turn, the next
        only when the backend refused the one before it as an unknown extension (a
        continuation with vLLM's continue_final_message, then without it); default: the
        request's own body; none: nothing is left to generate (or `self.error` says why not)."""
        api, store, response_id = self.api, self.api.store, self.run_.response["id"]
        try:
            if self.run_.seq < 0:
                self._emit(self.run_.start())
            await self._write()
            if self.parsed.store and self.log_id is not None:
                self._lease = asyncio.create_task(self._keep_lease(response_id))
            if bodies is None:
                bodies = [json.dumps(self.parsed.chat_body(), ensure_ascii=False).encode()]

            def on_event(event: bytes) -> Awaitable[None]:
                if self.run_.response["status"] != "in_progress" or not self._started:
                    self._started = True
                    self._emit(self.run_.running())
                    if self.parsed.store:
                        api._spawn(
                            store.set_status(response_id, "in_progress", dict(self.run_.response), self.epoch)
                        )
                self._on_event(event)
                return self._write()

            for i, body in enumerate(bodies):
                if self.error is not None:
                    break
                if i:
                    self.chat = _Chat()
                await run_chat(
                    api.proxy, self.headers, body, self.abort, self.chat, on_event, self.principal,
                    on_start=self.start_accepted,
                )  # fmt: skip
                if not (i + 1 < len(bodies) and self.chat.status == 400 and _EXTENSION in self.chat.body):
                    break
            if bodies and self.error is None and self.chat.status != 200:
                self.error = _chat_error(self.chat)
        except Exception as e:  # noqa: BLE001 - the response must still end
            logger.warning("response %s failed: %s", response_id, e)
            self.error = f"the gateway failed while generating: {type(e).__name__}"
        finally:
            # Failed before the chat path ran: whoever waits for its start (create) goes on.
            if not self.chat.started.done():
                self.chat.started.set_result(None)
            if self._lease is not None:
                self._lease.cancel()
            if api._running.get(response_id) is self.abort:  # (a successor here has its own)
                del api._running[response_id]
            if self.taken:
                logger.warning("response %s was taken over by another replica; this one stops", response_id)
                if self.live is not None:
                    api.streams.hand_over(self.live)
            elif api._stopping and self.logged and not self.answered:
                await self._hand_off()
            else:
                await self._end()

    async def _hand_off(self) -> None:
        """This replica is stopping: the events so far into the log, then the lease released,
        so that another replica continues the response from exactly there."""
        response_id = self.run_.response["id"]
        await self._write()
        live = self.live
        if live is not None:
            # The flusher writes what was pushed (readers only ever got what it wrote); wait,
            # briefly (stop is bounded), until it wrote it all, so the successor loses none.
            for _ in range(150):  # 3 s
                if live.logged >= live.next_seq or live.unlogged or live.fenced:
                    break
                await asyncio.sleep(0.02)
        with contextlib.suppress(Exception):
            if await self.api.store.release(response_id, self.epoch):
                logger.info("response %s handed off for another replica to continue", response_id)

    async def _end(self) -> None:
        """The terminal event into the log, then the final status into the store."""
        self.cancelled = self.abort.is_set()
        self._emit(self.run_.finish(error=None if self.cancelled else self.error, cancelled=self.cancelled))
        await self._write()
        if self.live is not None:
            await self.api.streams.flushed(self.live)
        if self.parsed.store and self.accepted and not self.taken and not (self.live and self.live.fenced):
            messages = [*self.base, *self.run_.output_messages()]
            with contextlib.suppress(Exception):
                await self.api.store.finish(
                    self.run_.response["id"], self.run_.response["status"], self.run_.response, messages,
                    self.epoch,
                )  # fmt: skip

    async def _keep_lease(self, response_id: str) -> None:
        """Renew the lease; a response cancelled or deleted on another replica, or taken over
        by one after a lapse, stops here."""
        period = max(0.2, min(1.0, self.api.store.bounds.lease_s / 3))
        while True:
            await asyncio.sleep(period)
            if self.live is not None and self.live.fenced:
                # The log refused our events for a successor's (renewals may still be failing).
                self.taken = True
                self.abort.set()
                return
            try:
                renewed = await self.api.store.renew(response_id, self.epoch)
                if renewed != "renewed":
                    self.taken = renewed == "taken"
                    self.abort.set()
                    return
            except GatewayError as e:
                logger.warning("could not renew the lease of %s: %s", response_id, e.message)


async def _until_gone(events: AsyncIterator[bytes], abort: asyncio.Event) -> AsyncIterator[bytes]:
    """A non-resumable stream: the client leaving (this generator closed early) aborts it."""
    try:
        async for event in events:
            yield event
    finally:
        abort.set()


async def _unless_disconnected(request: Request, work: Awaitable[Any], abort: asyncio.Event) -> None:
    from paved.gateway.forwarding.held import ClientGone, unless_gone

    try:
        await unless_gone(request.receive, work, lambda _: None)
    except ClientGone:
        abort.set()
        raise GatewayError(499, "client closed the request", code="client_closed_request") from None


def _stream_headers(stream_id: str) -> dict[str, str]:
    return {"cache-control": "no-cache", "x-accel-buffering": "no", STREAM_HEADER: stream_id}


def _event_of(data: bytes) -> dict[str, Any]:
    """The event of one SSE frame `oai.sse` wrote."""
    for line in data.split(b"\n"):
        if line.startswith(b"data: "):
            value = json.loads(line[6:])
            if isinstance(value, dict):
                return value
    raise ValueError("an event without data")


def _one_event(event: dict[str, Any]) -> Response:
    return Response(oai.sse(event), media_type="text/event-stream")


def _int_param(value: str | None, name: str, default: int, *, low: int = -1, high: int = MAX_SEQ) -> int:
    """An integer query parameter or header, `low` to `high` (else a 400 naming it and its
    range); the default range is a resume point's: one past what a log can hold would fail in
    the log's read (a 500), not be answered."""
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise GatewayError(400, f"{name} must be an integer", param=name) from None
    if not low <= number <= high:
        raise GatewayError(400, f"{name} must be between {low} and {high}", param=name)
    return number
