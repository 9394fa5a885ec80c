"""The KServe v2 gRPC load driver the KServe benches share (//bench:kserve, //bench:triton).

A lean client (the raw gRPC stub, requests serialized once up front) so that on a small machine
the load generator is cheaper than the server it measures: tritonclient spends several hundred
microseconds of CPU per call, which would cap every configuration at the client's own rate.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

# A deadline on every call: a server that stops answering fails the run instead of hanging it.
CALL_TIMEOUT_S = 60.0


async def drive(
    url: str,
    model: str,
    x: np.ndarray,
    expected: np.ndarray,
    concurrency: int,
    total: int,
    *,
    input_name: str,
    timeout_s: float = CALL_TIMEOUT_S,
) -> tuple[float, list[float]]:
    """`total` one-row FP32 requests (row i of `x` as `input_name`, shape [1, features]) from
    `concurrency` workers; returns (seconds, per-request latencies). Every answer's first raw
    output must be bit-equal to `expected[i]` (AssertionError naming the model, server and row)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    requests = []
    for i in range(len(x)):
        request = service_pb2.ModelInferRequest(model_name=model)
        request.inputs.add(name=input_name, datatype="FP32", shape=[1, x.shape[1]])
        request.raw_input_contents.append(x[i : i + 1].tobytes())
        requests.append(request)
    latencies: list[float] = []
    next_index = 0
    async with grpc.aio.insecure_channel(url) as channel:
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer

        async def worker() -> None:
            nonlocal next_index
            while next_index < total:
                i = next_index % len(x)
                next_index += 1
                start = time.perf_counter()
                response = await infer(requests[i], timeout=timeout_s)
                latencies.append(time.perf_counter() - start)
                got = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
                if not np.array_equal(got, expected[i]):
                    raise AssertionError(f"{model} at {url}: row {i} differs from the in-process answer")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies
