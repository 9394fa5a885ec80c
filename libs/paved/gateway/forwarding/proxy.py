"""The OpenAI data path: authenticate, admit against limits, route, forward, stream, reconcile.

Order of a request (each stage timed into the access log and `paved_gateway_stage_*`):
  auth (401) -> body + model check (400 / 404, not-allowed worded as unknown) -> prompt tokens
  -> limits (429, tokens reserved) -> the model's queue (paved.gateway.flow.flow; straight through
  while its backends have room) -> route + forward, moving to another backend only while
  nothing has reached the client (connect errors, 502/503/504) -> answer -> reconcile. When
  every backend tried had no room (503, a connect timeout), or before sending when every
  candidate's fresh gauges say its frontend admits nothing more (Router.saturated), the request
  goes back to the queue and waits for room until its deadline (then 503 + Retry-After, code
  queue_timeout).

Scale to zero: a model whose route is `scaled_to_zero` (no backends; the control plane scaled
it to zero while idle) keeps its alias. `self.held` (paved.gateway.forwarding.held, shared with
the KServe forwarders) pins its queue's window to 0 while the table says so, so its requests are
held in the same queue, with the same fairness, bound, Retry-After refusals and disconnect
handling, and the same limits already reserved; their deadline is `wake_max_wait_s` rather than
the queue's wait. The first one held starts the wake loop (paved.gateway.routing.wake: the
control plane's wake endpoint, once a second while requests are held);
`paved_gateway_held_requests{model}` counts them. The table that routes the model's first ready
replica unpins the window, which releases the held requests in their fair order. A pin
`alias@version` is held the same way when the table at zero lists that version.

Invariants:
- Every admitted request calls `Limiter.finish` exactly once: with the upstream's reported
  usage when the answer completed, with what was streamed so far (prompt plus content events)
  when the client left mid-stream, and with None (full refund) when nothing was generated.
- Every `Router.begin` has one `Router.end`, both given the Pick's `cost`; `ok=False` only for
  failures of the backend (connect errors, timeouts, resets, 5xx other than 503 backpressure).
- Every try that reached a backend is counted once against it: in `paved_gateway_requests_total`
  when its answer is passed on, else in `paved_gateway_retries_total` (reason `overloaded` or
  `error`); a push-back (503 `overloaded`, `is_pushback`) is also counted in
  `paved_gateway_pushback_total`. Answers the gateway makes itself (every try failed, a queue
  refusal) carry no backend.
- Every granted queue slot is released exactly once, when the answer or stream has ended (or
  the request failed); a client that leaves while queued leaves the queue (499).
- `paved_gateway_held_requests{model}` goes up once and down once per request held for a model
  at zero, however its wait ends (granted, refused, client gone).
- Upstream connections are pooled: one aiohttp session per gateway (keep-alive, no limit per
  host, so a burst opens what it needs and later requests reuse them), shared with the
  gateway's internal calls and KServe HTTP forwarding.
- A stream that the upstream breaks ends with an `error` event and never with `[DONE]`; a
  client that leaves closes the upstream connection, which aborts the engine's request.
- Streams always ask the upstream for usage (`stream_options.include_usage`) and strip the
  usage event when the client did not ask for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from paved.bodies import read_at_most
from paved.gateway.caching.cache import answer_from_stream, replay_sse
from paved.gateway.errors import GatewayError, ModelNotAllowedError
from paved.gateway.flow.flow import PRIORITY_HEADER, FlowController, Priority, Slot
from paved.gateway.forwarding.held import ClientGone, HeldRequests, release_slot, unless_gone
from paved.gateway.metrics import GatewayMetrics
from paved.gateway.orchestration.tokens import TokenCounter
from paved.http.errors import error_body
from paved.http.json_body import JSONBodyError, parse_json
from paved.http.off_loop import off_loop_if_large
from paved.http.sockets import POOL_KEEPALIVE_S
from paved.http.tracing import request_ids

if TYPE_CHECKING:
    from paved.gateway.access.auth import Authenticator
    from paved.gateway.access.limits import Limiter, Reservation
    from paved.gateway.orchestration.orchestrate import Hit, Orchestrator, Plan
    from paved.gateway.routing.router import Pick, Router
    from paved.gateway.routing.wake import WakeCaller
    from paved.gateway.types import Principal

logger = logging.getLogger("paved.gateway")
access_log = logging.getLogger("paved.gateway.access")

# Upstream statuses worth another backend: the answer never started there.
_RETRYABLE = frozenset((502, 503, 504))
_HOP_HEADERS = frozenset(
    ("connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server")
)
_DONE = b"data: [DONE]"
# What is kept of one streamed answer to cache or record it (a longer one is just forwarded).
MAX_CAPTURE_BYTES = 1 << 20
# The OpenAI error code of a backend pushing back (a 503 that is not a failure; see is_pushback).
PUSHBACK_CODE = "overloaded"
# A refused try's body is read to classify it: error bodies are small and come with the headers,
# so a longer or slower one is treated as a failure rather than holding the request up.
_MAX_REFUSAL_BYTES = 16 << 10
_REFUSAL_READ_S = 1.0


@dataclass
class ProxyConfig:
    connect_timeout_s: float = 3.0
    # A non-streaming answer, whole; and a stream's longest silence between two events.
    upstream_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 120.0
    max_attempts: int = 3
    # Reserved for a request that names no max_tokens (reconciled with usage on finish).
    default_max_tokens: int = 256
    # The longest a request for a model scaled to zero is held while it wakes (a cold start
    # takes longer than a queue's usual wait); then 503 + Retry-After.
    wake_max_wait_s: float = 180.0


class OpenAIProxy:
    """Forwards OpenAI requests for `Router`'s models; one per gateway."""

    def __init__(
        self,
        *,
        authenticator: Authenticator,
        limiter: Limiter,
        router: Router,
        metrics: GatewayMetrics,
        tokens: TokenCounter,
        config: ProxyConfig,
        flow: FlowController | None = None,
        waker: WakeCaller | None = None,
    ):
        self.authenticator = authenticator
        # The per-model queue in front of dispatch; None (or max_queued 0): a request finding
        # no backend with room is answered 503 at once.
        self.flow = flow
        self.limiter = limiter
        self.router = router
        self.metrics = metrics
        self.tokens = tokens
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        # Templates, conversations, caches and experiments (paved.gateway.orchestration.orchestrate); set by
        # whoever builds the gateway, None for a plain forwarding gateway.
        self.orchestrator: Orchestrator | None = None
        # Scale to zero: the control plane's wake endpoint (None: a routes file, nobody to wake;
        # requests are still held until their deadline), and the requests held for models at
        # zero, over every protocol (the KServe forwarders are handed `held`).
        self.waker = waker
        self.held = HeldRequests(router, flow, waker, metrics, config.wake_max_wait_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Keep-alive pool to the backends; per-call timeouts are set on each request.
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=POOL_KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- models ----------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        data = []
        for alias in self.router.aliases():
            if not principal.allows(alias):
                continue
            data.append({"id": alias, "object": "model", "created": 0, "owned_by": "paved"})
            # At zero: the versions it serves once woken (a pin to one is held, not a 404).
            for version in sorted(self.router.route(alias).versions):
                data.append(
                    {"id": f"{alias}@{version}", "object": "model", "created": 0, "owned_by": "paved"}
                )
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        model = request.path_params["model"]
        alias, _ = self.router.split_model(model)
        if not principal.allows(alias):
            raise ModelNotAllowedError(model)
        self.router.route(model)
        return JSONResponse({"id": model, "object": "model", "created": 0, "owned_by": "paved"})

    # ---- generation and embeddings ---------------------------------------------------------
    async def forward(
        self,
        request: Request,
        endpoint: str,
        path: str,
        *,
        principal: Principal | None = None,
        body: dict[str, Any] | None = None,
    ) -> Response:
        """Answer one OpenAI request. `principal`: the caller is already known (the batch
        runner, paved.gateway.batches, replays a line for the tenant that created the batch):
        no Authorization is read, everything after it (limits, queue, cache) applies as is.
        `body`: the request's body as `decode_body` returned it, when a caller already decoded
        it (it is not decoded twice; this call may change it)."""
        started = time.perf_counter()
        request_id, traceparent = request_ids(request)
        # The trace id joins this line to the instance's access line for the same request.
        log: dict[str, Any] = {
            "request_id": request_id,
            "trace_id": traceparent.split("-")[1],
            "endpoint": endpoint,
        }
        try:
            return await self._forward(
                request, endpoint, path, request_id, traceparent, started, log, principal, body
            )
        except GatewayError as e:
            log["status"] = e.status
            log.setdefault("error", e.code)
            self._count(log, e.status)
            headers = {**e.headers, "x-request-id": request_id}
            return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status, headers=headers)
        finally:
            if "streaming" not in log:
                self._finish_log(log, started)

    async def _forward(
        self,
        request: Request,
        endpoint: str,
        path: str,
        request_id: str,
        traceparent: str,
        started: float,
        log: dict[str, Any],
        principal: Principal | None,
        body: dict[str, Any] | None,
    ) -> Response:
        if principal is None:
            principal = await self.authenticator.authenticate(request.headers.get("authorization"))
        log["tenant"], log["key"] = principal.tenant.name, principal.key_id
        t_auth = time.perf_counter()
        log["auth_ms"] = _ms(started, t_auth)
        self.metrics.stage.labels("auth").observe(t_auth - started)

        if body is None:
            try:
                raw = await request.body()
            except ClientDisconnect:
                # Gone mid-upload: nobody reads an answer, and it is no server error.
                raise GatewayError(499, "client closed the request", code="client_closed_request") from None
            body = await decode_body(raw)
        model, alias, route = _check_model(principal, self.router, body)
        log["model"] = alias
        priority = Priority.parse(request.headers.get(PRIORITY_HEADER))
        stream = body.get("stream") is True
        if stream and endpoint == "embeddings":
            raise GatewayError(400, "embeddings cannot be streamed", param="stream")
        client_wants_usage = False
        if stream:
            options = body.get("stream_options")
            if options is not None and not isinstance(options, dict):
                raise GatewayError(400, "stream_options must be an object", param="stream_options")
            client_wants_usage = bool(options and options.get("include_usage"))
            body["stream_options"] = {**(options or {}), "include_usage": True}

        call = _Call(
            request, principal, endpoint, path, model, alias, body, stream, client_wants_usage,
            request_id, traceparent, started, log, priority,
        )  # fmt: skip
        if self.orchestrator is not None:
            # The summaries and embeddings made for this request are charged to its caller.
            call.plan = await self.orchestrator.prepare(
                principal, endpoint, body, model, route, request.headers, request_id, limiter=self.limiter
            )
            call.model = call.plan.model
        try:
            return await self._admit(call, route)
        except GatewayError as e:
            if call.plan is not None and self.orchestrator is not None:
                await self.orchestrator.complete(call.plan, e.status, None, time.perf_counter() - started)
            raise

    async def _admit(self, call: _Call, route: Any) -> Response:
        endpoint, body, log, plan = call.endpoint, call.body, call.log, call.plan
        count = await self.tokens.count(route.tokenizer, endpoint, body, route.affinity_prefix_tokens)
        reserve = count.tokens + _completion_budget(endpoint, body, self.config.default_max_tokens)
        log["prompt_tokens_est"] = count.tokens
        t_count = time.perf_counter()
        reservation = await self.limiter.acquire(call.principal, reserve)
        t_limits = time.perf_counter()
        log["limits_ms"] = _ms(t_count, t_limits)
        self.metrics.stage.labels("limits").observe(t_limits - t_count)
        try:
            if plan is not None and self.orchestrator is not None:
                hit = await self.orchestrator.lookup(plan)
                if hit is not None:
                    return await self._serve_hit(call, plan, hit, reservation)
            return await self._dispatch(call, reservation, count.affinity)
        except BaseException:
            # Nothing reached the client and nothing was generated: refund everything.
            with anyio.CancelScope(shield=True):
                await self._settle(reservation, None)
            raise

    async def _dispatch(self, call: _Call, reservation: Reservation, affinity: bytes | None) -> Response:
        """Forward through the model's queue: straight through while its backends have room,
        else held (fairly across tenants) until they do or the request's deadline passes. A
        request for a model at zero is held the same way while the model wakes."""
        flow = self.flow
        at_zero = self.held.at_zero(call.alias)
        if at_zero:
            self.held.wake(call.alias)
        if flow is None or not flow.enabled:
            return await self._attempts(call, reservation, affinity, None)
        tenant = call.principal.tenant.name
        wait_s = self.config.wake_max_wait_s if at_zero else flow.config.max_wait_s
        deadline = time.monotonic() + wait_s
        slot = flow.try_acquire(call.alias, tenant, call.priority, deadline)
        try:
            if slot is None:
                waiting = flow.acquire(call.alias, tenant, call.priority, deadline)
                if at_zero:
                    slot = await self.held.wait(
                        call.alias, waiting, wait_s, lambda w: self._wait_turn(call, w)
                    )
                else:
                    slot = await self._wait_turn(call, waiting)
            while True:
                try:
                    return await self._attempts(call, reservation, affinity, slot)
                except _NoRoom as e:
                    await self._wait_turn(call, slot.requeue(hold=e.held))
        except ClientGone:
            if slot is not None:
                slot.release()
            self.metrics.disconnects.labels(call.alias).inc()
            call.log["status"] = 499
            raise GatewayError(499, "client closed the request", code="client_closed_request") from None
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        finally:
            if slot is not None and slot.waited_s:
                call.log["queue_ms"] = round(slot.waited_s * 1000, 3)

    async def _wait_turn(self, call: _Call, waiting: Awaitable[_T]) -> _T:
        """Wait in the queue unless the client leaves first (then the waiter leaves too)."""
        # A slot granted in the same instant as the client left is given back.
        return await unless_gone(call.request.receive, waiting, release_slot)

    async def _attempts(
        self, call: _Call, reservation: Reservation, affinity: bytes | None, slot: Slot | None
    ) -> Response:
        """Up to `max_attempts` backends, until one answers. With a queue slot, a round in which
        every backend tried had no room raises _NoRoom (the caller queues the request again)."""
        body, log, principal, model = call.body, call.log, call.principal, call.model
        sticky = body.get("user") if isinstance(body.get("user"), str) else principal.key_id
        excluded: set[str] = set()
        dropped: set[str] = set()
        last_error: GatewayError | None = None
        # Every failure so far said "no room" (a 503, a connect timeout): not a broken backend.
        no_room = True
        headers = {
            "content-type": "application/json",
            "x-request-id": call.request_id,
            "traceparent": call.traceparent,
        }
        t_route = time.perf_counter()
        for attempt in range(self.config.max_attempts):
            try:
                if (
                    slot is not None
                    and no_room
                    and self.router.saturated(model, sticky_key=str(sticky), exclude=excluded)
                ):
                    # Every backend left reads full: sending would only earn a 503. Wait for room.
                    raise _NoRoom(held=True)
                pick = self.router.pick(model, sticky_key=str(sticky), affinity=affinity, exclude=excluded)
            except GatewayError:
                if last_error is not None:
                    if slot is not None and no_room:
                        raise _NoRoom from None
                    raise last_error from None
                raise
            if attempt == 0:
                self.metrics.stage.labels("route").observe(time.perf_counter() - t_route)
                log["route_ms"] = _ms(t_route, time.perf_counter())
            log["attempts"] = attempt + 1
            backend = pick.backend
            body["model"] = backend.upstream_model
            try:
                payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            except UnicodeEncodeError:
                # Only text the gateway put in (a rendered template, a summary) can get here:
                # the client's body was checked for lone surrogates on arrival.
                raise GatewayError(
                    400, "the prompt contains a lone UTF-16 surrogate, which is not valid Unicode"
                ) from None
            self.router.begin(backend.id, pick.cost)
            in_flight = self.metrics.in_flight.labels(backend.id)
            in_flight.inc()
            sent = time.perf_counter()
            try:
                upstream = await self._send(call.request, backend.url + call.path, payload, headers)
            except ClientGone:
                self.router.end(backend.id, ok=True, cost=pick.cost)
                in_flight.dec()
                self.metrics.disconnects.labels(call.alias).inc()
                log["status"] = 499
                raise GatewayError(499, "client closed the request", code="client_closed_request") from None
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                in_flight.dec()
                if isinstance(e, aiohttp.ServerDisconnectedError) and backend.id not in dropped:
                    # Most often a pooled keep-alive connection the backend closed as we reused
                    # it (a backend not configured like paved's, one restarting): the backend is
                    # likely fine, so it may take the next attempt, once.
                    dropped.add(backend.id)
                    self.router.end(backend.id, ok=True, cost=pick.cost)
                else:
                    self.router.end(backend.id, ok=False, cost=pick.cost)
                    excluded.add(backend.id)
                    # A connect that times out is a full accept queue (a burst), not a dead one.
                    no_room = no_room and isinstance(e, aiohttp.ConnectionTimeoutError)
                self._count_unanswered(backend.id, pushed_back=False)
                logger.warning("backend %s failed before answering (%s); trying another", backend.id, e)
                last_error = GatewayError(
                    502,
                    f"the model's backend failed before answering: {type(e).__name__}",
                    code="upstream_error",
                )
                continue
            first_byte = time.perf_counter()
            self.metrics.first_byte.labels(backend.id).observe(first_byte - sent)
            last = attempt + 1 == self.config.max_attempts
            # The last backend tried had no room either: wait in the queue for room.
            requeue = upstream.status == 503 and slot is not None and no_room and last
            if requeue or (upstream.status in _RETRYABLE and not last):
                pushed_back = upstream.status == 503 and is_pushback(503, await _refusal_body(upstream))
                upstream.close()
                self.router.end(backend.id, ok=upstream.status == 503, cost=pick.cost)
                in_flight.dec()
                self._count_unanswered(backend.id, pushed_back=pushed_back)
                if requeue:
                    raise _NoRoom
                no_room = no_room and upstream.status == 503
                excluded.add(backend.id)
                last_error = GatewayError(
                    upstream.status,
                    f"the model's backend answered {upstream.status}",
                    code="upstream_unavailable",
                )
                continue
            # Only the backend whose answer is passed on is the request's backend: a 503 the
            # gateway sends itself after every try (or from its queue) is its own answer, and
            # each refused try is already counted by `_count_unanswered`.
            log["backend"], log["first_byte_ms"] = backend.id, _ms(sent, first_byte)
            if call.stream and upstream.status == 200:
                return self._stream(call, upstream, pick, reservation, in_flight, slot)
            return await self._whole(call, upstream, pick, reservation, in_flight, slot)
        if slot is not None and no_room and last_error is not None:
            raise _NoRoom
        raise last_error or GatewayError(502, "no backend answered", code="upstream_error")

    async def _send(
        self, request: Request, url: str, payload: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST upstream until its response headers arrive, unless the client leaves first."""
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout_s, sock_read=self.config.upstream_timeout_s
        )
        send = self.session.post(url, data=payload, headers=headers, timeout=timeout)
        return await unless_gone(request.receive, send, lambda resp: resp.close())

    async def _whole(
        self,
        call: _Call,
        upstream: aiohttp.ClientResponse,
        pick: Pick,
        reservation: Reservation,
        in_flight: Any,
        slot: Slot | None,
    ) -> Response:
        alias, request_id, log, plan = call.alias, call.request_id, call.log, call.plan
        backend = pick.backend
        ok = upstream.status < 500 or upstream.status == 503
        try:
            read = _read_whole(upstream, self.config.upstream_timeout_s)
            try:
                data = await unless_gone(call.request.receive, read, _discard)
            except ClientGone:
                upstream.close()
                self.metrics.disconnects.labels(alias).inc()
                log["status"] = 499
                await self._settle(reservation, None)
                return Response(status_code=499)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                ok = False
                raise GatewayError(
                    502,
                    f"the model's backend failed while answering: {type(e).__name__}",
                    code="upstream_error",
                ) from None
        finally:
            self.router.end(backend.id, ok=ok, cost=pick.cost)
            in_flight.dec()
            if slot is not None:
                slot.release(completed=ok and upstream.status != 503)
        used = None
        if upstream.status == 503 and is_pushback(503, data):
            self.metrics.pushback.labels(backend.id).inc()
        if upstream.status == 200:
            usage = _usage_of(data)
            if usage is not None:
                used = self._count_usage(log, alias, usage)
        await self._settle(reservation, used)
        log["status"] = upstream.status
        self._count(log, upstream.status)
        headers = _response_headers(upstream, reservation, request_id, backend.id)
        if plan is not None and self.orchestrator is not None:
            headers.update(plan.headers)
            await self.orchestrator.complete(plan, upstream.status, data, time.perf_counter() - call.started)
        return Response(data, status_code=upstream.status, headers=headers)

    def _stream(
        self,
        call: _Call,
        upstream: aiohttp.ClientResponse,
        pick: Pick,
        reservation: Reservation,
        in_flight: Any,
        slot: Slot | None,
    ) -> Response:
        alias, client_wants_usage, started, log, plan = (
            call.alias, call.client_wants_usage, call.started, call.log, call.plan
        )  # fmt: skip
        backend = pick.backend
        log["streaming"] = True
        orchestrator = self.orchestrator if plan is not None and plan.capture else None
        captured: list[bytes] = []
        capture_budget = [MAX_CAPTURE_BYTES]
        idle = self.config.stream_idle_timeout_s
        prompt_tokens = int(log.get("prompt_tokens_est") or 0)

        state: dict[str, Any] = {"used": None, "content_events": 0, "outcome": "disconnect", "ok": True}

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in _sse_events(upstream, idle):
                    if orchestrator is not None and capture_budget[0] >= 0:
                        capture_budget[0] -= len(event)
                        captured.append(event)
                    if event.startswith(_DONE):
                        state["outcome"] = "done"
                        if orchestrator is not None and plan is not None:
                            # Before [DONE] leaves: a client's next turn must see this one.
                            whole = (
                                answer_from_stream(plan.endpoint, captured)
                                if capture_budget[0] >= 0
                                else None
                            )
                            await orchestrator.complete(
                                plan, 200 if whole is not None else 502, whole, time.perf_counter() - started
                            )
                        yield event + b"\n\n"
                        break
                    if b'"usage":{' in event or b'"usage": {' in event:
                        parsed = _event_json(event)
                        usage = parsed.get("usage") if parsed else None
                        if parsed is not None and isinstance(usage, dict):
                            state["used"] = self._count_usage(log, alias, usage)
                            if not client_wants_usage:
                                if not parsed.get("choices"):
                                    continue
                                parsed.pop("usage", None)
                                event = b"data: " + json.dumps(parsed, separators=(",", ":")).encode()
                    else:
                        state["content_events"] += 1
                    yield event + b"\n\n"
                else:
                    state["outcome"], state["ok"] = "truncated", False
                    yield _error_event("the model's backend ended the stream before it was complete")
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                state["outcome"], state["ok"] = "reset", False
                yield _error_event(f"the model's backend failed mid-stream: {type(e).__name__}")
            finally:
                # Closing (not releasing) the connection is what aborts the engine's request.
                upstream.close()

        async def cleanup() -> None:
            upstream.close()
            outcome = state["outcome"]
            self.router.end(backend.id, ok=state["ok"], cost=pick.cost)
            in_flight.dec()
            if slot is not None:
                slot.release(completed=state["ok"])
            if outcome in ("reset", "truncated"):
                self.metrics.stream_errors.labels(backend.id).inc()
            elif outcome == "disconnect":
                self.metrics.disconnects.labels(alias).inc()
            used = state["used"]
            if used is None and outcome != "done" and state["content_events"]:
                # What the client may have seen: its prompt plus at least one token per event.
                used = prompt_tokens + state["content_events"]
            await self._settle(reservation, used)
            status = {"done": 200, "disconnect": 499}.get(outcome, 502)
            if orchestrator is not None and plan is not None and outcome != "disconnect":
                await orchestrator.complete(plan, status, None, time.perf_counter() - started)
            log["status"], log["stream_outcome"] = status, outcome
            self._count(log, status)
            self._finish_log(log, started)

        headers = _response_headers(upstream, reservation, call.request_id, backend.id)
        if plan is not None:
            headers.update(plan.headers)
        headers["cache-control"] = "no-cache"
        headers["x-accel-buffering"] = "no"
        return _GuardedStream(events(), cleanup, headers=headers, media_type="text/event-stream")

    async def _serve_hit(self, call: _Call, plan: Plan, hit: Hit, reservation: Reservation) -> Response:
        """Answer from the cache: no engine ran, so no tokens are charged (the request still
        counts against requests/min); the conversation and the experiment still see it."""
        log = call.log
        await self._settle(reservation, 0)
        plan.store = False
        if self.orchestrator is not None:
            await self.orchestrator.complete(plan, 200, hit.answer.body, time.perf_counter() - call.started)
        headers = dict(reservation.headers)
        headers.update(plan.headers)
        headers.update(
            {"x-request-id": call.request_id, "x-paved-cache": hit.header, "x-paved-cache-entry": hit.entry}
        )
        log.update(status=200, backend="cache", cache=hit.header)
        self._count(log, 200)
        if call.stream:
            headers["cache-control"] = "no-cache"
            events = replay_sse(call.endpoint, hit.answer, include_usage=call.client_wants_usage)
            return StreamingResponse(_replay(events), headers=headers, media_type="text/event-stream")
        return Response(hit.answer.body, status_code=200, headers=headers, media_type="application/json")

    # ---- accounting ------------------------------------------------------------------------
    async def _settle(self, reservation: Reservation, used: int | None) -> None:
        """Finish a reservation; a limiter outage here must not fail an answered request (the
        slot frees itself when its lease ends)."""
        try:
            await self.limiter.finish(reservation, used)
        except GatewayError as e:
            logger.warning("could not settle reservation %s: %s", reservation.id, e.message)

    def _count_usage(self, log: dict[str, Any], alias: str, usage: dict[str, Any]) -> int | None:
        """The tokens an answer used, from its `usage`; a backend's field that is not a count
        (a bool, a negative number, a string) is left out, and the whole is unknown (None:
        the reservation stands) when no count is left: an answered request is never failed
        over the backend's bookkeeping."""

        def count(key: str) -> int | None:
            value = usage.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        prompt, completion, total = count("prompt_tokens"), count("completion_tokens"), count("total_tokens")
        if total is None and (prompt is not None or completion is not None):
            total = (prompt or 0) + (completion or 0)
        tenant = log.get("tenant", "")
        if prompt is not None:
            self.metrics.tokens.labels(tenant, alias, "prompt").inc(prompt)
            log["prompt_tokens"] = prompt
        if completion is not None:
            self.metrics.tokens.labels(tenant, alias, "completion").inc(completion)
            log["completion_tokens"] = completion
        return total

    def _count_unanswered(self, backend_id: str, *, pushed_back: bool) -> None:
        """One try a backend did not answer the client (moved to another backend or queued
        again). Every push-back is counted twice, in `paved_gateway_pushback_total` and in
        either this (`reason="overloaded"`) or `paved_gateway_requests_total{status="503"}`
        (passed on): rollout analysis subtracts it from the errors (control_plane.metrics_source)."""
        self.metrics.retries.labels(backend_id, "overloaded" if pushed_back else "error").inc()
        if pushed_back:
            self.metrics.pushback.labels(backend_id).inc()

    def _count(self, log: dict[str, Any], status: int) -> None:
        self.metrics.requests.labels(
            log.get("tenant", ""), log.get("model", ""), log.get("backend", ""), str(status)
        ).inc()

    def _finish_log(self, log: dict[str, Any], started: float) -> None:
        total = time.perf_counter() - started
        if "tenant" in log and "model" in log:
            self.metrics.latency.labels(log["tenant"], log["model"]).observe(total)
        if access_log.isEnabledFor(logging.INFO):
            log["total_ms"] = round(total * 1000, 3)
            access_log.info(json.dumps(log, separators=(",", ":")))


class _NoRoom(Exception):
    """Every backend tried in a round had no room (503 or a connect timeout), or, `held`, every
    candidate's gauges read full before any was tried."""

    def __init__(self, *, held: bool = False):
        super().__init__()
        self.held = held


_T = TypeVar("_T")


@dataclass
class _Call:
    """One client request once it is authenticated and its body parsed: what every later stage
    (limits, cache, attempts, streaming) reads. `model` may be re-pinned by the orchestration
    plan; `body` is what is sent upstream (its `model` rewritten per backend)."""

    request: Request
    principal: Principal
    endpoint: str
    path: str
    model: str
    alias: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    request_id: str
    traceparent: str
    started: float
    log: dict[str, Any]
    priority: Priority = Priority.INTERACTIVE
    plan: Plan | None = None


async def _replay(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


class _GuardedStream(StreamingResponse):
    """A stream whose cleanup runs exactly once however the response ends, including when the
    client left before its first event (Starlette then never starts the body iterator)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Receive, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


def _discard(_: object) -> None:
    """A body read in the instant its client left: nothing holds a resource."""


def is_pushback(status: int, body: bytes) -> bool:
    """Whether an upstream answer is push-back rather than a failure: a 503 whose OpenAI error
    code is `overloaded`, as paved's frontend (a full engine queue), its launcher gate and its
    body limit answer (with Retry-After). Any other 5xx, including a 503 `unavailable` (an
    engine down, or the simulated engine's fail_after), is the backend failing."""
    if status != 503 or not body or len(body) > _MAX_REFUSAL_BYTES:
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and error.get("code") == PUSHBACK_CODE


async def _refusal_body(upstream: aiohttp.ClientResponse) -> bytes:
    """The body of an answer the gateway will not pass on (to classify it), or b"" when it is
    larger than an error body or does not arrive within `_REFUSAL_READ_S`."""
    try:
        async with asyncio.timeout(_REFUSAL_READ_S):
            body = await read_at_most(upstream.content, _MAX_REFUSAL_BYTES + 1)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return b""
    return body if len(body) <= _MAX_REFUSAL_BYTES else b""


async def _read_whole(upstream: aiohttp.ClientResponse, timeout_s: float) -> bytes:
    async with asyncio.timeout(timeout_s):
        return await upstream.read()


async def _sse_events(upstream: aiohttp.ClientResponse, idle_s: float) -> AsyncIterator[bytes]:
    """Complete SSE events (without their blank-line terminator) as soon as each arrives.

    Ends normally only at the upstream's EOF; a silence longer than `idle_s` raises TimeoutError.
    """
    buffer = b""
    while True:
        async with asyncio.timeout(idle_s):
            chunk = await upstream.content.readany()
        if not chunk:
            return
        buffer += chunk
        if b"\r\n" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            if event:
                yield event


def _event_json(event: bytes) -> dict[str, Any] | None:
    if not event.startswith(b"data:"):
        return None
    try:
        value = json.loads(event[5:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_event(message: str) -> bytes:
    body = error_body(502, message, code="upstream_error")
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _usage_of(data: bytes) -> dict[str, Any] | None:
    if b'"usage"' not in data:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    usage = value.get("usage") if isinstance(value, dict) else None
    return usage if isinstance(usage, dict) else None


def _response_headers(
    upstream: aiohttp.ClientResponse, reservation: Reservation, request_id: str, backend_id: str
) -> dict[str, str]:
    # The upstream's x-request-id echo (aiohttp spells it X-Request-ID) gives way to ours below.
    headers = {
        k: v
        for k, v in upstream.headers.items()
        if k.lower() not in _HOP_HEADERS and k.lower() != "x-request-id"
    }
    headers.update(reservation.headers)
    headers["x-request-id"] = request_id
    headers["x-paved-backend"] = backend_id
    return headers


async def decode_body(raw: bytes) -> dict[str, Any]:
    """`raw`, an OpenAI request body, as a JSON object (else GatewayError 400), decoded off the
    event loop when large (paved.http.off_loop): a body near the 32 MiB bound takes the better
    part of a second to parse."""
    if not raw:
        raise GatewayError(400, "the request body is missing")
    return await off_loop_if_large(len(raw), _parse_body, raw)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        # A lone surrogate ("\ud800") is refused here: no engine can encode it.
        body = parse_json(raw, unicode_text=True)
    except JSONBodyError as e:
        raise GatewayError(400, f"the request body is {e}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    return body


def _check_model(principal: Principal, router: Router, body: dict[str, Any]) -> tuple[str, str, Any]:
    """(model, alias, route) of a body whose model exists, is allowed to `principal` (else the
    404 an unknown model gets) and speaks OpenAI."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "you must provide a model parameter", param="model", code="missing_model")
    alias, _ = router.split_model(model)
    if not principal.allows(alias):
        raise ModelNotAllowedError(model)
    route = router.route(model)
    if route.kind == "kserve":
        # Its replicas speak KServe v2 only: forwarding would come back as their bare 404.
        raise GatewayError(
            400,
            f"model '{alias}' is a KServe v2 model and is not served over the OpenAI API; call it "
            f"over KServe v2 (gRPC ModelInfer, or POST /v2/models/{alias}/infer)",
            param="model",
            code="model_not_supported",
        )
    return model, alias, route


def check_openai_body(
    principal: Principal, router: Router, endpoint: str, body: dict[str, Any], default_max_tokens: int
) -> None:
    """The checks `forward` makes on a request body before admission (model known, allowed
    and OpenAI-speaking; max_tokens, n), for callers that validate requests ahead of sending
    them (the batch file upload): GatewayError(400/404) with `param` set as forward's."""
    _check_model(principal, router, body)
    _completion_budget(endpoint, body, default_max_tokens)


def _completion_budget(endpoint: str, body: dict[str, Any], default: int) -> int:
    """Tokens the answer may generate: max_tokens (or max_completion_tokens) times n."""
    if endpoint in ("embeddings", "rank"):
        return 0
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(field)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GatewayError(400, f"{field} must be a non-negative integer", param=field)
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise GatewayError(400, "n must be an integer between 1 and 128", param="n")
    best_of = body.get("best_of")
    if isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > n:
        n = best_of
    return value * n


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1000, 3)
