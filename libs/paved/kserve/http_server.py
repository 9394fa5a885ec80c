"""KServe v2 over HTTP/REST (FastAPI), with Triton's binary tensor and generate extensions.

Endpoints: /v2, /v2/health/{live,ready}, /v2/models/{m}[/versions/{v}], .../ready, .../config,
.../infer, .../generate, .../generate_stream (SSE), .../stats and /v2/models/stats (Triton's
statistics extension), /v2/repository/index; and paved's own
/health/{live,ready} (ready is 503 until loaded), what the gateway and the launcher probe; and
/metrics when the server owns its metrics registry (standalone; see paved.kserve.metrics).
Status codes are Triton's (http_server.cc): a not-ready server or model is 400, unknown model
404, unsupported feature 501, unavailable 503, and every error body is {"error": "..."}, which
is what tritonclient.http raises from. Bodies over the size limit are 413 before they are read.

Binary tensor extension: the `Inference-Header-Content-Length` header splits the body into
the JSON header and the concatenated raw inputs (those with `parameters.binary_data_size`), in
input order; outputs are returned raw when asked per output (`binary_data`) or for all
(`binary_data_output`), with the same header on the response.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope

import paved
from paved.engine.streams import aclose
from paved.http.json_body import JSONBodyError, parse_json
from paved.http.kserve_names import HTTP_MODEL_METHODS
from paved.http.off_loop import off_loop_if_large
from paved.http.tracing import AccessMiddleware, TraceContext
from paved.kserve.errors import KServeError, from_exception, invalid_argument, too_large, unsupported
from paved.kserve.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, EXTENSIONS, SERVER_NAME, write_access
from paved.kserve.metrics import HTTP, KServeMetrics, batch_rows
from paved.kserve.model import inputs_bytes
from paved.kserve.model_config import config_to_dict
from paved.kserve.repository import (
    InferRequest,
    InferResponse,
    ModelRepository,
    ServedModel,
    custom_parameters,
)
from paved.kserve.tensors import from_json, from_raw, to_json, to_raw

HEADER_LENGTH = "Inference-Header-Content-Length"
# A repository index request is `{"ready": true}` at most.
INDEX_BODY_BYTES = 64 * 1024
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}
_OUTPUT_KEYS = {"name", "parameters"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _kserve_error(e: KServeError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return _error(e.http_status, e.message, headers)


def _config_json(model: ServedModel) -> dict:
    """ModelConfig as Triton's HTTP /config returns it: proto field names, int64s as numbers."""
    return config_to_dict(model.config())


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and _digits(length) and (len(length) > 20 or int(length) > limit):
        raise too_large(f"request body of {length} bytes exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as e:
        # The client hung up mid-upload: its ending, not a server failure (nor a traceback).
        raise KServeError(grpc.StatusCode.CANCELLED, "the client disconnected") from e
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("gzip", "deflate"):
        # Bounded decompression: a small compressed body must not expand past the limit.
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            body = inflater.decompress(body, limit + 1)
        except zlib.error as e:
            raise invalid_argument(f"cannot decompress the {encoding} request body: {e}") from e
        if len(body) > limit or inflater.unconsumed_tail:
            raise too_large(f"decompressed request body exceeds the limit of {limit} bytes")
        if not inflater.eof:
            # Cut short (a client that died mid-upload through a proxy): refused, not read as
            # whatever prefix arrived.
            raise invalid_argument(f"the {encoding} request body is truncated")
        if inflater.unused_data:
            raise invalid_argument(f"the {encoding} request body has data after its end (one member only)")
    elif encoding not in ("", "identity"):
        raise unsupported(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    return body


def _digits(value: str) -> bool:
    """ASCII digits only: "²" is a digit to str.isdigit and not to int()."""
    return value.isascii() and value.isdigit()


def _decode_infer(
    model: ServedModel, body: bytes, header_length: str | None
) -> tuple[InferRequest, dict, bool]:
    if header_length is not None:
        # At most 20 digits: int() refuses strings past 4300, and no body is longer than 20.
        if not _digits(header_length) or len(header_length) > 20 or int(header_length) > len(body):
            raise invalid_argument(
                f"{HEADER_LENGTH} {header_length!r} does not fit a body of {len(body)} bytes"
            )
        split = int(header_length)
    else:
        split = len(body)
    try:
        doc = parse_json(body[:split])
    except JSONBodyError as e:
        raise invalid_argument(f"the inference request header is {e}") from e
    if not isinstance(doc, dict):
        raise invalid_argument("the inference request must be a JSON object")
    unknown = sorted(set(doc) - _REQUEST_KEYS)
    if unknown:
        raise invalid_argument(f"unknown field(s) {unknown} in the inference request")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid_argument("'parameters' must be an object")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise invalid_argument("parameter 'binary_data_output' must be a boolean")
    tensors = doc.get("inputs")
    if not isinstance(tensors, list):
        raise invalid_argument("'inputs' must be a list")
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid_argument("every input needs a 'name'")
    model.check_required([t["name"] for t in tensors])
    inputs = {}
    offset = split
    for t in tensors:
        name = t["name"]
        extra = sorted(set(t) - _INPUT_KEYS)
        if extra:
            raise invalid_argument(f"input '{name}': unknown field(s) {extra}")
        datatype, shape = t.get("datatype"), t.get("shape")
        if not isinstance(datatype, str):
            raise invalid_argument(f"input '{name}': 'datatype' must be a string")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise invalid_argument(f"input '{name}': 'shape' must be a list of integers")
        tparams = t.get("parameters") or {}
        if not isinstance(tparams, dict):
            raise invalid_argument(f"input '{name}': 'parameters' must be an object")
        other = sorted(set(tparams) - {"binary_data_size"})
        if other:
            raise unsupported(
                f"input '{name}': parameters {other} (shared memory) are not supported by this server"
            )
        model.check_input(name, datatype, shape)
        if "binary_data_size" in tparams:
            size = tparams["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(body):
                raise invalid_argument(
                    f"input '{name}': binary_data_size {size!r} runs past the end of the body"
                )
            if "data" in t:
                raise invalid_argument(f"input '{name}' has both 'data' and binary data")
            inputs[name] = from_raw(name, datatype, shape, memoryview(body)[offset : offset + size])
            offset += size
        else:
            if "data" not in t:
                raise invalid_argument(f"input '{name}' has no 'data' and no binary_data_size")
            inputs[name] = from_json(name, datatype, shape, t["data"])
    if offset != len(body):
        raise invalid_argument(f"{len(body) - offset} bytes of binary data are not claimed by any input")
    binary: dict[str, bool] = {}
    outputs = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise invalid_argument("'outputs' must be a list")
        outputs = []
        for o in doc["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise invalid_argument("every requested output needs a 'name'")
            extra = sorted(set(o) - _OUTPUT_KEYS)
            if extra:
                raise invalid_argument(f"output '{o['name']}': unknown field(s) {extra}")
            oparams = o.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise invalid_argument(f"output '{o['name']}': 'parameters' must be an object")
            other = sorted(set(oparams) - {"binary_data"})
            if other:
                raise unsupported(
                    f"output '{o['name']}': parameters {other} (classification, shared memory) "
                    "are not supported"
                )
            wants_binary = oparams.get("binary_data", binary_default)
            if not isinstance(wants_binary, bool):
                raise invalid_argument(f"output '{o['name']}': parameter 'binary_data' must be a boolean")
            binary[o["name"]] = wants_binary
            outputs.append(o["name"])
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid_argument("'id' must be a string")
    infer = InferRequest(
        model_name=model.name,
        id=request_id,
        inputs=inputs,
        parameters=custom_parameters(params),
        # An empty list asks for no output in particular: every output, as over gRPC (Triton alike).
        outputs=outputs or None,
        input_bytes=inputs_bytes(inputs),
    )
    return infer, binary, binary_default


def _encode_infer(
    model: ServedModel,
    request_id: str,
    response: InferResponse,
    binary: dict[str, bool],
    binary_default: bool,
) -> Response:
    doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if request_id:
        doc["id"] = request_id
    outputs = []
    chunks = []
    for name, array in response.outputs.items():
        datatype = model.output_spec(name).datatype
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary.get(name, binary_default):
            raw = to_raw(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = to_json(array, datatype)
        outputs.append(entry)
    doc["outputs"] = outputs
    header = json.dumps(doc).encode()
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(
        b"".join([header, *chunks]),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


def _generate_inputs(model: ServedModel, doc: Any) -> InferRequest:
    """Triton's generate extension: top-level keys are inputs, `parameters` are request parameters."""
    if not isinstance(doc, dict):
        raise invalid_argument("the generate request must be a JSON object")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid_argument("'parameters' must be an object")
    request_id = doc.get("id", "")
    names = [k for k in doc if k not in ("id", "parameters")]
    model.check_required(names)
    inputs = {}
    for name in names:
        value = doc[name]
        spec = next((s for s in model.inputs if s.name == name), None)
        if spec is None:
            raise invalid_argument(f"unexpected inference input '{name}' for model '{model.name}'")
        shape = [len(value)] if isinstance(value, list) else [1]
        if model.max_batch_size > 0:
            shape = [1, *shape]
        model.check_input(name, spec.datatype, shape)
        inputs[name] = from_json(name, spec.datatype, shape, value)
    return InferRequest(
        model_name=model.name,
        id=str(request_id),
        inputs=inputs,
        parameters=custom_parameters(params),
        input_bytes=inputs_bytes(inputs),
    )


def _generate_json(model: ServedModel, response: InferResponse) -> dict:
    doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    for name, array in response.outputs.items():
        data = to_json(array, model.output_spec(name).datatype)
        doc[name] = data[0] if len(data) == 1 else data
    return doc


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, started: Awaitable[AsyncIterator[InferResponse]]) -> list[InferResponse]:
    """Every response of a non-streaming request, `started` being repository.infer's
    coroutine. Starlette does not cancel a plain handler when its client goes away, so watch
    for that from the start (a classic model's request waits in its batcher's queue before
    infer returns): the request is then cancelled, which takes it out of the queue or closes
    its engine stream and so aborts the engine request."""
    responses: AsyncIterator[InferResponse] | None = None

    async def collect() -> list[InferResponse]:
        nonlocal responses
        responses = await started
        return [r async for r in responses]

    task = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if responses is not None:
            await aclose(responses)
        elif inspect.iscoroutine(started):
            started.close()  # cancelled before it ran: no "never awaited" warning
    if task.cancelled():
        raise KServeError(grpc.StatusCode.CANCELLED, "the client closed the request")
    return task.result()


class _EventStream(StreamingResponse):
    """Server-sent events whose request is closed however the response ends (completed,
    failed, or cut short by a disconnect before the first event); `ended` is then told the
    request's outcome: None for success, else the status code name."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        responses: AsyncIterator[InferResponse],
        ended: Callable[[str | None], None],
    ):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._responses = responses
        self._ended = ended
        # Until the events say otherwise, the stream was cut short by its client.
        self.outcome: str | None = grpc.StatusCode.CANCELLED.name

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended(self.outcome)
            await aclose(self._responses)


_SERVER_METHODS = {
    "/v2": "ServerMetadata",
    "/v2/health/live": "ServerLive",
    "/v2/health/ready": "ServerReady",
    "/v2/repository/index": "RepositoryIndex",
}
_PROBE_METHODS = frozenset({"ServerMetadata", "ServerLive", "ServerReady"})


def _method(scope: Scope) -> tuple[str, str | None]:
    """(the call's method name, its model) from the routed path; the path itself for others."""
    path: str = scope["path"]
    params = scope.get("path_params") or {}
    name = params.get("name")
    if isinstance(name, str) and path.startswith("/v2/models/"):
        prefix = f"/v2/models/{name}"
        if "version" in params:
            prefix += f"/versions/{params['version']}"
        suffix = path[len(prefix) :] if path.startswith(prefix) else None
        if suffix in HTTP_MODEL_METHODS:
            return HTTP_MODEL_METHODS[suffix], name
        return path, name
    return _SERVER_METHODS.get(path, path), None


class AccessLogMiddleware(AccessMiddleware[TraceContext]):
    """Assigns each request's ids, answers x-request-id and writes its access line once the
    response has ended (streams included)."""

    def open(self, scope: Scope, context: TraceContext) -> TraceContext:
        return context

    def error_status(self, error: Exception) -> int:
        return from_exception(error).http_status

    def write(self, scope: Scope, record: TraceContext, status: int, started: float) -> None:
        method, model = _method(scope)
        # Scrapes are as periodic as probes: not an INFO line each.
        path = scope["path"]
        probe = method in _PROBE_METHODS or path.startswith("/health/") or path == "/metrics"
        write_access(record, "kserve-http", method, model, status, started, probe=probe)


def create_http_app(
    repository: ModelRepository,
    *,
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    metrics: KServeMetrics | None = None,
    metrics_registry: CollectorRegistry | None = None,
) -> FastAPI:
    """`metrics`: where inference requests are counted (None: a registry nobody serves);
    `metrics_registry`, if given, is served at GET /metrics (the standalone server's)."""
    if metrics is None:
        metrics = KServeMetrics(CollectorRegistry(), repository.serves)

    app = FastAPI(
        title="paved KServe v2", version=paved.__version__, openapi_url=None, docs_url=None, redoc_url=None
    )

    @app.exception_handler(KServeError)
    async def _on_kserve_error(_: Request, e: KServeError) -> JSONResponse:
        return _kserve_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _on_error(_: Request, e: Exception) -> JSONResponse:
        return _kserve_error(from_exception(e))

    if metrics_registry is not None:
        registry = metrics_registry

        @app.get("/metrics")
        async def prometheus_metrics():
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v2")
    async def server_metadata():
        return {"name": SERVER_NAME, "version": paved.__version__, "extensions": list(EXTENSIONS)}

    @app.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready():
        if repository.ready():
            return Response(status_code=200)
        return _error(400, "server is not ready: models are still loading")

    # What every paved server answers (the gateway's health checker and the launcher's gate
    # probe these paths), so a KServe-only replica stands in a fleet like any other. 503, not
    # KServe's 400, while loading: these are load-balancer probes.
    @app.get("/health/live")
    async def paved_live():
        return Response(status_code=200)

    @app.get("/health/ready")
    async def paved_ready():
        if repository.ready():
            return Response(status_code=200)
        return _error(503, "server is not ready: models are still loading")

    async def metadata(name: str, version: str = ""):
        model = repository.get(name, version)
        tensors = [
            [
                {"name": s.name, "datatype": s.datatype, "shape": s.full_shape(model.max_batch_size)}
                for s in specs
            ]
            for specs in (model.inputs, model.outputs)
        ]
        return {
            "name": model.name,
            "versions": repository.versions(model.name),
            "platform": model.platform or model.backend,
            "inputs": tensors[0],
            "outputs": tensors[1],
        }

    async def model_ready(name: str, version: str = ""):
        try:
            ok = repository.get(name, version).ready()
        except KServeError:
            ok = False
        return Response(status_code=200) if ok else _error(400, "Model version not ready")

    async def config(name: str, version: str = ""):
        return _config_json(repository.get(name, version))

    async def infer(name: str, request: Request, version: str = ""):
        record = metrics.request(name, HTTP)
        with record.failures():
            model = repository.get_ready(name, version)
            body = await _read_body(request, max_body_bytes)
            infer_request, binary, binary_default = await off_loop_if_large(
                len(body), _decode_infer, model, body, request.headers.get(HEADER_LENGTH)
            )
            results = await _collect(request, repository.infer(model, infer_request))
            if len(results) != 1:
                raise invalid_argument(
                    f"model '{model.name}' sent {len(results)} responses; use generate_stream or gRPC"
                )
            response = await off_loop_if_large(
                results[0].size, _encode_infer, model, infer_request.id, results[0], binary, binary_default
            )
        record.succeeded(batch_rows(model.max_batch_size, infer_request.inputs))
        return response

    async def generate(name: str, request: Request, version: str = ""):
        record = metrics.request(name, HTTP)
        with record.failures():
            model = repository.get_ready(name, version)
            body = await _read_body(request, max_body_bytes)
            infer_request = await off_loop_if_large(len(body), _decode_generate, model, body)
            results = await _collect(request, repository.infer(model, infer_request))
            if len(results) != 1:
                raise invalid_argument(
                    f"model '{model.name}' sent {len(results)} responses; use generate_stream"
                )
            answer = results[0]
            response = await off_loop_if_large(
                answer.size, lambda: JSONResponse(_generate_json(model, answer))
            )
        record.succeeded(batch_rows(model.max_batch_size, infer_request.inputs))
        return response

    async def generate_stream(name: str, request: Request, version: str = ""):
        record = metrics.request(name, HTTP)
        with record.failures():
            model = repository.get_ready(name, version)
            body = await _read_body(request, max_body_bytes)
            infer_request = await off_loop_if_large(len(body), _decode_generate, model, body)
            infer_request.decoupled = True
            # Admission errors are answered with a status code; later ones travel as SSE events.
            responses = await repository.infer(model, infer_request)
        rows = batch_rows(model.max_batch_size, infer_request.inputs)

        def ended(status: str | None) -> None:
            if status is None:
                record.succeeded(rows)
            else:
                record.failed(status)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for response in responses:
                    yield b"data: " + json.dumps(_generate_json(model, response)).encode() + b"\n\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: the error can only go in the stream
                error = from_exception(e)
                stream.outcome = error.code.name
                yield b"data: " + json.dumps({"error": error.message}).encode() + b"\n\n"
                return
            stream.outcome = None

        stream = _EventStream(events(), responses, ended)
        return stream

    async def statistics(name: str = "", version: str = ""):
        return {"model_stats": repository.statistics(name, version)}

    # Registered before the model routes, so /v2/models/stats is not read as a model name.
    for path in ("/v2/models/stats", "/v2/models/{name}/stats", "/v2/models/{name}/versions/{version}/stats"):
        app.add_api_route(path, statistics, methods=["GET"])

    async def not_supported(request: Request):
        raise unsupported(f"{request.url.path} is not supported by paved's KServe server")

    for path in (
        "/v2/repository/models/{name}/load",
        "/v2/repository/models/{name}/unload",
        "/v2/systemsharedmemory{rest:path}",
        "/v2/cudasharedmemory{rest:path}",
        "/v2/trace/setting",
        "/v2/models/{name}/trace/setting",
        "/v2/logging",
    ):
        app.add_api_route(path, not_supported, methods=["GET", "POST"])
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.add_api_route(prefix, metadata, methods=["GET"])
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        app.add_api_route(prefix + "/config", config, methods=["GET"])
        app.add_api_route(prefix + "/infer", infer, methods=["POST"])
        app.add_api_route(prefix + "/generate", generate, methods=["POST"])
        app.add_api_route(prefix + "/generate_stream", generate_stream, methods=["POST"])

    @app.post("/v2/repository/index")
    async def repository_index(request: Request):
        body = await _read_body(request, INDEX_BODY_BYTES)
        doc = _parse_json(body) if body.strip() else {}
        if not isinstance(doc, dict) or set(doc) - {"ready"}:
            raise invalid_argument("the repository index request takes only 'ready'")
        only_ready = doc.get("ready", False)
        if not isinstance(only_ready, bool):  # "false" is not false
            raise invalid_argument("'ready' must be a boolean")
        index = []
        for model in repository.models():
            state, reason = model.state()
            if only_ready and state != "READY":
                continue
            index.append({"name": model.name, "version": model.version, "state": state, "reason": reason})
        return index

    app.add_middleware(AccessLogMiddleware)
    return app


def _decode_generate(model: ServedModel, body: bytes) -> InferRequest:
    return _generate_inputs(model, _parse_json(body))


def _parse_json(body: bytes) -> Any:
    try:
        return parse_json(body)
    except JSONBodyError as e:
        raise invalid_argument(f"the request body is {e}") from e
