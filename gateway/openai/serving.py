"""OpenAI-compatible endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming with `stream: true`: `data: {chunk}` events, `stream_options.include_usage`, `data:
[DONE]`), errors in OpenAI's error object; the request and response models are protocol.py's.
Generation maps to the sidecar's Generate.

Streams here are not resumable (OpenAI clients do not resume): a disconnect cancels the upstream
call at once.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelyard.common import headers
from modelyard.gateway import errors, http, streamed_response
from modelyard.gateway.openai import protocol
from modelyard.gateway.openai.protocol import Chunks, CompletionRequest
from modelyard.gateway.settings import Settings
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
        return JSONResponse({"object": "list", "data": [_model_object(m) for m in listed.models]})

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
        return JSONResponse(_model_object(found.model))

    async def completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        return await self._run(protocol.parse_completion(body, request.headers))

    async def chat_completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        return await self._run(protocol.parse_chat_completion(body, request.headers))

    async def _run(self, completion: CompletionRequest) -> Response:
        calls = _Calls()
        try:
            # The first choice's call first: a refused request answers before anything else runs,
            # and the other choices are pinned to the version that answered it (one version for
            # the whole completion, whatever a canary's weight).
            first, served = await calls.open(self.upstream, completion.choices[0], completion)
            version = first.model_version
            rest = []
            for request in completion.choices[1:]:
                pinned = pb.GenerateRequest()
                pinned.CopyFrom(request)
                pinned.model_version = version
                rest.append(pinned)
            opened = await asyncio.gather(*(calls.open(self.upstream, r, completion) for r in rest))
        except BaseException:
            calls.cancel()
            raise
        firsts = [first, *(response for response, _ in opened)]
        served.setdefault(headers.SERVED_VERSION, version)
        kind = completion.kind
        ident = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + secrets.token_hex(12)
        chunks = Chunks(
            ident,
            completion.model,
            kind,
            int(time.time()),
            completion.logprobs,
            completion.echo,
            completion.n,
        )
        if completion.stream:
            events = _events(chunks, completion, firsts, calls, completion.include_usage)
            return streamed_response.UpstreamEvents(events, calls, served)
        try:
            answers = await asyncio.gather(
                *(_whole(call, response) for call, response in zip(calls.calls, firsts, strict=True))
            )
        except grpc.aio.AioRpcError as exc:
            calls.cancel()
            raise _named(errors.from_rpc_error(exc), kind) from None
        body = chunks.whole(list(zip(completion.choices, answers, strict=True)))
        return JSONResponse(body, headers=served)


class _Calls:
    """The upstream Generate calls of one completion (one per choice), cancelled together."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def open(
        self, upstream: Upstream, request: pb.GenerateRequest, completion: CompletionRequest
    ) -> tuple[pb.GenerateResponse, dict[str, str]]:
        """Start one choice's call -> its first response and the headers to return."""
        call = upstream.inference.Generate(request, metadata=completion.metadata, timeout=upstream.timeout_s)
        self.calls.append(call)
        try:
            first = await call.read()
            served = returned(await call.initial_metadata())
        except grpc.aio.AioRpcError as exc:
            raise _named(errors.from_rpc_error(exc), completion.kind) from None
        if first is EOF:
            raise errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended without an answer")
        assert isinstance(first, pb.GenerateResponse)
        return first, served

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()


def _named(exc: errors.HttpError, kind: str) -> errors.HttpError:
    """An upstream error with OpenAI's `param` (the service names the field first in its message)."""
    return replace(exc, param=protocol.param_of(exc, kind))


async def _whole(call: Any, first: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    responses = [first]
    while first.finish_reason == pb.FINISH_REASON_UNSPECIFIED and (response := await call.read()) is not EOF:
        responses.append(response)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            break
    return responses


async def _events(
    chunks: Chunks,
    completion: CompletionRequest,
    firsts: list[pb.GenerateResponse],
    calls: _Calls,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The stream's events, every choice's as its upstream responses come; a failure is a last
    error object."""
    choices = [chunks.choice(i, request) for i, request in enumerate(completion.choices)]
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def read(index: int, call: Any) -> None:
        try:
            while (response := await call.read()) is not EOF:
                await queue.put((index, response))
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return
            await queue.put(
                (index, errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended early"))
            )
        except BaseException as exc:
            await queue.put((index, exc))

    ends: list[pb.GenerateResponse | None] = [None] * len(choices)
    readers: list[asyncio.Task[None]] = []
    try:
        for index, first in enumerate(firsts):
            await queue.put((index, first))
        for index, call in enumerate(calls.calls):
            if firsts[index].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                readers.append(asyncio.create_task(read(index, call)))
        while any(end is None for end in ends):
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            assert item is not None
            for chunk in choices[index].pieces(item):
                yield protocol.data(chunk)
            if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                ends[index] = item
        if include_usage:
            finished = [(c.request, end) for c, end in zip(choices, ends, strict=True) if end is not None]
            yield protocol.data(chunks.usage_chunk(protocol.total_usage(finished, chunks.n)))
        yield protocol.DONE
    except grpc.aio.AioRpcError as exc:
        yield protocol.data(protocol.error_object(errors.from_rpc_error(exc)))
    except errors.HttpError as exc:
        yield protocol.data(protocol.error_object(exc))
    finally:
        for reader in readers:
            reader.cancel()
        calls.cancel()


def _model_object(model: model_pb.Model) -> dict[str, object]:
    out: dict[str, object] = {"id": model.name, "object": "model", "created": 0, "owned_by": "modelyard"}
    if model.HasField("generation"):  # a decoder: its context, under vLLM's name for it
        out["max_model_len"] = model.generation.context_length
    return out
