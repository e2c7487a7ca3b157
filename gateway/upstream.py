"""The gRPC side: one channel to the sidecar, its stubs, and the headers that travel each way."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2_grpc as inference_grpc
from modelyard.inference.v1 import model_service_pb2_grpc as model_grpc
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc

# HTTP request headers passed on as gRPC metadata: routing, identity and trace context.
FORWARDED = (
    headers.MODEL_VERSION,
    headers.CANARY_WEIGHT,
    headers.USER_ID,
    headers.TENANT_ID,
    headers.REQUEST_ID,
    headers.PRIORITY,
    headers.AUTHORIZATION,
    headers.TRACEPARENT,
    headers.TRACESTATE,
    headers.BAGGAGE,
)
# gRPC response metadata returned to the HTTP client as headers.
RETURNED = (headers.SERVED_VERSION, headers.MODEL_DYE, headers.DYE_FALLBACK)

Metadata = tuple[tuple[str, str], ...]
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # the end of a call read with read()


def forward(request_headers: Mapping[str, str]) -> Metadata:
    return tuple((name, request_headers[name]) for name in FORWARDED if request_headers.get(name))


def returned(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The response headers to return from an upstream call's initial (or trailing) metadata."""
    out: dict[str, str] = {}
    for key, value in metadata or ():
        if key in RETURNED and isinstance(value, str):
            out[key] = value
    return out


class Upstream:
    """The channel and stubs; created inside the running event loop (grpc.aio binds to it)."""

    def __init__(self, address: str, timeout_s: float, lookahead_bytes: int = 0) -> None:
        self.address = address
        self.timeout_s = timeout_s or None
        # Messages as large as the service accepts (its --max-message-bytes default), not gRPC's 4 MiB.
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        if lookahead_bytes > 0:
            options += [("grpc.http2.lookahead_bytes", lookahead_bytes), ("grpc.http2.bdp_probe", 0)]
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self.inference = inference_grpc.InferenceServiceStub(self.channel)
        self.models = model_grpc.ModelServiceStub(self.channel)
        self.kserve = kserve_grpc.GRPCInferenceServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(None)
