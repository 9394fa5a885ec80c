"""Is a replica ready to take traffic, is it still alive: the checks behind replica states.

`probe_ready` is the gate between "starting" and "ready" (and back from "unhealthy"): the
launcher's admin `/health/ready` must answer 200 (the engine is loaded and the public ports
are open); with a KServe port, KServe v2 ServerReady and ModelReady must say ready; and the
smoke request must come back right: a chat completion with a small JSON schema whose content
parses and validates (an embeddings call for kind "embed"; for kind "kserve", a classic model,
one KServe v2 inference on zeros shaped as its metadata says, which must return every declared
output). A replica that answers 200 with garbage is therefore not ready.

`probe_live` is what decides whether to replace a replica: the driver still sees the very
process it started, and the admin `/health/live` answers 200.

Both return `(ok, reason)`; the reason names the failed check. Every check runs under the
probe's one deadline (`timeout_s`, all checks together); nothing raises for an unreachable or
misbehaving replica, only for invalid arguments (BadRequest).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import aiohttp
import jsonschema

from paved.bodies import read_at_most
from paved.control_plane.driver import Driver
from paved.control_plane.errors import BadRequest
from paved.control_plane.types import Replica

SMOKE_MAX_TOKENS = 24
SMOKE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# A replica's answer is read up to this size: a smoke reply is tiny, a huge one is a failure.
_MAX_BODY = 1 << 20


class _Failed(Exception):
    """One check failed; the message is the probe's reason."""


def _check_timeout(timeout_s: object) -> float:
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        raise BadRequest(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    return float(timeout_s)


class _Deadline:
    def __init__(self, timeout_s: float):
        self.end = time.monotonic() + timeout_s

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise _Failed(f"{what}: probe deadline exceeded")
        return left


async def _request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    deadline: _Deadline,
    what: str,
    body: dict[str, Any] | None = None,
) -> tuple[int, bytes]:
    try:
        async with session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=deadline.left(what))
        ) as resp:
            data = await read_at_most(resp.content, _MAX_BODY + 1)
            if len(data) > _MAX_BODY:
                raise _Failed(f"{what}: answer larger than {_MAX_BODY} bytes")
            return resp.status, data
    except TimeoutError:
        raise _Failed(f"{what}: no answer within the probe deadline") from None
    except aiohttp.ClientError as e:
        raise _Failed(f"{what}: {type(e).__name__}: {e}") from None


async def _expect_200(session: aiohttp.ClientSession, url: str, deadline: _Deadline, what: str) -> None:
    status, data = await _request(session, "GET", url, deadline, what)
    if status != 200:
        raise _Failed(f"{what}: HTTP {status} {data[:200].decode(errors='replace')!r}")


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise _Failed(f"{what}: answer is not JSON: {data[:200].decode(errors='replace')!r}") from None


async def _smoke_chat(session: aiohttp.ClientSession, url: str, model_id: str, deadline: _Deadline) -> None:
    what = "smoke chat completion"
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": 'Answer with the JSON object {"ok": true}.'}],
        "max_tokens": SMOKE_MAX_TOKENS,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "paved_probe", "strict": True, "schema": SMOKE_SCHEMA},
        },
    }
    status, data = await _request(session, "POST", url + "/v1/chat/completions", deadline, what, body)
    if status != 200:
        raise _Failed(f"{what}: HTTP {status} {data[:300].decode(errors='replace')!r}")
    answer = _json(data, what)
    try:
        choice = answer["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _Failed(
            f"{what}: no choices[0].message.content in {data[:200].decode(errors='replace')!r}"
        ) from None
    if not isinstance(content, str):
        raise _Failed(f"{what}: content is {type(content).__name__}, not a string")
    try:
        value = json.loads(content)
    except ValueError:
        raise _Failed(
            f"{what}: content is not valid JSON "
            f"(finish_reason {choice.get('finish_reason')!r}): {content[:200]!r}"
        ) from None
    try:
        jsonschema.validate(value, SMOKE_SCHEMA)
    except jsonschema.ValidationError as e:
        raise _Failed(f"{what}: content does not match the schema: {e.message}") from None


async def _smoke_embed(session: aiohttp.ClientSession, url: str, model_id: str, deadline: _Deadline) -> None:
    what = "smoke embeddings"
    body = {"model": model_id, "input": "paved readiness probe"}
    status, data = await _request(session, "POST", url + "/v1/embeddings", deadline, what, body)
    if status != 200:
        raise _Failed(f"{what}: HTTP {status} {data[:300].decode(errors='replace')!r}")
    answer = _json(data, what)
    try:
        vector = answer["data"][0]["embedding"]
    except (KeyError, IndexError, TypeError):
        raise _Failed(f"{what}: no data[0].embedding in {data[:200].decode(errors='replace')!r}") from None
    if not isinstance(vector, list) or not vector:
        raise _Failed(f"{what}: the embedding is not a non-empty list")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in vector):
        raise _Failed(f"{what}: the embedding holds a non-finite or non-number value")


async def _kserve_ready(target: str, model_id: str, deadline: _Deadline) -> None:
    # Imported here: gRPC and the KServe stubs load only for replicas that serve KServe.
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            server = await stub.ServerReady(
                service_pb2.ServerReadyRequest(), timeout=deadline.left("KServe ServerReady")
            )
            if not server.ready:
                raise _Failed("KServe ServerReady: not ready")
            model = await stub.ModelReady(
                service_pb2.ModelReadyRequest(name=model_id), timeout=deadline.left("KServe ModelReady")
            )
            if not model.ready:
                raise _Failed(f"KServe ModelReady {model_id!r}: not ready")
        except grpc.aio.AioRpcError as e:
            raise _Failed(f"KServe readiness on {target}: {e.code().name}: {e.details()}") from None


# Zeros of these KServe datatypes are built for the smoke inference (numpy dtype names).
_SMOKE_DTYPES = {
    "FP32": "float32", "FP64": "float64", "FP16": "float16",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool",
}  # fmt: skip
_SMOKE_MAX_ELEMENTS = 1 << 16


async def _smoke_kserve(target: str, model_id: str, deadline: _Deadline) -> None:
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            meta = await stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=model_id), timeout=deadline.left("KServe ModelMetadata")
            )
            request = service_pb2.ModelInferRequest(model_name=model_id)
            for spec in meta.inputs:
                dtype = _SMOKE_DTYPES.get(spec.datatype)
                # A dynamic dimension (the batch, say) is 1 in the smoke request.
                shape = [d if d > 0 else 1 for d in spec.shape]
                if dtype is None or math.prod(shape) > _SMOKE_MAX_ELEMENTS:
                    return  # not a tensor a generic smoke can build: readiness alone decides
                tensor = request.inputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
                del tensor
                request.raw_input_contents.append(np.zeros(shape, dtype=dtype).tobytes())
            answer = await stub.ModelInfer(request, timeout=deadline.left("KServe smoke inference"))
        except grpc.aio.AioRpcError as e:
            raise _Failed(f"KServe smoke on {target}: {e.code().name}: {e.details()}") from None
    got = {o.name for o in answer.outputs}
    missing = [o.name for o in meta.outputs if o.name not in got]
    if missing:
        raise _Failed(f"KServe smoke on {target}: outputs {missing} missing from the answer")


def _session() -> aiohttp.ClientSession:
    # Probes go straight to the replica, never through a proxy from the environment.
    return aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(limit=4, force_close=True))


async def probe_ready(
    replica: Replica,
    *,
    model_id: str,
    kind: str = "generate",
    smoke: bool = True,
    timeout_s: float = 10.0,
) -> tuple[bool, str]:
    """(True, "ready") or (False, why); see the module docstring for the checks."""
    if not isinstance(model_id, str) or not model_id:
        raise BadRequest("model_id must be a non-empty string")
    if kind not in ("generate", "embed", "kserve"):
        raise BadRequest(f"kind must be 'generate', 'embed' or 'kserve', got {kind!r}")
    if kind == "kserve" and not replica.kserve_grpc:
        raise BadRequest("a kserve replica needs a KServe gRPC address")
    deadline = _Deadline(_check_timeout(timeout_s))
    try:
        async with _session() as session:
            await _expect_200(
                session, replica.admin_url + "/health/ready", deadline, "launcher /health/ready"
            )
            if replica.kserve_grpc:
                await _kserve_ready(replica.kserve_grpc, model_id, deadline)
            if smoke and kind == "kserve":
                await _smoke_kserve(replica.kserve_grpc or "", model_id, deadline)
            elif smoke:
                check = _smoke_embed if kind == "embed" else _smoke_chat
                await check(session, replica.url, model_id, deadline)
    except _Failed as e:
        return False, str(e)
    except TimeoutError:
        return False, "probe deadline exceeded"
    return True, "ready"


async def probe_live(replica: Replica, driver: Driver, *, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(True, "live") or (False, why): the driver's process check, then admin /health/live."""
    deadline = _Deadline(_check_timeout(timeout_s))
    if not await driver.alive(replica):
        return False, "the replica's process is gone"
    try:
        async with _session() as session:
            await _expect_200(session, replica.admin_url + "/health/live", deadline, "launcher /health/live")
    except _Failed as e:
        return False, str(e)
    return True, "live"
