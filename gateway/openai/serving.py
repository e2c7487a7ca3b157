"""OpenAI-compatible endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming with `stream: true`: `data: {chunk}` events, `stream_options.include_usage`, `data:
[DONE]`), errors in OpenAI's error object; the request and response models are protocol.py's.
Generation maps to the sidecar's Generate.

Streams here are not resumable (OpenAI clients do not resume): a disconnect cancels the upstream
call at once.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelyard.common import headers
from modelyard.gateway import errors, http, streaming
from modelyard.gateway.config import Settings
from modelyard.gateway.openai import protocol
from modelyard.gateway.openai.protocol import Chunks, CompletionRequest
from modelyard.gateway.upstream import EOF, Upstream, forward, returned
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2 as model_pb


class OpenAIEndpoints:
    def __init__(self, upstream: Upstream, settings: Settings) -> None:
        self.upstream = upstream
        self.settings = settings

    async def models(self, request: Request) -> Response:
        try:
            listed = await self.upstream.models.ListModels(
                model_pb.ListModelsRequest(),
                metadata=forward(request.headers),
                timeout=self.upstream.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return JSONResponse({"object": "list", "data": [_model_object(m.name) for m in listed.models]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/<model> (the client's models.retrieve): the model object, or 404."""
        name = http.model_name(request.path_params["model"], "model")
        try:
            found = await self.upstream.models.GetModel(
                model_pb.GetModelRequest(name=name),
                metadata=forward(request.headers),
                timeout=self.upstream.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return JSONResponse(_model_object(found.model.name))

    async def completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        return await self._run(protocol.parse_completion(body, request.headers))

    async def chat_completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        return await self._run(protocol.parse_chat_completion(body, request.headers))

    async def _run(self, completion: CompletionRequest) -> Response:
        call = self.upstream.inference.Generate(
            completion.generate, metadata=completion.metadata, timeout=self.upstream.timeout_s
        )
        try:
            first = await call.read()
            served = returned(await call.initial_metadata())
        except grpc.aio.AioRpcError as exc:
            raise _named(errors.from_rpc_error(exc), completion.kind) from None
        except BaseException:
            call.cancel()
            raise
        if first is EOF:
            raise errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended without an answer")
        assert isinstance(first, pb.GenerateResponse)
        served.setdefault(headers.SERVED_VERSION, first.model_version)
        kind = completion.kind
        ident = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + secrets.token_hex(12)
        chunks = Chunks(ident, completion.model, kind, int(time.time()), completion.opening)
        if completion.stream:
            events = _events(chunks, first, call, completion.include_usage)
            return streaming.UpstreamEvents(events, call, served)
        try:
            responses = [first, *[r async for r in _rest(call)]]
        except grpc.aio.AioRpcError as exc:
            raise _named(errors.from_rpc_error(exc), kind) from None
        return JSONResponse(chunks.whole(responses), headers=served)


def _named(exc: errors.HttpError, kind: str) -> errors.HttpError:
    """An upstream error with OpenAI's `param` (the service names the field first in its message)."""
    return replace(exc, param=protocol.param_of(exc, kind))


async def _rest(call: Any) -> AsyncIterator[pb.GenerateResponse]:
    while (response := await call.read()) is not EOF:
        yield response


async def _events(
    chunks: Chunks, first: pb.GenerateResponse, call: Any, include_usage: bool
) -> AsyncIterator[bytes]:
    """The stream's events, from the first response on; a failure is a last error object."""
    response = first
    opened = False
    try:
        while True:
            if response.text or not opened:
                yield protocol.data(chunks.piece(response.text, None, not opened))
                opened = True
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                yield protocol.data(chunks.last(response))
                if include_usage:
                    yield protocol.data(chunks.usage_chunk(response))
                yield protocol.DONE
                return
            response = await call.read()
            if response is EOF:
                raise errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended early")
    except grpc.aio.AioRpcError as exc:
        yield protocol.data(protocol.error_object(errors.from_rpc_error(exc)))
    except errors.HttpError as exc:
        yield protocol.data(protocol.error_object(exc))


def _model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "modelyard"}
