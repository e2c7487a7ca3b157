"""OpenAI-compatible endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming with `stream: true`: `data: {chunk}` events, `stream_options.include_usage`, `data:
[DONE]`), errors in OpenAI's error object. Generation maps to the sidecar's Generate; chat prompts
come from chat_template.render.

Streams here are not resumable (OpenAI clients do not resume): a disconnect cancels the upstream
call at once.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2 as model_pb
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway import errors, http, streaming
from gateway.config import Settings
from gateway.openai import chat_template
from gateway.streams import FINISH_REASONS
from gateway.upstream import EOF, Upstream, forward, metadata_value, returned

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def is_openai_path(path: str) -> bool:
    """Errors on these paths use OpenAI's error object (the generate endpoints use errors.py's)."""
    return path.rstrip("/") in PATHS


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_OPENAI_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "stop"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def error_object(exc: errors.HttpError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.reason}}


def error_response(exc: errors.HttpError) -> Response:
    return JSONResponse(error_object(exc), status_code=exc.status, headers=exc.headers())


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
        data = [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "modelyard"} for m in listed.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        fields: dict[str, Any] = {}
        if isinstance(prompt, str):
            fields["prompt"] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            fields["prompt_token_ids"] = http.int_list(prompt, "prompt", http.INT64)
        else:
            raise http.invalid("prompt", "must be a string, a list of one string, or a list of token ids")
        return await self._run(request, body, fields, "text_completion", DEFAULT_COMPLETION_MAX_TOKENS)

    async def chat_completions(self, request: Request) -> Response:
        body = await http.read_json(request, self.settings.max_body_bytes)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise http.invalid("messages", "must be a non-empty list of {role, content} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in chat_template.ROLES:
                raise http.invalid(f"messages[{i}].role", f"must be one of {', '.join(chat_template.ROLES)}")
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                content = "".join(t for t in texts if isinstance(t, str))
            if not isinstance(content, str):
                raise http.invalid(f"messages[{i}].content", "must be a string")
            message["content"] = content
        fields = {"prompt": chat_template.render(messages)}
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
            body["max_tokens"] = body["max_completion_tokens"]
        return await self._run(request, body, fields, "chat.completion", 0)

    async def _run(
        self, request: Request, body: dict[str, Any], fields: dict[str, Any], kind: str, default_max: int
    ) -> Response:
        model = http.get_str(body, "model")
        if not model:
            raise http.invalid("model", "required")
        model = http.model_name(model, "model")
        if http.get_int(body, "n", http.INT64, 1, minimum=1) != 1:
            raise http.invalid("n", "only n=1 is supported")
        if body.get("logprobs"):
            raise http.invalid("logprobs", "not supported")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise http.invalid("stream", "must be a boolean")
        options = http.get_dict(body, "stream_options")
        metadata = forward(request.headers)  # 400 before anything starts when a header cannot travel
        include_usage = bool(options.get("include_usage", False))
        generate = pb.GenerateRequest(
            model_name=model,
            max_tokens=http.get_int(body, "max_tokens", http.UINT32, default_max),
            temperature=http.get_float(body, "temperature", 1.0),
            top_p=http.get_float(body, "top_p", 1.0),
            stop=http.get_str_list(body, "stop"),
            request_id=request.headers.get(headers.REQUEST_ID, ""),
            **fields,
        )
        if body.get("seed") is not None:
            generate.seed = http.get_int(body, "seed", http.UINT64)
        user = http.get_str(body, "user")
        if user and not request.headers.get(headers.USER_ID):
            metadata += ((headers.USER_ID, metadata_value(user, "user")),)
        call = self.upstream.inference.Generate(generate, metadata=metadata, timeout=self.upstream.timeout_s)
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
        ident = ("chatcmpl-" if kind.startswith("chat") else "cmpl-") + secrets.token_hex(12)
        chunks = _Chunks(ident, model, kind, int(time.time()))
        if stream:
            events = chunks.stream(first, call, include_usage)
            return _EventStream(events, call, {**streaming.EVENT_STREAM_HEADERS, **served})
        try:
            responses = [first, *[r async for r in _rest(call)]]
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return JSONResponse(chunks.whole(responses), headers=served)


async def _rest(call: Any) -> AsyncIterator[pb.GenerateResponse]:
    while (response := await call.read()) is not EOF:
        yield response


class _Chunks:
    """OpenAI's response objects for one completion."""

    def __init__(self, ident: str, model: str, kind: str, created: int) -> None:
        self.ident = ident
        self.model = model
        self.kind = kind
        self.chat = kind == "chat.completion"
        self.created = created

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, responses: list[pb.GenerateResponse]) -> dict[str, Any]:
        text = "".join(r.text for r in responses)
        last = responses[-1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(last), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = self._envelope(self.kind, [choice])
        out["usage"] = _usage(last)
        return out

    def _piece(self, text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text or ""
        return self._envelope("text_completion", [choice])

    async def stream(
        self, first: pb.GenerateResponse, call: Any, include_usage: bool
    ) -> AsyncIterator[bytes]:
        response = first
        opened = False
        try:
            while True:
                if response.text or not opened:
                    yield _data(self._piece(response.text, None, not opened))
                    opened = True
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    yield _data(self._piece(None if self.chat else "", _finish(response), False))
                    if include_usage:
                        usage = self._envelope(self.kind + ("" if not self.chat else ".chunk"), [])
                        usage["usage"] = _usage(response)
                        yield _data(usage)
                    yield b"data: [DONE]\n\n"
                    return
                response = await call.read()
                if response is EOF:
                    raise errors.HttpError(502, "INTERNAL", "internal", "the upstream stream ended early")
        except grpc.aio.AioRpcError as exc:
            yield _data(error_object(errors.from_rpc_error(exc)))
        except errors.HttpError as exc:
            yield _data(error_object(exc))


def _finish(response: pb.GenerateResponse) -> str | None:
    if response.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return _OPENAI_FINISH.get(FINISH_REASONS[response.finish_reason], "stop")


def _usage(response: pb.GenerateResponse) -> dict[str, int]:
    prompt, completion = response.usage.prompt_tokens, response.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _data(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(Response):
    """Writes `events`; when the client disconnects the writer stops and the upstream call is cancelled."""

    def __init__(self, events: AsyncIterator[bytes], call: Any, response_headers: dict[str, str]) -> None:
        self.events = events
        self.call = call
        self.response_headers = response_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await streaming.stream(send, receive, self.response_headers, self._write)
        finally:
            self.call.cancel()

    async def _write(self, write: streaming.Write) -> None:
        async for chunk in self.events:
            await write(chunk)
