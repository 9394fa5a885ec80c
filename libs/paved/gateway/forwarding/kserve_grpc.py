"""KServe v2 gRPC (`inference.GRPCInferenceService`) forwarded by model name, as raw bytes.

The gateway never decodes or re-encodes tensors: a generic handler with identity
(de)serializers receives each message as bytes, a protobuf field scan reads the routing fields
(`model_name` / `name` = field 1, `model_version` / `version` = field 2 in every model request),
and the ORIGINAL bytes go upstream. Only when the backend names the model differently
(`Backend.upstream_model`) or the request pins a gateway version is a short override suffix
appended (field 1 = the upstream name, field 2 = ""): protobuf merges concatenated messages,
last value wins, so the tensors' bytes are still sent untouched.

Invariants:
  * auth, limits and the model check happen before any upstream byte is sent; a model the
    caller may not use is NOT_FOUND worded exactly like an unknown one;
  * every upstream call has a deadline: min(the client's remaining time, `deadline_s`);
  * `router.begin` / `router.end` and `limiter.acquire` / `limiter.finish` are always paired
    (finally); a KServe call reserves `max_tokens` tokens (request parameter or the
    `sampling_parameters` tensor's JSON) or 0, and finishes with the reserved count on success
    (KServe responses report no usage) or None on error;
  * a connect failure (the channel does not become ready) happens before any request byte is
    written, so the call is retried once on another backend; any other upstream error passes
    through with its code and details;
  * the `authorization` metadata is never forwarded, tensors and keys are never logged;
  * each call's ids follow paved.http.tracing: the validated `x-request-id` (else a new one)
    and the client's trace continued with the gateway's span go upstream, never the client's
    raw values; the client gets `x-request-id` back in the trailing metadata of a unary call
    (sent with the answer: no write of its own), in the initial metadata of a stream;
  * one JSON line per call on `paved.gateway.access` (the OpenAI side's logger and key
    names; `status` is the gRPC code name; a stream's line is written when the stream ends);
    the gateway's own probes (ServerLive, ServerReady, ServerMetadata) log at DEBUG;
  * a model scaled to zero (with `held`, the proxy's paved.gateway.forwarding.held): a
    ModelInfer, or a ModelStreamInfer's first message, is held in the model's queue (after
    auth, model check and limits, with the tenant's fairness and the `x-paved-priority`
    class) until its first replica is routed, its wait bounded by the client's deadline and
    `wake_max_wait_s` and ended by the client's cancel; a full queue or an expired wait is
    UNAVAILABLE with a `retry-after` trailer. ModelMetadata / ModelConfig / ModelStatistics
    (only a replica knows them) are UNAVAILABLE "scaled to zero and waking" + `retry-after`
    and start the wake; ModelReady is false and wakes nothing (a readiness poll must not keep
    an idle model up); RepositoryIndex lists it UNAVAILABLE. A pin (`model_version`) is known
    at zero when the table lists that version for it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

import paved
from paved.gateway.access.auth import Authenticator
from paved.gateway.access.limits import Limiter
from paved.gateway.errors import GatewayError, ModelNotAllowedError, grpc_code_name
from paved.gateway.flow.flow import PRIORITY_HEADER, Priority
from paved.gateway.forwarding.held import HeldRequests
from paved.gateway.routing.router import Pick, Router
from paved.gateway.routing.routes import ModelRoute
from paved.gateway.types import Principal
from paved.http.kserve_names import grpc_status_name
from paved.http.tracing import (
    REQUEST_ID_HEADER,
    TRACEPARENT_HEADER,
    TraceContext,
    access_json,
    metadata_context,
)

logger = logging.getLogger(__name__)
access_log = logging.getLogger("paved.gateway.access")

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME = "paved-gateway"
EXTENSIONS = ("binary_tensor_data", "parameters", "model_configuration", "generate")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_STREAM_MAX_IN_FLIGHT = 1024
# Routing passes: a backend without a KServe address is excluded and the pick repeated.
_MAX_PICKS = 8
# Retries after a connect failure (the request never left the gateway).
_CONNECT_RETRIES = 1
_ERROR_CODE_PARAMETER = "paved_error_code"
_FINAL_PARAMETER = "triton_final_response"
# Metadata gRPC owns or that must not cross the gateway.
_DROP_METADATA = frozenset(
    {
        "authorization",
        "user-agent",
        "content-type",
        "te",
        "host",
        "grpc-timeout",
        # Replaced by the hop's own (validated, continued) values.
        REQUEST_ID_HEADER,
        TRACEPARENT_HEADER,
    }
)
_PROBES = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})

_FIELD = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name
_F_NAME = _FIELD["model_name"].number
_F_VERSION = _FIELD["model_version"].number
_F_STREAM_ERROR = service_pb2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["error_message"].number
_F_STREAM_RESPONSE = service_pb2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number
_F_RESPONSE_PARAMETERS = service_pb2.ModelInferResponse.DESCRIPTOR.fields_by_name["parameters"].number
# Every model request (metadata, ready, config, statistics) has name = 1 and version = 2 too.
for _message in (
    service_pb2.ModelMetadataRequest,
    service_pb2.ModelReadyRequest,
    service_pb2.ModelConfigRequest,
    service_pb2.ModelStatisticsRequest,
):
    _fields = _message.DESCRIPTOR.fields_by_name
    if (_fields["name"].number, _fields["version"].number) != (_F_NAME, _F_VERSION):
        raise ImportError(f"{_message.__name__}: name/version are not fields 1/2; the scan needs updating")
# Responses one ModelStreamInfer relay holds for its client at most.
RELAY_QUEUE = 64
# What read_head parses any of them as.
_HEAD_MESSAGE = service_pb2.ModelMetadataRequest


# ---- protobuf wire scan (no decode of the tensors) ------------------------------------------
def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def scan_fields(data: bytes | memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each top-level field: an int for varints, a
    memoryview (no copy) for length-delimited fields, None for fixed-width ones. Raises
    ValueError on malformed input; every step advances, so the loop ends."""
    buf = memoryview(data)
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        value: Any = None
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = _varint(buf, i)
            if i + length > n:
                raise ValueError("length-delimited field past the end of the message")
            value = buf[i : i + length]
            i += length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if i > n:
            raise ValueError("field past the end of the message")
        yield number, wire, value


def _text(value: Any) -> str:
    return bytes(value).decode("utf-8")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _string_field(number: int, value: str) -> bytes:
    raw = value.encode("utf-8")
    return _encode_varint(number << 3 | 2) + _encode_varint(len(raw)) + raw


@dataclass
class RequestHead:
    """What the gateway reads from a model request: its routing fields and, for an infer
    request, the tokens to reserve (0 when it carries no `max_tokens`)."""

    name: str = ""
    version: str = ""
    id: str = ""
    max_tokens: int = 0


def sampling_max_tokens(value: Any) -> int:
    """`max_tokens` of a sampling-parameters object or its JSON text; 0 if absent or not a
    positive integer (the backend then validates it and answers the client)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return 0
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return 0
    if isinstance(value, dict):
        value = value.get("max_tokens")
    if isinstance(value, str):
        value = value.strip()
        value = int(value) if value.isdigit() else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return max(0, int(value)) if value == value and abs(value) < 2**62 else 0  # NaN, inf: 0


def _parameter_value(raw: memoryview) -> Any:
    return _choice(service_pb2.InferParameter.FromString(bytes(raw)))


def read_head(data: bytes, *, infer: bool) -> RequestHead:
    """The routing fields of a model request (and `max_tokens` for an infer request).
    Raises GatewayError 400 for a message that is not protobuf.

    Parsed by protobuf's C runtime (upb), as the instances parse it: a scan of every field in
    Python let one crafted message of millions of empty fields hold the event loop (every
    request, the OpenAI side included) for seconds per megabyte."""
    try:
        if not infer:
            # Every request type the gateway routes names its model in fields 1 and 2 (checked
            # at import); the rest of it is not read here.
            routed = _HEAD_MESSAGE.FromString(data)
            return RequestHead(name=routed.name, version=routed.version)
        request = service_pb2.ModelInferRequest.FromString(data)
    except Exception as e:  # DecodeError: truncated, bad UTF-8 in a string, wrong wire types
        raise GatewayError(400, f"the request is not a valid protobuf message: {e}") from e
    head = RequestHead(name=request.model_name, version=request.model_version, id=request.id)
    sampling_contents: bytes | memoryview | None = None
    for index, tensor in enumerate(request.inputs):
        if tensor.name != "sampling_parameters":
            continue
        if index < len(request.raw_input_contents):
            raw = memoryview(request.raw_input_contents[index])
            # A BYTES tensor's raw form: 4-byte little-endian length, then the element.
            if len(raw) >= 4:
                length = int.from_bytes(raw[:4], "little")
                sampling_contents = raw[4 : 4 + length]
        elif tensor.contents.bytes_contents:
            sampling_contents = tensor.contents.bytes_contents[0]
        break
    if sampling_contents is not None:
        head.max_tokens = sampling_max_tokens(sampling_contents)
    elif "max_tokens" in request.parameters:
        head.max_tokens = sampling_max_tokens(_choice(request.parameters["max_tokens"]))
    return head


def _choice(p: service_pb2.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _is_final(response: bytes) -> bool:
    """Whether a ModelStreamInferResponse ends its request: an in-band error, or
    `triton_final_response` true. Malformed responses count as final (they end nothing
    upstream, and counting them keeps the in-flight bound from leaking)."""
    try:
        for number, wire, value in scan_fields(response):
            if number == _F_STREAM_ERROR and wire == 2 and len(value):
                return True
            if number != _F_STREAM_RESPONSE or wire != 2:
                continue
            for n, w, v in scan_fields(value):
                if n != _F_RESPONSE_PARAMETERS or w != 2:
                    continue
                key, param = "", None
                for n2, w2, v2 in scan_fields(v):
                    if n2 == 1 and w2 == 2:
                        key = _text(v2)
                    elif n2 == 2 and w2 == 2:
                        param = v2
                if key == _FINAL_PARAMETER and param is not None:
                    return bool(_parameter_value(param))
    except Exception:  # noqa: BLE001 - see the docstring
        return True
    return False


def _stream_error(head: RequestHead, code: grpc.StatusCode, message: str) -> bytes:
    """An in-band ModelStreamInfer error (the stream stays open), as paved's server sends it."""
    response = service_pb2.ModelInferResponse(model_name=head.name, model_version=head.version, id=head.id)
    response.parameters[_FINAL_PARAMETER].bool_param = True
    response.parameters[_ERROR_CODE_PARAMETER].string_param = code.name
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=response
    ).SerializeToString()


def _code(error: GatewayError) -> grpc.StatusCode:
    return grpc.StatusCode[grpc_code_name(error.status)]


def _retry_after(error: GatewayError) -> str | None:
    for key, value in error.headers.items():
        if key.lower() == "retry-after":
            return value
    return None


class _ConnectFailed(Exception):
    pass


@dataclass
class CallLog:
    """One client call: its ids and what its access line says beyond them."""

    trace: TraceContext
    fields: dict[str, Any] = field(default_factory=dict)

    def principal(self, principal: Principal) -> None:
        self.fields["tenant"] = principal.tenant.name


def write_access(
    method: str, call: CallLog, status: str | int, started: float, protocol: str = "kserve-grpc"
) -> None:
    """The call's line on `paved.gateway.access` (probes at DEBUG); the HTTP side's too."""
    level = logging.DEBUG if method in _PROBES else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    line = {
        # The trace id joins this line to the instance's access line for the same call.
        "request_id": call.trace.request_id,
        "trace_id": call.trace.trace_id,
        "protocol": protocol,
        "method": method,
        **call.fields,
        "status": status,
        "total_ms": round((time.perf_counter() - started) * 1000, 3),
    }
    access_log.log(level, access_json(line))


_EOF = object()


@dataclass
class _Failure:
    error: BaseException


class _ChannelPool:
    """One grpc.aio channel per upstream address, least recently used first out (closed then).
    Bounded by `size`; `close()` closes them all."""

    def __init__(self, size: int, options: list[tuple[str, Any]]):
        self._size = size
        self._options = options
        self._channels: collections.OrderedDict[str, grpc.aio.Channel] = collections.OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        channel = grpc.aio.insecure_channel(address, options=self._options)
        self._channels[address] = channel
        while len(self._channels) > self._size:
            _, old = self._channels.popitem(last=False)
            self._close_later(old)
        return channel

    def retain(self, addresses: set[str]) -> None:
        """Close the channels of addresses no longer in the routing table."""
        for address in [a for a in self._channels if a not in addresses]:
            self._close_later(self._channels.pop(address))

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        # Calls already running on it get a grace period to finish.
        task = asyncio.ensure_future(channel.close(grace=5.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(c.close(grace=1.0) for c in channels), *self._closing, return_exceptions=True)


def _usable_ids(router: Router) -> set[str]:
    """Backend ids that are ready (or not yet checked), not ejected and routed."""
    return {
        i for i, st in router.snapshot().items() if st["ready"] and not st["ejected_until"] and st["routed"]
    }


_PROTOCOLS = {"kserve_grpc": "KServe gRPC", "kserve_http": "KServe HTTP"}


def require_protocol(route: ModelRoute, model: str, attribute: str) -> None:
    """GatewayError 400 `protocol_not_supported` when no backend of `route` (awake) has the
    KServe address `attribute` ("kserve_grpc" / "kserve_http"): no retry could help, and the
    pick would run out of candidates and call them all unhealthy (a 503 retried forever)."""
    if route.scaled_to_zero or any(getattr(b, attribute) for b in route.backends):
        return
    other = _PROTOCOLS["kserve_http" if attribute == "kserve_grpc" else "kserve_grpc"]
    raise GatewayError(
        400,
        f"model '{model}' is not served over {_PROTOCOLS[attribute]} by this gateway; use the API its "
        f"replicas serve (the OpenAI API, or {other})",
        code="protocol_not_supported",
    )


def kserve_models(router: Router, principal: Principal, attribute: str) -> list[tuple[str, bool, str]]:
    """(alias, ready, reason) of each routed model the caller may use; ready: some usable
    backend has the KServe address `attribute` ("kserve_grpc" / "kserve_http"); reason: why
    not ("" when ready)."""
    usable = _usable_ids(router)
    protocol = _PROTOCOLS[attribute]
    out = []
    for alias, route in router.table.models.items():
        if not principal.allows(alias):
            continue
        ready = any(getattr(b, attribute) and b.id in usable for b in route.backends)
        if ready:
            reason = ""
        elif route.scaled_to_zero:
            reason = "scaled to zero; a request wakes it"
        else:
            reason = f"no ready backend serves it over {protocol}"
        out.append((alias, ready, reason))
    return out


def any_kserve_ready(router: Router, attribute: str) -> bool:
    usable = _usable_ids(router)
    return any(
        getattr(b, attribute) and b.id in usable
        for route in router.table.models.values()
        for b in route.backends
    )


class KServeForwarder:
    """The gateway's `inference.GRPCInferenceService`: register `handler()` on a grpc.aio
    server, with the same max message sizes; `close()` on shutdown."""

    def __init__(
        self,
        router: Router,
        authenticator: Authenticator,
        limiter: Limiter,
        *,
        deadline_s: float = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        connect_timeout_s: float = 5.0,
        max_channels: int = 256,
        stream_max_in_flight: int = DEFAULT_STREAM_MAX_IN_FLIGHT,
        stream_deadline_s: float = 600.0,
        held: HeldRequests | None = None,
    ):
        if min(deadline_s, connect_timeout_s, stream_deadline_s) <= 0:
            raise ValueError("deadline_s, connect_timeout_s and stream_deadline_s must be > 0")
        if max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be >= 1024")
        if max_channels < 1 or stream_max_in_flight < 1:
            raise ValueError("max_channels and stream_max_in_flight must be >= 1")
        self.router = router
        self._revision: str | None = None
        self.authenticator = authenticator
        self.limiter = limiter
        self.deadline_s = deadline_s
        self.stream_deadline_s = stream_deadline_s
        self.connect_timeout_s = connect_timeout_s
        self.stream_max_in_flight = stream_max_in_flight
        # Requests for models at zero are held there (the proxy's, shared); None: answered
        # as any model without a backend (503 no_healthy_backend).
        self.held = held
        self._channels = _ChannelPool(
            max_channels,
            [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )

    # ---- registration ------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        unary = {
            "ServerLive": self._server_live,
            "ServerReady": self._server_ready,
            "ServerMetadata": self._server_metadata,
            "RepositoryIndex": self._repository_index,
            "ModelReady": self._model_ready,
            "ModelMetadata": self._forward_unary("ModelMetadata"),
            "ModelConfig": self._forward_unary("ModelConfig"),
            "ModelStatistics": self._forward_unary("ModelStatistics"),
            "ModelInfer": self._forward_unary("ModelInfer"),
        }
        handlers: dict[str, grpc.RpcMethodHandler] = {
            name: grpc.unary_unary_rpc_method_handler(self._logged_unary(name, fn))
            for name, fn in unary.items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self._logged_stream(self._stream_infer)
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    @staticmethod
    def _logged_unary(
        method: str, fn: Callable[[bytes, grpc.aio.ServicerContext, CallLog], Awaitable[bytes]]
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        """`fn` with the call's ids assigned, x-request-id sent back (in the trailing metadata)
        and the access line written."""

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            started = time.perf_counter()
            call = CallLog(metadata_context(context.invocation_metadata()))
            error: BaseException | None = None
            try:
                # In the trailers, sent with the answer (paved.kserve.grpc_server does the same:
                # headers sent first are a write and a client wake-up more per call).
                context.set_trailing_metadata(((REQUEST_ID_HEADER, call.trace.request_id),))
                return await fn(request, context, call)
            except BaseException as e:
                error = e
                raise
            finally:
                write_access(method, call, grpc_status_name(context, error), started)

        return unary

    @staticmethod
    def _logged_stream(
        fn: Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext, CallLog], AsyncIterator[bytes]],
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        """ModelStreamInfer as `_logged_unary` does it: one line when the stream ends."""

        async def stream(
            request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            started = time.perf_counter()
            call = CallLog(metadata_context(context.invocation_metadata()))
            error: BaseException | None = None
            try:
                await context.send_initial_metadata(((REQUEST_ID_HEADER, call.trace.request_id),))
                async for response in fn(request_iterator, context, call):
                    yield response
            except BaseException as e:
                error = e
                raise
            finally:
                write_access("ModelStreamInfer", call, grpc_status_name(context, error), started)

        return stream

    async def close(self) -> None:
        await self._channels.close()

    def _retain_channels(self) -> None:
        """On a routing-table change: close the channels of backends no longer routed."""
        revision = self.router.table.revision
        if revision == self._revision:
            return
        self._revision = revision
        self._channels.retain(
            {
                b.kserve_grpc
                for route in self.router.table.models.values()
                for b in route.backends
                if b.kserve_grpc
            }
        )

    # ---- gateway-answered methods -------------------------------------------------------------
    async def _server_live(self, request: bytes, context: grpc.aio.ServicerContext, call: CallLog) -> bytes:
        return service_pb2.ServerLiveResponse(live=True).SerializeToString()

    async def _server_ready(self, request: bytes, context: grpc.aio.ServicerContext, call: CallLog) -> bytes:
        ready = any_kserve_ready(self.router, "kserve_grpc")
        return service_pb2.ServerReadyResponse(ready=ready).SerializeToString()

    async def _server_metadata(
        self, request: bytes, context: grpc.aio.ServicerContext, call: CallLog
    ) -> bytes:
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=paved.__version__, extensions=EXTENSIONS
        ).SerializeToString()

    async def _repository_index(
        self, request: bytes, context: grpc.aio.ServicerContext, call: CallLog
    ) -> bytes:
        try:
            principal = await self._authenticate(context)
            call.principal(principal)
            try:
                message = service_pb2.RepositoryIndexRequest.FromString(request)
            except Exception as e:
                raise GatewayError(400, f"the request is not a valid RepositoryIndexRequest: {e}") from e
            if message.repository_name:
                raise GatewayError(400, "the gateway has one unnamed repository; leave repository_name empty")
        except GatewayError as e:
            await self._abort(context, e)
        response = service_pb2.RepositoryIndexResponse()
        for alias, ready, reason in kserve_models(self.router, principal, "kserve_grpc"):
            if message.ready and not ready:
                continue
            response.models.add(name=alias, state="READY" if ready else "UNAVAILABLE", reason=reason)
        return response.SerializeToString()

    async def _model_ready(self, request: bytes, context: grpc.aio.ServicerContext, call: CallLog) -> bytes:
        # Triton answers "not ready" for an unknown model; so does the gateway for unknown,
        # not allowed and unroutable models alike (no probing which models exist).
        try:
            return await self._unary("ModelReady", request, context, call)
        except GatewayError as e:
            if e.status in (404, 503):
                return service_pb2.ModelReadyResponse(ready=False).SerializeToString()
            await self._abort(context, e)
        raise AssertionError("unreachable")  # abort raises

    # ---- forwarding ---------------------------------------------------------------------------
    def _forward_unary(self, method: str):
        async def forward(request: bytes, context: grpc.aio.ServicerContext, call: CallLog) -> bytes:
            try:
                return await self._unary(method, request, context, call)
            except GatewayError as e:
                await self._abort(context, e)
            raise AssertionError("unreachable")  # abort raises

        return forward

    async def _unary(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext, call: CallLog
    ) -> bytes:
        """Authenticate, check, limit, then forward; GatewayError for the gateway's own refusals,
        an upstream error is passed to the client here (abort)."""
        principal = await self._authenticate(context)
        call.principal(principal)
        head = read_head(request, infer=method == "ModelInfer")
        call.fields["model"] = head.name
        if not head.name:
            if method == "ModelStatistics":
                raise GatewayError(
                    400, "the gateway forwards ModelStatistics per model: give the model's name"
                )
            raise GatewayError(400, "the request names no model")
        model = self._check_model(principal, head)
        at_zero = self.held is not None and self.held.at_zero(head.name)
        if self.held is not None and at_zero and method != "ModelInfer":
            if method == "ModelReady":
                raise GatewayError(503, f"the model '{head.name}' is scaled to zero")
            raise self.held.waking_error(head.name)
        priority = self._priority(context) if method == "ModelInfer" else Priority.INTERACTIVE
        path = f"/{SERVICE}/{method}"
        reservation = await self.limiter.acquire(principal, head.max_tokens)
        used: int | None = None
        try:
            if self.held is not None and at_zero:
                await self._hold(head.name, principal, priority, context)
            exclude: list[str] = []
            for _ in range(_CONNECT_RETRIES + 1):
                pick, channel = self._pick(model, principal, exclude)
                call.fields["backend"] = pick.backend.id
                ok = True
                self.router.begin(pick.backend.id)
                try:
                    await self._connect(channel, context)
                    upstream = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                    response = await upstream(
                        self._upstream_bytes(request, head, pick),
                        timeout=self._timeout(context),
                        metadata=self._metadata(context, call.trace),
                    )
                    used = head.max_tokens
                    return response
                except _ConnectFailed:
                    ok = False
                    exclude.append(pick.backend.id)
                    logger.warning("KServe backend %s: connect failed, retrying elsewhere", pick.backend.id)
                    continue
                except grpc.aio.AioRpcError as e:
                    ok = not _backend_fault(e.code())
                    await self._pass_through(context, e)
                finally:
                    self.router.end(pick.backend.id, ok=ok)
            raise GatewayError(
                503, f"no backend for model '{head.name}' accepted a connection", headers={"Retry-After": "2"}
            )
        finally:
            # Shielded: a second cancellation of the call must not cut the settling short (the
            # slot would stay taken until its lease ends).
            await asyncio.shield(self.limiter.finish(reservation, used))

    async def _stream_infer(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext, call: CallLog
    ) -> AsyncIterator[bytes]:
        try:
            principal = await self._authenticate(context)
            call.principal(principal)
        except GatewayError as e:
            await self._abort(context, e)
        first = await _next(request_iterator)
        if first is None:
            return  # the client half-closed without a request
        try:
            head = read_head(first, infer=True)
            call.fields["model"] = head.name
            if not head.name:
                raise GatewayError(400, "the request names no model")
            model = self._check_model(principal, head)
            priority = self._priority(context)
            reservation = await self.limiter.acquire(principal, head.max_tokens)
        except GatewayError as e:
            await self._abort(context, e)
        used: int | None = None
        try:
            if self.held is not None and self.held.at_zero(head.name):
                # The stream's first message waits for the model's first replica; the later
                # ones follow it on the stream opened then.
                await self._hold(head.name, principal, priority, context)
            exclude: list[str] = []
            for _ in range(_CONNECT_RETRIES + 1):
                pick, channel = self._pick(model, principal, exclude)
                call.fields["backend"] = pick.backend.id
                ok = True
                self.router.begin(pick.backend.id)
                try:
                    await self._connect(channel, context)
                except _ConnectFailed:
                    self.router.end(pick.backend.id, ok=False)
                    exclude.append(pick.backend.id)
                    continue
                try:
                    async for response in self._relay(
                        channel, principal, head, first, request_iterator, pick, context, call.trace
                    ):
                        yield response
                    used = head.max_tokens
                    return
                except grpc.aio.AioRpcError as e:
                    ok = not _backend_fault(e.code())
                    await self._pass_through(context, e)
                finally:
                    self.router.end(pick.backend.id, ok=ok)
            raise GatewayError(
                503, f"no backend for model '{head.name}' accepted a connection", headers={"Retry-After": "2"}
            )
        except GatewayError as e:
            await self._abort(context, e)
        finally:
            # Shielded: a second cancellation of the call must not cut the settling short (the
            # slot would stay taken until its lease ends).
            await asyncio.shield(self.limiter.finish(reservation, used))

    async def _relay(
        self,
        channel: grpc.aio.Channel,
        principal: Principal,
        head: RequestHead,
        first: bytes,
        request_iterator: AsyncIterator[bytes],
        pick: Pick,
        context: grpc.aio.ServicerContext,
        trace: TraceContext,
    ) -> AsyncIterator[bytes]:
        """One upstream ModelStreamInfer call carrying the client's messages. At most
        `stream_max_in_flight` requests are upstream without a final response (then the client
        is not read: gRPC flow control holds it back). A message for another model, or one the
        limits refuse, is answered in-band and not forwarded."""
        call = channel.stream_stream(
            f"/{SERVICE}/ModelStreamInfer", request_serializer=None, response_deserializer=None
        )
        upstream = call(
            timeout=self._timeout(context, self.stream_deadline_s), metadata=self._metadata(context, trace)
        )
        slots = asyncio.Semaphore(self.stream_max_in_flight)
        # Responses (and in-band refusals) waiting for the client: a slow client stops the
        # upstream reader, and gRPC flow control then holds the backend back. Few: responses
        # may be large (1024 of 512 KiB pinned half a GB per stream of a client not reading).
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=min(self.stream_max_in_flight, RELAY_QUEUE))

        async def write() -> None:
            try:
                message: bytes | None = first
                while message is not None:
                    if message is not first:
                        refusal = await self._admit_stream_message(principal, head, message, context)
                        if refusal is not None:
                            await queue.put(refusal)
                            message = await _next(request_iterator)
                            continue
                    await slots.acquire()
                    await upstream.write(self._upstream_bytes(message, head, pick))
                    message = await _next(request_iterator)
                await upstream.done_writing()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed upstream reports its own status
                if not upstream.done():
                    await queue.put(_Failure(e))

        async def read() -> None:
            try:
                async for response in upstream:
                    if _is_final(response):
                        slots.release()
                    await queue.put(response)
                await queue.put(_EOF)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised by the relay loop
                await queue.put(_Failure(e))

        tasks = [asyncio.create_task(write()), asyncio.create_task(read())]
        try:
            while True:
                item = await queue.get()
                if item is _EOF:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            for task in tasks:
                task.cancel()
            # The client cancelled, or the stream failed: the upstream call ends with it.
            upstream.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _admit_stream_message(
        self, principal: Principal, head: RequestHead, message: bytes, context: grpc.aio.ServicerContext
    ) -> bytes | None:
        """None to forward a later stream message; else the in-band error answering it. Each
        message is authorized again (through the authenticator's cache: a key revoked or
        expired, or a model taken off the tenant's list, stops an open stream too, not only the
        next one) and counts against the per-minute limits (acquired and finished at once: the
        stream itself holds the concurrency slot)."""
        try:
            this = read_head(message, infer=True)
        except GatewayError as e:
            return _stream_error(RequestHead(name=head.name), grpc.StatusCode.INVALID_ARGUMENT, e.message)
        try:
            principal = await self._authenticate(context)
            self._check_model(principal, this)
        except GatewayError as e:
            return _stream_error(this, _code(e), e.message)
        if (this.name, this.version) != (head.name, head.version):
            return _stream_error(
                this,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this stream serves model '{head.name}'"
                + (f" version '{head.version}'" if head.version else "")
                + f"; open another stream for '{this.name}'",
            )
        try:
            reservation = await self.limiter.acquire(principal, this.max_tokens)
        except GatewayError as e:
            return _stream_error(this, _code(e), e.message)
        await self.limiter.finish(reservation, this.max_tokens)
        return None

    # ---- helpers ------------------------------------------------------------------------------
    async def _authenticate(self, context: grpc.aio.ServicerContext) -> Any:
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key.lower() == "authorization":
                authorization = value if isinstance(value, str) else None
        return await self.authenticator.authenticate(authorization)

    @staticmethod
    def _priority(context: grpc.aio.ServicerContext) -> Priority:
        """The call's class (metadata `x-paved-priority`, absent: interactive); 400 otherwise."""
        value = None
        for key, item in context.invocation_metadata() or ():
            if key.lower() == PRIORITY_HEADER:
                value = item if isinstance(item, str) else ""
        return Priority.parse(value)

    async def _hold(
        self, alias: str, principal: Principal, priority: Priority, context: grpc.aio.ServicerContext
    ) -> None:
        """Hold a call for a model at zero until it is routed (a client's cancel or deadline
        cancels this task, which leaves the queue); QueueRefusedError (UNAVAILABLE +
        retry-after) when the queue is full or the wait expires."""
        if self.held is not None:
            await self.held.until_woken(
                alias, principal.tenant.name, priority, limit_s=context.time_remaining()
            )

    def _check_model(self, principal: Principal, head: RequestHead) -> str:
        """The router's model key (`alias` or `alias@version`) after the tenant check."""
        if not principal.allows(head.name):
            raise ModelNotAllowedError(head.name)
        model = f"{head.name}@{head.version}" if head.version else head.name
        self.router.route(model)  # 404 for an unknown model or version
        return model

    def _pick(self, model: str, principal: Principal, exclude: list[str]) -> tuple[Pick, grpc.aio.Channel]:
        """A backend with a KServe gRPC address (others are excluded and the pick repeated)."""
        self._retain_channels()
        require_protocol(self.router.route(model), model, "kserve_grpc")
        for _ in range(_MAX_PICKS):
            pick = self.router.pick(model, sticky_key=principal.key_id, exclude=tuple(exclude))
            if pick.backend.kserve_grpc:
                return pick, self._channels.get(pick.backend.kserve_grpc)
            exclude.append(pick.backend.id)
        raise GatewayError(
            503, f"no backend of model '{model}' serves KServe gRPC", headers={"Retry-After": "2"}
        )

    async def _connect(self, channel: grpc.aio.Channel, context: grpc.aio.ServicerContext) -> None:
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(
                channel.channel_ready(), min(self.connect_timeout_s, self._timeout(context))
            )
        except (TimeoutError, grpc.aio.UsageError) as e:
            raise _ConnectFailed() from e

    def _timeout(self, context: grpc.aio.ServicerContext, limit_s: float | None = None) -> float:
        """The upstream deadline: the client's remaining time, at most `limit_s` (deadline_s)."""
        limit = self.deadline_s if limit_s is None else limit_s
        remaining = context.time_remaining()
        return limit if remaining is None else max(0.0, min(remaining, limit))

    def _metadata(
        self, context: grpc.aio.ServicerContext, trace: TraceContext
    ) -> tuple[tuple[str, Any], ...]:
        """The client's metadata minus what must not cross, plus this hop's ids."""
        out = []
        for key, value in context.invocation_metadata() or ():
            key = key.lower()
            if key in _DROP_METADATA or key.startswith((":", "grpc-")):
                continue
            out.append((key, value))
        out.append((REQUEST_ID_HEADER, trace.request_id))
        out.append((TRACEPARENT_HEADER, trace.traceparent))
        return tuple(out)

    @staticmethod
    def _upstream_bytes(request: bytes, head: RequestHead, pick: Pick) -> bytes:
        upstream_name = getattr(pick.backend, "upstream_model", None) or head.name
        suffix = b""
        if upstream_name != head.name:
            suffix += _string_field(_F_NAME, upstream_name)
        if head.version:
            # The gateway's version chose the backend; the backend serves its own one version.
            suffix += _string_field(_F_VERSION, "")
        return request + suffix if suffix else request

    async def _abort(self, context: grpc.aio.ServicerContext, error: GatewayError) -> None:
        retry_after = _retry_after(error)
        if retry_after is not None:
            # Beside the x-request-id a unary call's trailers already hold.
            kept = context.trailing_metadata() or ()
            context.set_trailing_metadata((*kept, ("retry-after", retry_after)))
        await context.abort(_code(error), error.message)

    async def _pass_through(self, context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError) -> None:
        trailing = tuple(
            (k, v)
            for k, v in (error.trailing_metadata() or ())
            if not k.startswith((":", "grpc-")) and k != REQUEST_ID_HEADER
        )
        if trailing:
            context.set_trailing_metadata((*(context.trailing_metadata() or ()), *trailing))
        await context.abort(error.code(), error.details() or "")


def _backend_fault(code: grpc.StatusCode) -> bool:
    """Whether an upstream status says the backend (not the request) failed."""
    return code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
    )


async def _next(iterator: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None
