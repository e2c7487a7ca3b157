"""Triton's generate extension (docs/protocol/extension_generate.md) on the decoder models:
`POST /v2/models/{m}[/versions/{v}]/generate` answers one `{"model_name", "model_version",
"text_output"}`; `.../generate_stream` sends one such object per upstream event as
`data: {json}` Server-Sent Events, text in pieces, and `data: {"error": ...}` when the generation
fails after it began. Both map onto the sidecar's Generate.

The request is `{"text_input": ..., "parameters": {...}}`; the sampling fields may stand at the top
level or in `parameters` (Triton passes extra top-level fields on as parameters): `max_tokens`,
`temperature`, `top_k`, `top_p`, `seed`, `stop` (or `stop_words`: a string or a list), and
`stream` (ignored: the URL decides). Any other field is refused, naming it: these models have no
other inputs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelyard.common import headers
from modelyard.gateway import errors, http, streamed_response
from modelyard.gateway.kserve import protocol
from modelyard.gateway.upstream import EOF, Upstream, forward, returned
from modelyard.inference.v1 import inference_service_pb2 as pb

_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_words", "stream"}


def parse_generate(name: str, version: str, body: dict[str, Any], request_id: str) -> pb.GenerateRequest:
    text = body.get("text_input")
    if not isinstance(text, str) or not text:
        raise http.invalid("text_input", "required: the text to continue")
    fields = dict(http.get_dict(body, "parameters"))
    for key, value in body.items():
        if key not in ("text_input", "parameters"):
            fields[key] = value
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise http.invalid(unknown[0], f"not an input or parameter of a decoder model ({known})")
    stop = fields.get("stop", fields.get("stop_words"))
    message = pb.GenerateRequest(
        model_name=name,
        model_version=version,
        prompt=text,
        max_tokens=http.get_int(fields, "max_tokens", http.UINT32),
        temperature=http.get_float(fields, "temperature"),
        top_k=http.get_int(fields, "top_k", http.UINT32),
        top_p=http.get_float(fields, "top_p"),
        stop=http.get_str_list({"stop": stop}, "stop"),
        request_id=request_id,
    )
    if fields.get("seed") is not None:
        message.seed = http.get_int(fields, "seed", http.UINT64)
    # An asked-for max_tokens that the prompt leaves no room for is refused up front (400 naming
    # both numbers), as Triton's LLM backends refuse it; without one the text ends at the context.
    message.strict_context = fields.get("max_tokens") is not None
    return message


class GenerateEndpoints:
    def __init__(self, upstream: Upstream, max_body_bytes: int) -> None:
        self.upstream = upstream
        self.limit = max_body_bytes

    async def generate(self, request: Request) -> Response:
        model, call, first, served = await self._open(request)
        responses = [first]
        try:
            while (response := await call.read()) is not EOF:
                responses.append(response)
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        text = "".join(r.text for r in responses)
        return JSONResponse(_document(model, first, text), headers=served)

    async def generate_stream(self, request: Request) -> Response:
        model, call, first, served = await self._open(request)
        return streamed_response.UpstreamEvents(_events(model, call, first), call, served)

    async def _open(self, request: Request) -> tuple[str, Any, pb.GenerateResponse, dict[str, str]]:
        """The call, its first response and the headers to return: a failure before generation
        begins is an HTTP error status (JSON), as Triton's."""
        model = protocol.parse_model_path(request.path_params)
        metadata = forward(request.headers)
        body = http.parse_object(await protocol.read_body(request, self.limit))
        message = parse_generate(model.name, model.version, body, request.headers.get(headers.REQUEST_ID, ""))
        call = self.upstream.inference.Generate(message, metadata=metadata, timeout=self.upstream.timeout_s)
        try:
            first = await call.read()
            served = returned(await call.initial_metadata())
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        except BaseException:
            call.cancel()
            raise
        if first is EOF:
            raise errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended without an answer")
        assert isinstance(first, pb.GenerateResponse)
        served.setdefault(headers.SERVED_VERSION, first.model_version)
        return model.name, call, first, served


def _document(model: str, response: pb.GenerateResponse, text: str) -> dict[str, str]:
    return {"model_name": model, "model_version": response.model_version, "text_output": text}


def _data(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _events(model: str, call: Any, first: pb.GenerateResponse) -> AsyncIterator[bytes]:
    response: Any = first
    try:
        while response is not EOF:
            if response.text or response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                yield _data(_document(model, response, response.text))
            response = await call.read()
    except grpc.aio.AioRpcError as exc:
        yield _data({"error": errors.from_rpc_error(exc).message})
