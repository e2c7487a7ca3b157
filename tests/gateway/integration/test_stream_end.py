"""A stream read to its `done` is not an upstream cancel, even with `--resume-window-s 0` (the
stream is forgotten as soon as its reader is): the gateway waits for the call's status instead of
cancelling it, so the service and the sidecar count an OK call, and the gateway's
modelyard_gateway_upstream_cancels_total counts only real cancels.

The upstream is a real grpc.aio server whose Generate sends its last event and then holds its
status until the test lets it go: the moment in which the old gateway cancelled the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx

from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from tests.support import eventually


class Holding:
    """InferenceService.Generate alone (a generic handler: the other methods are not needed)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ended: list[str] = []  # "ok" or "cancelled", once per call

    def handler(self) -> grpc.GenericRpcHandler[pb.GenerateRequest, pb.GenerateResponse]:
        generate = grpc.unary_stream_rpc_method_handler(
            self.generate,
            request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            "modelyard.inference.v1.InferenceService", {"Generate": generate}
        )

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            yield pb.GenerateResponse(text="a", token_ids=[1], model_version="1")
            yield pb.GenerateResponse(
                text="b", token_ids=[2], model_version="1", finish_reason=pb.FINISH_REASON_LENGTH
            )
            await self.release.wait()  # the status is not sent yet
            self.ended.append("ok")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise


async def test_a_stream_read_to_done_is_not_cancelled_upstream_without_a_resume_window() -> None:
    server = grpc.aio.server()
    servicer = Holding()
    server.add_generic_rpc_handlers((servicer.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=f"127.0.0.1:{port}", resume_window_s=0))
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            response = await http.post("/v1/models/m/generate", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 200 and "event: done" in response.text, response.text
        # The reader has gone and the stream is forgotten; its call waits for its status.
        await eventually(lambda: len(gateway.registry) == 0, "the stream forgotten")
        assert servicer.ended == []
        servicer.release.set()
        await eventually(lambda: bool(servicer.ended), "the call's end")
        assert servicer.ended == ["ok"]
        cancels = gateway.metrics.registry.get_sample_value("modelyard_gateway_upstream_cancels_total")
        assert cancels == 0
    finally:
        await gateway.stop()
        await server.stop(0)
