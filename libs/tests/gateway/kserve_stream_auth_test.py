"""An open KServe gRPC ModelStreamInfer stream through the gateway is authorized message by
message: a key revoked while the stream is open stops it at the next message (answered
in-band UNAUTHENTICATED, not forwarded). The key was checked once, when the stream opened, so a
revoked or expired key kept sending until the stream's deadline (600 s by default)."""

from __future__ import annotations

import asyncio

import grpc
from tritonclient.grpc import service_pb2

from paved.gateway.access.auth import Authenticator
from paved.gateway.access.limits import InProcessLimiter
from paved.gateway.access.state import GatewayStore
from paved.gateway.forwarding.kserve_grpc import KServeForwarder
from paved.gateway.routing.router import Router
from paved.gateway.routing.routes import Backend, ModelRoute, RoutesTable

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def test_a_key_revoked_while_its_stream_is_open_sends_no_more(tmp_path):
    received: list[bytes] = []

    async def upstream_stream(requests, context):
        async for request in requests:
            received.append(request)
            answer = service_pb2.ModelInferResponse(model_name="m", id=str(len(received)))
            answer.parameters["triton_final_response"].bool_param = True
            yield service_pb2.ModelStreamInferResponse(infer_response=answer).SerializeToString()

    async def main() -> None:
        upstream = grpc.aio.server()
        upstream.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "inference.GRPCInferenceService",
                    {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(upstream_stream)},
                ),
            )
        )
        up_port = upstream.add_insecure_port("127.0.0.1:0")
        await upstream.start()
        backend = Backend(id="b", url="http://127.0.0.1:9", version="v1", kserve_grpc=f"127.0.0.1:{up_port}")
        router = Router(RoutesTable.of([ModelRoute("m", (backend,), kind="kserve")]))
        store = GatewayStore(f"sqlite:///{tmp_path}/gateway.db")
        await store.start()
        await store.create_tenant("acme")
        info, key = await store.create_key("acme")
        forwarder = KServeForwarder(router, Authenticator(store), InProcessLimiter(), connect_timeout_s=5)
        gateway = grpc.aio.server()
        gateway.add_generic_rpc_handlers((forwarder.handler(),))
        port = gateway.add_insecure_port("127.0.0.1:0")
        await gateway.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)(
                metadata=(("authorization", f"Bearer {key}"),), timeout=60
            )
            message = service_pb2.ModelInferRequest(model_name="m").SerializeToString()
            await call.write(message)
            first = service_pb2.ModelStreamInferResponse.FromString(await call.read())
            assert first.error_message == "" and len(received) == 1
            await store.revoke_key(info.key_id)
            await asyncio.sleep(1.0)  # past the authenticator's cache (0.5 s)
            await call.write(message)
            refused = service_pb2.ModelStreamInferResponse.FromString(await call.read())
            assert "revoked" in refused.error_message, refused
            code = refused.infer_response.parameters["paved_error_code"].string_param
            assert code == "UNAUTHENTICATED"
            assert len(received) == 1  # never forwarded
            await call.done_writing()
        finally:
            await channel.close()
            await gateway.stop(0)
            await upstream.stop(0)
            await forwarder.close()
            await store.close()

    asyncio.run(main())
