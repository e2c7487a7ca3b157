"""Routing and tracing headers cross the gateway both ways. A recording gRPC server stands where the
sidecar listens: it keeps the metadata each call brought and answers as the sidecar does, with the
served version and dye in its initial metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest_asyncio

from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from tests.sse_client import events_only, read_events

FORWARDED = {
    "x-model-version": "2",
    "x-canary-weight": "10",
    "x-user-id": "u-1",
    "x-tenant-id": "t-1",
    "x-request-id": "req-9",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "baggage": "team=search",
}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    async def generate(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        self.calls.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        await context.send_initial_metadata((("x-served-version", "2"), ("x-model-dye", "canary")))
        yield pb.GenerateResponse(
            sequence_number=0, model_version="2", text="hi", token_ids=[7]
        ).SerializeToString()
        final = pb.GenerateResponse(
            sequence_number=1, model_version="2", finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage()
        )
        yield final.SerializeToString()


@pytest_asyncio.fixture
async def recorded() -> AsyncIterator[tuple[Recorder, Gateway]]:
    recorder = Recorder()
    handler = grpc.method_handlers_generic_handler(
        "modelyard.inference.v1.InferenceService",
        {"Generate": grpc.unary_stream_rpc_method_handler(recorder.generate)},
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=f"127.0.0.1:{port}"))
    await gateway.start()
    try:
        yield recorder, gateway
    finally:
        await gateway.stop()
        await server.stop(None)


async def test_headers_are_forwarded_and_served_version_and_dye_returned(recorded) -> None:
    recorder, gateway = recorded
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        sse = await http.post("/v1/models/m/generate", json={"prompt": "x"}, headers=FORWARDED)
        events = events_only([e async for e in read_events(sse)])
        completion = await http.post(
            "/v1/completions", json={"model": "m", "prompt": "x", "user": "ignored"}, headers=FORWARDED
        )
    for response in (sse, completion):
        assert response.headers["x-served-version"] == "2" and response.headers["x-model-dye"] == "canary"
    assert [e.event for e in events] == ["token", "done"]
    assert completion.json()["choices"][0]["text"] == "hi"
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        assert {k: call.get(k) for k in FORWARDED} == FORWARDED
