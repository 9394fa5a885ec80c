"""Names the KServe v2 access lines share between the gateway's forwarders and the instance's
servers, so that one call reads alike at every hop and over both transports."""

from __future__ import annotations

import asyncio

import grpc

# The gRPC method a KServe v2 HTTP model endpoint (/v2/models/{m}[/versions/{v}]<suffix>)
# matches.
HTTP_MODEL_METHODS = {
    "": "ModelMetadata",
    "/ready": "ModelReady",
    "/config": "ModelConfig",
    "/infer": "ModelInfer",
    "/generate": "ModelGenerate",
    "/generate_stream": "ModelGenerateStream",
    "/stats": "ModelStatistics",
}


def grpc_status_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The gRPC code the client sees: the aborted code, CANCELLED, or UNKNOWN for an error
    gRPC turns into one."""
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "OK" if error is None else "UNKNOWN"
