"""KServe V2 / Open Inference Protocol over REST, mapped onto the sidecar's KServe gRPC service:
`/v2/health/live|ready`, `/v2`, `/v2/models/{m}[/versions/{v}]`, `.../ready`, `.../infer`; the
request and response models are protocol.py's, the tensor element codec tensors.py's; Triton's
extensions are extensions.py's and generate.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelyard.gateway import errors, http
from modelyard.gateway.kserve import protocol
from modelyard.gateway.settings import Settings
from modelyard.gateway.upstream import Upstream, forward, returned
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

# The upstream's extensions this API serves over REST: the ones with routes here (extensions.py)
# and the ones that are fields of an infer request (classification, schedule_policy, sequence's
# parameters). Not cuda_shared_memory (no REST routes here).
REST_EXTENSIONS = (
    "classification",
    "sequence",
    "model_repository",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "trace",
    "logging",
)
# And the gateway's own: the binary tensor data layout of REST bodies, and generate (decoders).
GATEWAY_EXTENSIONS = ("binary_tensor_data", "generate")


def served_extensions(upstream: Sequence[str]) -> list[str]:
    return [e for e in upstream if e in REST_EXTENSIONS] + list(GATEWAY_EXTENSIONS)


class KServeEndpoints:
    def __init__(self, upstream: Upstream, settings: Settings) -> None:
        self.upstream = upstream
        self.settings = settings

    async def call(self, method: Any, message: Any, request: Request) -> Any:
        try:
            return await method(message, metadata=forward(request.headers), timeout=self.upstream.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None

    async def live(self, request: Request) -> Response:
        answer = await self.call(self.upstream.kserve.ServerLive, kpb.ServerLiveRequest(), request)
        return JSONResponse({"live": answer.live}, status_code=200 if answer.live else 503)

    async def ready(self, request: Request) -> Response:
        answer = await self.call(self.upstream.kserve.ServerReady, kpb.ServerReadyRequest(), request)
        return JSONResponse({"ready": answer.ready}, status_code=200 if answer.ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        answer = await self.call(self.upstream.kserve.ServerMetadata, kpb.ServerMetadataRequest(), request)
        extensions = served_extensions(answer.extensions)
        return JSONResponse({"name": answer.name, "version": answer.version, "extensions": extensions})

    async def model_metadata(self, request: Request) -> Response:
        model = protocol.parse_model_path(request.path_params)
        asked = kpb.ModelMetadataRequest(name=model.name, version=model.version)
        answer = await self.call(self.upstream.kserve.ModelMetadata, asked, request)
        return JSONResponse(protocol.model_metadata(answer))

    async def model_ready(self, request: Request) -> Response:
        model = protocol.parse_model_path(request.path_params)
        asked = kpb.ModelReadyRequest(name=model.name, version=model.version)
        answer = await self.call(self.upstream.kserve.ModelReady, asked, request)
        return JSONResponse(
            {"name": model.name, "ready": answer.ready}, status_code=200 if answer.ready else 503
        )

    async def infer(self, request: Request) -> Response:
        model = protocol.parse_model_path(request.path_params)
        metadata = forward(request.headers)
        body = await protocol.read_body(request, self.settings.max_body_bytes)
        head, binary = protocol.split_body(body, request.headers.get(protocol.HEADER_LENGTH))
        if len(head) > http.OFF_LOOP_BYTES:  # parse and encode large JSON tensors off the loop
            infer = await asyncio.to_thread(protocol.parse_infer, model.name, model.version, head, binary)
        else:
            infer = protocol.parse_infer(model.name, model.version, head, binary)
        call = self.upstream.kserve.ModelInfer(
            infer.message, metadata=metadata, timeout=self.upstream.timeout_s
        )
        try:
            answer = await call
            # A unary answer: x-served-version is in its trailing metadata (docs/api.md).
            served = returned(await call.initial_metadata(), await call.trailing_metadata())
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return protocol.infer_response(answer, infer.binary_outputs, served, infer.shm_outputs)
