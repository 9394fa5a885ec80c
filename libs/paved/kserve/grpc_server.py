"""`inference.GRPCInferenceService` on grpc.aio, built on the stubs tritonclient ships.

Behaviour follows Triton's gRPC frontend where a client can tell the difference:
  * ModelInfer errors are gRPC status codes; ModelStreamInfer errors are in-band
    (`error_message`, the stream stays open), and every stream response carries the
    `triton_final_response` parameter; `triton_enable_empty_final_response` is honoured.
  * Requests on one stream run concurrently and their responses interleave (match them by id).
  * A cancelled call (client cancel, deadline, disconnect) cancels its requests, which closes
    their engine streams and so aborts them in the engine.
  * Messages over the size limit are refused by gRPC itself with RESOURCE_EXHAUSTED.
  * One stream runs at most `stream_max_in_flight` requests at once; one more is answered
    in-band with RESOURCE_EXHAUSTED naming the limit (the stream stays open). At most
    `stream_queue_size` responses wait for a slow client; the requests' engine streams then
    pause (backpressure) instead of piling responses up in memory.
In-band stream errors also carry a `paved_error_code` response parameter (the status code
name): Triton's stream protocol has no code there, and the remote engine needs one to tell a
client mistake (HTTP 400) from an outage (503).

Access log (both transports, `write_access`): one JSON line per call on `paved.kserve.access`
at INFO once the call has ended (a stream when it closes), opening with paved.http.tracing's
ids (the gateway's validated `x-request-id`, else a new one; its `traceparent` continued),
then protocol, method (the gRPC method name), model, status (gRPC code name, or HTTP status)
and duration_ms. Never tensors, parameters or any other metadata. Probes (ServerLive,
ServerReady, ServerMetadata, /health/*) log at DEBUG. Every call answers `x-request-id`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from prometheus_client import CollectorRegistry
from tritonclient.grpc import service_pb2, service_pb2_grpc

import paved
from paved.engine.streams import aclose
from paved.http.kserve_names import grpc_status_name
from paved.http.off_loop import off_loop_if_large
from paved.http.tracing import REQUEST_ID_HEADER, TraceContext, access_fields, access_json, metadata_context
from paved.kserve.errors import KServeError, invalid_argument, too_large, unsupported
from paved.kserve.metrics import GRPC, KServeMetrics, batch_rows
from paved.kserve.model import inputs_bytes
from paved.kserve.repository import (
    InferRequest,
    InferResponse,
    ModelRepository,
    ServedModel,
    custom_parameters,
)
from paved.kserve.tensors import from_contents, from_raw, to_raw
from paved.kserve.wire import ERROR_CODE_PARAMETER, RETRY_AFTER_PARAMETER

logger = logging.getLogger(__name__)
access_log = logging.getLogger("paved.kserve.access")

SERVER_NAME = "paved"
EXTENSIONS = ("binary_tensor_data", "parameters", "model_configuration", "statistics", "generate")
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Per ModelStreamInfer call: requests running at once (as many as a model admits by default)
# and responses waiting to be sent.
DEFAULT_STREAM_MAX_IN_FLIGHT = 1024
DEFAULT_STREAM_QUEUE_SIZE = 256
PROBES = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})


def write_access(
    context: TraceContext,
    protocol: str,
    method: str,
    model: str | None,
    status: str | int,
    started: float,
    *,
    probe: bool = False,
    ended: float | None = None,
) -> None:
    """One call's line on `paved.kserve.access` (see the module docstring); `ended` (a
    time.perf_counter() value, default now) for a line written after the call ended."""
    level = logging.DEBUG if probe else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    line = {
        **access_fields(context),
        "protocol": protocol,
        "method": method,
        "model": model or None,
        "status": status,
        "duration_ms": round(((time.perf_counter() if ended is None else ended) - started) * 1000, 3),
    }
    access_log.log(level, access_json(line))


def _model_of(request: Any) -> str | None:
    """The model a request names (ModelInfer: model_name; the other model requests: name)."""
    for attr in ("model_name", "name"):
        value = getattr(request, attr, None)
        if isinstance(value, str):
            return value
    return None


def _access_logged_unary(method: str, inner: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]):
    """`inner` answering x-request-id (in its trailing metadata) and writing its access line."""
    probe = method in PROBES
    level = logging.DEBUG if probe else logging.INFO

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        trace = metadata_context(context.invocation_metadata())
        error: BaseException | None = None
        try:
            # In the trailers, which go out with the answer: sending headers of their own
            # first is a write (and a client wake-up) more per call, -25 % requests/s on a
            # unary echo. A unary caller reads both at the same moment anyway.
            context.set_trailing_metadata(((REQUEST_ID_HEADER, trace.request_id),))
            return await inner(request, context)
        except BaseException as e:
            error = e
            raise
        finally:
            if access_log.isEnabledFor(level):
                # Written on the loop's next turn, once gRPC has the answer: formatting and
                # writing the line (~0.15 ms) is not the caller's latency.
                asyncio.get_running_loop().call_soon(
                    functools.partial(
                        write_access,
                        trace,
                        "kserve-grpc",
                        method,
                        _model_of(request),
                        grpc_status_name(context, error),
                        started,
                        probe=probe,
                        ended=time.perf_counter(),
                    )
                )

    return unary


def _access_logged_stream(method: str, inner: Callable[..., AsyncIterator[Any]]):
    """`inner` answering x-request-id (in its initial metadata: a stream's answers come before
    its trailers) and writing its access line when it closes."""
    probe = method in PROBES

    async def stream(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        trace = metadata_context(context.invocation_metadata())
        model: list[str | None] = [None]

        async def requests() -> AsyncIterator[Any]:
            async for request in request_iterator:
                if model[0] is None:
                    model[0] = _model_of(request)
                yield request

        error: BaseException | None = None
        try:
            await context.send_initial_metadata(((REQUEST_ID_HEADER, trace.request_id),))
            async for response in inner(requests(), context):
                yield response
        except BaseException as e:
            error = e
            raise
        finally:
            status = grpc_status_name(context, error)
            write_access(trace, "kserve-grpc", method, model[0], status, started, probe=probe)

    return stream


def access_logged_service(servicer: service_pb2_grpc.GRPCInferenceServiceServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, each wrapped once (ids, x-request-id, access line) from the
    service's descriptor. Not a grpc.aio ServerInterceptor: an interceptor runs per call and
    builds a new handler each time, ~0.1 ms of CPU per call (a fifth of a small ModelInfer's).
    Handlers do not set trailing metadata of their own (it would replace the id)."""
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        inner = getattr(servicer, method.name)
        deserialize = service_pb2.__dict__[method.input_type.name].FromString
        serialize = service_pb2.__dict__[method.output_type.name].SerializeToString
        if method.client_streaming or method.server_streaming:
            # The service's only streaming method (ModelStreamInfer) streams both ways.
            if not (method.client_streaming and method.server_streaming):
                raise TypeError(f"{method.full_name}: only unary and bidi methods are served")
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _access_logged_stream(method.name, inner),
                request_deserializer=deserialize,
                response_serializer=serialize,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _access_logged_unary(method.name, inner),
                request_deserializer=deserialize,
                response_serializer=serialize,
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def parameter_value(p: service_pb2.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def set_parameter(target: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        target[key].bool_param = value
    elif isinstance(value, int):
        target[key].int64_param = value
    elif isinstance(value, float):
        target[key].double_param = value
    else:
        target[key].string_param = str(value)


async def decode_off_loop(
    repository: ModelRepository, request: service_pb2.ModelInferRequest, *, decoupled: bool
) -> tuple[ServedModel, InferRequest]:
    """decode_request, off the event loop for a large request (its elements are decoded by
    Python loops: BYTES, typed contents)."""
    decode = functools.partial(decode_request, repository, request, decoupled=decoupled)
    return await off_loop_if_large(request.ByteSize(), decode)


def decode_request(
    repository: ModelRepository, request: service_pb2.ModelInferRequest, *, decoupled: bool
) -> tuple[ServedModel, InferRequest]:
    model = repository.get_ready(request.model_name, request.model_version)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid_argument(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "use raw contents for all inputs or for none"
        )
    model.check_required([t.name for t in request.inputs])
    inputs = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.parameters:
            raise unsupported(
                f"input '{tensor.name}': tensor parameters {sorted(tensor.parameters)} (shared memory) "
                "are not supported by this server"
            )
        model.check_input(tensor.name, tensor.datatype, tensor.shape)
        if raw and tensor.HasField("contents"):
            # Two sources for one tensor: which one the client meant is a guess (Triton refuses).
            raise invalid_argument(
                f"input '{tensor.name}' has both contents and raw_input_contents; use one of them"
            )
        if raw:
            inputs[tensor.name] = from_raw(tensor.name, tensor.datatype, tensor.shape, raw[i])
        else:
            inputs[tensor.name] = from_contents(tensor.name, tensor.datatype, tensor.shape, tensor.contents)
    outputs = None
    if request.outputs:
        outputs = []
        for out in request.outputs:
            extra = set(out.parameters) - {"binary_data"}
            if extra:
                raise unsupported(
                    f"output '{out.name}': parameters {sorted(extra)} (classification, shared memory) "
                    "are not supported by this server"
                )
            outputs.append(out.name)
    params = custom_parameters({k: parameter_value(v) for k, v in request.parameters.items()})
    return model, InferRequest(
        model_name=model.name,
        id=request.id,
        inputs=inputs,
        parameters=params,
        outputs=outputs,
        decoupled=decoupled,
        input_bytes=inputs_bytes(inputs),
    )


def encode_response(
    model: ServedModel, request_id: str, response: InferResponse
) -> service_pb2.ModelInferResponse:
    out = service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    for name, array in response.outputs.items():
        datatype = model.output_spec(name).datatype
        out.outputs.add(name=name, datatype=datatype, shape=array.shape)
        out.raw_output_contents.append(to_raw(array, datatype))
    return out


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        repository: ModelRepository,
        *,
        stream_max_in_flight: int = DEFAULT_STREAM_MAX_IN_FLIGHT,
        stream_queue_size: int = DEFAULT_STREAM_QUEUE_SIZE,
        metrics: KServeMetrics | None = None,
    ):
        """`metrics`: where inference requests are counted (None: a registry nobody serves)."""
        if stream_max_in_flight < 1 or stream_queue_size < 1:
            raise ValueError("stream_max_in_flight and stream_queue_size must be >= 1")
        self.repository = repository
        self.metrics = metrics or KServeMetrics(CollectorRegistry(), repository.serves)
        self.stream_max_in_flight = stream_max_in_flight
        self.stream_queue_size = stream_queue_size

    # ---- health and metadata ---------------------------------------------------------------
    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.repository.ready())

    async def ModelReady(self, request, context):
        # Like Triton: an unknown model or version is simply not ready.
        try:
            ready = self.repository.get(request.name, request.version).ready()
        except KServeError:
            ready = False
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=paved.__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request, context):
        try:
            model = self.repository.get(request.name, request.version)
        except KServeError as e:
            await context.abort(e.code, e.message)
        response = service_pb2.ModelMetadataResponse(
            name=model.name,
            versions=self.repository.versions(model.name),
            platform=model.platform or model.backend,
        )
        for specs, target in ((model.inputs, response.inputs), (model.outputs, response.outputs)):
            for spec in specs:
                target.add(
                    name=spec.name, datatype=spec.datatype, shape=spec.full_shape(model.max_batch_size)
                )
        return response

    async def ModelConfig(self, request, context):
        try:
            model = self.repository.get(request.name, request.version)
        except KServeError as e:
            await context.abort(e.code, e.message)
        return service_pb2.ModelConfigResponse(config=model.config())

    async def RepositoryIndex(self, request, context):
        if request.repository_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "this server has one unnamed repository; leave repository_name empty",
            )
        response = service_pb2.RepositoryIndexResponse()
        for model in self.repository.models():
            state, reason = model.state()
            if request.ready and state != "READY":
                continue
            response.models.add(name=model.name, version=model.version, state=state, reason=reason)
        return response

    async def ModelStatistics(self, request, context):
        """Triton's statistics of every READY version named (paved.kserve.statistics)."""
        try:
            stats = self.repository.statistics(request.name, request.version)
        except KServeError as e:
            await context.abort(e.code, e.message)
        return json_format.ParseDict({"model_stats": stats}, service_pb2.ModelStatisticsResponse())

    # ---- inference -------------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        record = self.metrics.request(request.model_name, GRPC)
        error = None
        try:
            with record.failures():
                model, infer_request = await decode_off_loop(self.repository, request, decoupled=False)
                responses = await self.repository.infer(model, infer_request)
                try:
                    results = [r async for r in responses]
                finally:
                    await aclose(responses)
                if len(results) != 1:
                    raise invalid_argument(
                        f"model '{model.name}' sent {len(results)} responses; use ModelStreamInfer for it"
                    )
                # A large answer is encoded off the loop, as a large request is decoded.
                response = await off_loop_if_large(
                    results[0].size, encode_response, model, request.id, results[0]
                )
        except KServeError as e:  # every error becomes a gRPC status (a cancellation propagates)
            error = e
        if error is not None:
            await context.abort(error.code, error.message)
        record.succeeded(batch_rows(model.max_batch_size, infer_request.inputs))
        return response

    async def ModelStreamInfer(self, request_iterator, context):
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.stream_queue_size)
        metrics = self.metrics
        tasks: set[asyncio.Task] = set()
        done = object()

        async def fail(request: service_pb2.ModelInferRequest, model_name: str, error: KServeError) -> None:
            message = service_pb2.ModelInferResponse(
                model_name=model_name, model_version=request.model_version, id=request.id
            )
            message.parameters["triton_final_response"].bool_param = True
            message.parameters[ERROR_CODE_PARAMETER].string_param = error.code.name
            if error.retry_after_s is not None:
                message.parameters[RETRY_AFTER_PARAMETER].int64_param = int(error.retry_after_s)
            await queue.put(
                service_pb2.ModelStreamInferResponse(error_message=error.message, infer_response=message)
            )

        async def handle(request: service_pb2.ModelInferRequest) -> None:
            empty_final = (
                request.parameters["triton_enable_empty_final_response"].bool_param
                if ("triton_enable_empty_final_response" in request.parameters)
                else False
            )
            record = metrics.request(request.model_name, GRPC)
            model = None
            try:
                with record.failures():
                    model, infer_request = await decode_off_loop(self.repository, request, decoupled=True)
                    responses = await self.repository.infer(model, infer_request)
                    try:
                        sent_final = False
                        async for response in responses:
                            if not response.outputs and response.final and not empty_final:
                                continue  # an empty final response is opt-in, as in Triton
                            message = await off_loop_if_large(
                                response.size, encode_response, model, request.id, response
                            )
                            message.parameters["triton_final_response"].bool_param = response.final
                            sent_final = sent_final or response.final
                            await queue.put(service_pb2.ModelStreamInferResponse(infer_response=message))
                        if empty_final and not sent_final:
                            message = service_pb2.ModelInferResponse(
                                model_name=model.name, model_version=model.version, id=request.id
                            )
                            message.parameters["triton_final_response"].bool_param = True
                            await queue.put(service_pb2.ModelStreamInferResponse(infer_response=message))
                    finally:
                        await aclose(responses)
            except KServeError as error:  # one request's error ends that request only
                await fail(request, model.name if model else request.model_name, error)
                return
            record.succeeded(batch_rows(model.max_batch_size, infer_request.inputs))

        async def read() -> None:
            failed: BaseException | None = None
            try:
                async for request in request_iterator:
                    if len(tasks) >= self.stream_max_in_flight:
                        metrics.failed(
                            metrics.model_label(request.model_name),
                            GRPC,
                            grpc.StatusCode.RESOURCE_EXHAUSTED.name,
                            was_started=False,
                        )
                        await fail(
                            request,
                            request.model_name,
                            too_large(
                                f"this stream already runs {len(tasks)} requests, the limit per "
                                f"ModelStreamInfer call (stream_max_in_flight={self.stream_max_in_flight}); "
                                "wait for a final response or open another stream"
                            ),
                        )
                        continue
                    task = asyncio.create_task(handle(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                # The client half-closed: finish what it sent, then end the call.
                while tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the writer is told
                failed = e
            # Not in a `finally`: a cancelled reader must not wait for room in a queue nobody reads.
            await queue.put(done)
            if failed is not None:
                raise failed

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                yield item
            await reader  # re-raises a failed read
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    # ---- not supported ---------------------------------------------------------------------
    async def _unsupported(self, context, what: str):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"{what} is not supported by paved's KServe server"
        )

    async def RepositoryModelLoad(self, request, context):
        await self._unsupported(context, "explicit model control (RepositoryModelLoad)")

    async def RepositoryModelUnload(self, request, context):
        await self._unsupported(context, "explicit model control (RepositoryModelUnload)")

    async def SystemSharedMemoryStatus(self, request, context):
        await self._unsupported(context, "system shared memory")

    async def SystemSharedMemoryRegister(self, request, context):
        await self._unsupported(context, "system shared memory")

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._unsupported(context, "system shared memory")

    async def CudaSharedMemoryStatus(self, request, context):
        await self._unsupported(context, "CUDA shared memory")

    async def CudaSharedMemoryRegister(self, request, context):
        await self._unsupported(context, "CUDA shared memory")

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._unsupported(context, "CUDA shared memory")

    async def TraceSetting(self, request, context):
        await self._unsupported(context, "TraceSetting")

    async def LogSettings(self, request, context):
        await self._unsupported(context, "LogSettings")


def create_grpc_server(
    repository: ModelRepository,
    *,
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    stream_max_in_flight: int = DEFAULT_STREAM_MAX_IN_FLIGHT,
    stream_queue_size: int = DEFAULT_STREAM_QUEUE_SIZE,
    metrics: KServeMetrics | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the servicer, bound (port 0: any free port); not yet started."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC turns SO_REUSEPORT on by default: a second server would silently share the port.
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = KServeServicer(
        repository,
        stream_max_in_flight=stream_max_in_flight,
        stream_queue_size=stream_queue_size,
        metrics=metrics,
    )
    server.add_generic_rpc_handlers((access_logged_service(servicer),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the KServe gRPC port {host}:{port}")
    return server, bound
