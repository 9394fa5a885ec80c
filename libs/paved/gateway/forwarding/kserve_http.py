"""KServe v2 HTTP/REST forwarded by model name: the raw body goes to `backend.kserve_http` and
the upstream's status, headers and body come back untouched (hop-by-hop headers aside).

Routes (`kserve_http_routes`, mounted by the gateway app):
  GET  /v2/health/live, /v2/health/ready   the gateway's own (ready: some usable backend has
                                           a kserve_http address; not ready is 400, as Triton)
  GET  /v2                                 the gateway's server metadata
  POST /v2/repository/index                the models the caller's tenant may use
  /v2/models/{name}[/versions/{version}]   GET (metadata), GET /ready, GET /config,
                                           POST /infer, /generate, /generate_stream (SSE)

Invariants:
  * auth (`Authorization: Bearer`), the tenant's model check, the route and the limits are
    settled before any upstream request; a model the caller may not use answers exactly like
    an unknown one;
  * the gateway's own errors are KServe's `{"error": "..."}` body (what tritonclient reads),
    with the GatewayError's status and headers (Retry-After on 429 / 503); /ready answers 400
    for a model that is unknown, not allowed or has no backend, as Triton does;
  * the version in the path pins the gateway version (`alias@version`); upstream is asked for
    `backend.upstream_model` without a version (a backend serves one);
  * tokens: `max_tokens` of the request (the `sampling_parameters` input or the request
    parameters) is reserved, else 0; finish with it on a < 400 answer, None otherwise;
  * every upstream request has a timeout (`deadline_s`, streams `stream_deadline_s`); a
    connect failure is retried once on another backend (the body was never sent);
  * `generate_stream` is relayed chunk by chunk, unbuffered; a client disconnect closes the
    upstream connection (which aborts the request there);
  * ids as on the gRPC side (paved.http.tracing): the validated `x-request-id` and the
    continued `traceparent` go upstream (never the client's raw values), every response carries
    `x-request-id`, and each call writes one JSON line on `paved.gateway.access` (protocol
    "kserve-http", `status` the HTTP status; a stream's line once the stream has ended);
  * a model scaled to zero (with `held`, the proxy's paved.gateway.forwarding.held): /infer,
    /generate and /generate_stream are held in the model's queue (after auth, model check and
    limits, with the tenant's fairness and the `x-paved-priority` class) until its first
    replica is routed, at most `wake_max_wait_s`; a client that disconnects leaves the queue
    (499); a full queue or an expired wait is 503 + Retry-After with the KServe error body.
    Metadata and /config (only a replica knows them) are 503 "scaled to zero and waking" +
    Retry-After and start the wake; /ready is 400 (not ready) and wakes nothing. A version in
    the path is known at zero when the table lists it for the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import paved
from paved.gateway.access.auth import Authenticator
from paved.gateway.access.limits import Limiter, Reservation
from paved.gateway.errors import GatewayError, ModelNotAllowedError
from paved.gateway.flow.flow import PRIORITY_HEADER, Priority
from paved.gateway.forwarding.held import ClientGone, HeldRequests, release_slot, unless_gone
from paved.gateway.forwarding.kserve_grpc import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EXTENSIONS,
    SERVER_NAME,
    CallLog,
    any_kserve_ready,
    kserve_models,
    require_protocol,
    sampling_max_tokens,
    write_access,
)
from paved.gateway.routing.router import Router
from paved.http.kserve_names import HTTP_MODEL_METHODS
from paved.http.tracing import REQUEST_ID_HEADER, TRACEPARENT_HEADER, trace_context

logger = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded upstream: the caller's key, and what aiohttp sets itself.
# The ids are replaced by this hop's own (validated, continued) values.
_DROP_REQUEST = _HOP_BY_HOP | {
    "authorization",
    "host",
    "content-length",
    REQUEST_ID_HEADER,
    TRACEPARENT_HEADER,
}
_HEADER_LENGTH = "inference-header-content-length"
_MAX_PICKS = 8
_CONNECT_RETRIES = 1
# JSON bodies above this are parsed for max_tokens in a thread (not on the event loop).
_INLINE_PARSE_BYTES = 256 * 1024


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _gateway_error(e: GatewayError) -> JSONResponse:
    return _error(e.status, e.message, e.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise GatewayError(413, f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise GatewayError(499, "the client closed the request") from e
    return b"".join(chunks)


def _first(value: Any) -> Any:
    while isinstance(value, list) and value:
        value = value[0]
    return value


def body_max_tokens(kind: str, body: bytes, header_length: str | None) -> int:
    """`max_tokens` an /infer or /generate(_stream) body asks for (0 when none or unreadable:
    the backend then validates the body and answers the client)."""
    try:
        if kind != "infer":
            doc = json.loads(body)
            if not isinstance(doc, dict):
                return 0
            if "sampling_parameters" in doc:
                return sampling_max_tokens(_first(doc["sampling_parameters"]))
            params = doc.get("parameters")
            return sampling_max_tokens(params.get("max_tokens")) if isinstance(params, dict) else 0
        header_size = int(header_length) if header_length is not None else len(body)
        if not 0 <= header_size <= len(body):
            return 0
        doc = json.loads(body[:header_size])
        if not isinstance(doc, dict):
            return 0
        offset = header_size
        for tensor in doc.get("inputs") or ():
            if not isinstance(tensor, dict):
                return 0
            raw_params = tensor.get("parameters")
            params = raw_params if isinstance(raw_params, dict) else {}
            size = params.get("binary_data_size")
            if tensor.get("name") == "sampling_parameters":
                if "data" in tensor:
                    return sampling_max_tokens(_first(tensor["data"]))
                if isinstance(size, int) and size >= 4:
                    # A binary BYTES element: 4-byte little-endian length, then the bytes.
                    length = int.from_bytes(body[offset : offset + 4], "little")
                    return sampling_max_tokens(body[offset + 4 : offset + 4 + min(length, size - 4)])
                return 0
            if isinstance(size, int) and size > 0:
                offset += size
        params = doc.get("parameters")
        return sampling_max_tokens(params.get("max_tokens")) if isinstance(params, dict) else 0
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError, TypeError):
        return 0


class _Relay(StreamingResponse):
    """The upstream's streamed body, chunk by chunk; `cleanup` runs however the response ends
    (done, upstream error, or client disconnect, on which Starlette cancels the send)."""

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        cleanup: Callable[[bool], Awaitable[None]],
    ):
        super().__init__(self._chunks(upstream), status_code=upstream.status, headers=headers)
        self._upstream = upstream
        self._cleanup = cleanup
        self._complete = False

    async def _chunks(self, upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        async for chunk in upstream.content.iter_any():
            yield chunk
        self._complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (TimeoutError, aiohttp.ClientError):
            # Headers are sent: the connection ends short, which the client sees as an error.
            logger.warning("KServe stream from upstream ended with an error")
        finally:
            # Closing (not releasing) an unfinished response drops the connection, and the
            # upstream server aborts the request.
            self._upstream.close()
            await self._cleanup(self._complete)


def _stream_cleanup(
    router: Router, limiter: Limiter, reservation: Reservation, backend_id: str, ok: bool, used: int | None
) -> Callable[[bool], Awaitable[None]]:
    """What ends a relayed stream: the router's request and the reservation (tokens counted
    only when the stream completed)."""

    async def cleanup(complete: bool) -> None:
        router.end(backend_id, ok=ok)
        await limiter.finish(reservation, used if complete else None)

    return cleanup


def _logged(
    method: str, endpoint: Callable[[Request, CallLog], Awaitable[Response]]
) -> Callable[[Request], Any]:
    """`endpoint` with the call's ids assigned, x-request-id on the response and the access line
    written (a relayed stream's once it has ended, however it ends)."""

    async def logged(request: Request) -> Response:
        started = time.perf_counter()
        call = CallLog(trace_context(request.headers))
        try:
            response = await endpoint(request, call)
        except BaseException:
            # Starlette answers 500 for what escapes a route.
            write_access(method, call, 500, started, "kserve-http")
            raise
        response.headers[REQUEST_ID_HEADER] = call.trace.request_id
        if isinstance(response, _Relay):
            cleanup = response._cleanup

            async def cleanup_and_log(complete: bool) -> None:
                try:
                    await cleanup(complete)
                finally:
                    write_access(method, call, response.status_code, started, "kserve-http")

            response._cleanup = cleanup_and_log
        else:
            write_access(method, call, response.status_code, started, "kserve-http")
        return response

    return logged


def _response_headers(upstream: aiohttp.ClientResponse, session: aiohttp.ClientSession) -> dict[str, str]:
    drop = set(_HOP_BY_HOP) | {"content-length"}
    if session.auto_decompress:
        drop.add("content-encoding")  # the body arrives decoded
    return {k: v for k, v in upstream.headers.items() if k.lower() not in drop}


def kserve_http_routes(
    router: Router,
    authenticator: Authenticator,
    limiter: Limiter,
    session_factory: Callable[[], aiohttp.ClientSession],
    *,
    deadline_s: float = 60.0,
    stream_deadline_s: float = 600.0,
    connect_timeout_s: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    held: HeldRequests | None = None,
) -> list[Route]:
    """The KServe v2 HTTP routes; `session_factory()` returns the app's shared session; `held`
    (the proxy's) holds requests for models at zero (None: they are answered 503 at once)."""
    if min(deadline_s, stream_deadline_s, connect_timeout_s) <= 0:
        raise ValueError("deadline_s, stream_deadline_s and connect_timeout_s must be > 0")
    if max_body_bytes < 1024:
        raise ValueError("max_body_bytes must be >= 1024")

    async def live(request: Request, call: CallLog) -> Response:
        return Response(status_code=200)

    async def ready(request: Request, call: CallLog) -> Response:
        if any_kserve_ready(router, "kserve_http"):
            return Response(status_code=200)
        return _error(400, "the gateway has no ready KServe HTTP backend")

    async def server_metadata(request: Request, call: CallLog) -> Response:
        return JSONResponse(
            {"name": SERVER_NAME, "version": paved.__version__, "extensions": list(EXTENSIONS)}
        )

    async def repository_index(request: Request, call: CallLog) -> Response:
        try:
            principal = await authenticator.authenticate(request.headers.get("authorization"))
            call.principal(principal)
            body = await _read_body(request, 64 * 1024)
            try:
                doc = json.loads(body) if body.strip() else {}
            except (ValueError, UnicodeDecodeError) as e:
                raise GatewayError(400, f"the request body is not valid JSON: {e}") from e
            if not isinstance(doc, dict) or set(doc) - {"ready"}:
                raise GatewayError(400, "the repository index request takes only 'ready'")
        except GatewayError as e:
            return _gateway_error(e)
        only_ready = bool(doc.get("ready", False))
        return JSONResponse(
            [
                {"name": alias, "state": "READY" if ok else "UNAVAILABLE"}
                | ({} if ok else {"reason": reason})
                for alias, ok, reason in kserve_models(router, principal, "kserve_http")
                if ok or not only_ready
            ]
        )

    def model_endpoint(suffix: str, method: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request, call: CallLog) -> Response:
            try:
                return await forward(request, suffix, method, call)
            except GatewayError as e:
                if suffix == "/ready" and e.status in (404, 503):
                    return _error(400, e.message)
                return _gateway_error(e)

        return _logged(HTTP_MODEL_METHODS[suffix], endpoint)

    async def forward(request: Request, suffix: str, method: str, call: CallLog) -> Response:
        name = request.path_params["name"]
        version = request.path_params.get("version", "")
        call.fields["model"] = name
        principal = await authenticator.authenticate(request.headers.get("authorization"))
        call.principal(principal)
        if not principal.allows(name):
            raise ModelNotAllowedError(name)
        model = f"{name}@{version}" if version else name
        route = router.route(model)
        at_zero = held is not None and route.scaled_to_zero
        if held is not None and at_zero and suffix not in ("/infer", "/generate", "/generate_stream"):
            if suffix == "/ready":
                raise GatewayError(
                    400, f"the model '{name}' is scaled to zero (not ready; a request wakes it)"
                )
            raise held.waking_error(name)
        require_protocol(route, name, "kserve_http")
        body = await _read_body(request, max_body_bytes) if method == "POST" else b""
        tokens = 0
        priority = Priority.INTERACTIVE
        if suffix in ("/infer", "/generate", "/generate_stream"):
            priority = Priority.parse(request.headers.get(PRIORITY_HEADER))
            header_length = request.headers.get(_HEADER_LENGTH)
            # The JSON part decides (all of the body without the binary extension's header):
            # a large one is parsed off the event loop, whether or not binary data follows it.
            json_size = len(body)
            if header_length is not None and header_length.isascii() and header_length.isdigit():
                json_size = min(len(body), int(header_length))
            if json_size > _INLINE_PARSE_BYTES:
                tokens = await asyncio.to_thread(body_max_tokens, suffix[1:], body, header_length)
            else:
                tokens = body_max_tokens(suffix[1:], body, header_length)
        stream = suffix == "/generate_stream"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers[REQUEST_ID_HEADER] = call.trace.request_id
        headers[TRACEPARENT_HEADER] = call.trace.traceparent
        timeout = aiohttp.ClientTimeout(
            total=stream_deadline_s if stream else deadline_s, connect=connect_timeout_s
        )
        session = session_factory()
        reservation = await limiter.acquire(principal, tokens)
        settled = False
        try:
            if held is not None and at_zero:
                try:
                    await held.until_woken(
                        name,
                        principal.tenant.name,
                        priority,
                        guard=lambda waiting: unless_gone(request.receive, waiting, release_slot),
                    )
                except ClientGone:
                    raise GatewayError(499, "the client closed the request") from None
            exclude: list[str] = []
            for _ in range(_CONNECT_RETRIES + 1):
                pick = None
                for _ in range(_MAX_PICKS):
                    candidate = router.pick(model, sticky_key=principal.key_id, exclude=tuple(exclude))
                    if candidate.backend.kserve_http:
                        pick = candidate
                        break
                    exclude.append(candidate.backend.id)
                if pick is None:
                    raise GatewayError(
                        503, f"no backend of model '{model}' serves KServe HTTP", headers={"Retry-After": "2"}
                    )
                backend = pick.backend
                call.fields["backend"] = backend.id
                url = f"{backend.kserve_http}/v2/models/{backend.upstream_model or name}{suffix}"
                if request.url.query:
                    url += "?" + request.url.query
                router.begin(backend.id)
                ended = False
                try:
                    upstream = await session.request(method, url, data=body, headers=headers, timeout=timeout)
                except aiohttp.ClientConnectorError:
                    router.end(backend.id, ok=False)
                    ended = True
                    exclude.append(backend.id)
                    logger.warning("KServe HTTP backend %s: connect failed, retrying elsewhere", backend.id)
                    continue
                except TimeoutError as e:
                    router.end(backend.id, ok=False)
                    ended = True
                    raise GatewayError(504, f"model '{name}': the backend did not answer in time") from e
                except aiohttp.ClientError as e:
                    router.end(backend.id, ok=False)
                    ended = True
                    raise GatewayError(502, f"model '{name}': the backend failed ({type(e).__name__})") from e
                try:
                    ok = upstream.status < 500
                    used = tokens if upstream.status < 400 else None
                    out_headers = _response_headers(upstream, session)
                    if stream and upstream.status == 200:
                        cleanup = _stream_cleanup(router, limiter, reservation, backend.id, ok, used)
                        settled = ended = True
                        return _Relay(upstream, out_headers, cleanup)
                    try:
                        content = await upstream.read()
                    except TimeoutError as e:
                        ok = False
                        raise GatewayError(504, f"model '{name}': the backend did not answer in time") from e
                    except aiohttp.ClientError as e:
                        ok = False
                        raise GatewayError(
                            502, f"model '{name}': the backend failed ({type(e).__name__})"
                        ) from e
                    finally:
                        upstream.release()
                    settled = True
                    await limiter.finish(reservation, used)
                    return Response(content, status_code=upstream.status, headers=out_headers)
                finally:
                    if not ended:
                        router.end(backend.id, ok=ok)
            raise GatewayError(
                503, f"no backend for model '{name}' accepted a connection", headers={"Retry-After": "2"}
            )
        finally:
            if not settled:
                await limiter.finish(reservation, None)

    routes = [
        Route("/v2/health/live", _logged("ServerLive", live), methods=["GET"]),
        Route("/v2/health/ready", _logged("ServerReady", ready), methods=["GET"]),
        Route("/v2", _logged("ServerMetadata", server_metadata), methods=["GET"]),
        Route("/v2/repository/index", _logged("RepositoryIndex", repository_index), methods=["POST"]),
    ]
    endpoints = (
        ("/ready", "GET"),
        ("/config", "GET"),
        ("/infer", "POST"),
        ("/generate", "POST"),
        ("/generate_stream", "POST"),
        ("", "GET"),
    )
    # Versioned paths first: an alias may contain '/', so "{name:path}" would also match them.
    for prefix in ("/v2/models/{name:path}/versions/{version}", "/v2/models/{name:path}"):
        for suffix, method in endpoints:
            routes.append(Route(prefix + suffix, model_endpoint(suffix, method), methods=[method]))
    return routes
