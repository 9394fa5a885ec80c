"""A Python gRPC server (grpc.aio, as paved's KServe server is built) that does no work: every
ModelInfer gets the same pre-serialized answer, with no deserializing, no interceptor, no
metrics. //bench:triton's --aio-null-server measures it beside Triton: the floor of any server
on Python's gRPC runtime, whatever it did per request.

    python bench/aio_null_server.py ANSWER_FILE     prints "listening on 127.0.0.1:PORT"
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc


async def serve(answer: bytes) -> None:
    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)},
    )
    # paved's server options: no SO_REUSEPORT (a second server would share the port).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise SystemExit("aio_null_server: cannot bind a loopback port")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]).read_bytes()))
