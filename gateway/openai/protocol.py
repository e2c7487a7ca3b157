"""The OpenAI API's request and response models.

Requests: `parse_completion` (/v1/completions: `prompt` a string, a list of one string, or token
ids) and `parse_chat_completion` (/v1/chat/completions: `messages`, rendered by chat_template),
each a `CompletionRequest`: the upstream GenerateRequest, the forwarded headers, and how to
answer (streaming, usage). Fields are checked by the shared intake (gateway/http.py), in the
order below; the forwarded headers are checked where OpenAI's sampling fields begin.

Responses: `Chunks` makes OpenAI's objects for one completion (the whole answer, or the stream's
`data: {chunk}` events ending in `data: [DONE]`); errors are OpenAI's error object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import JSONResponse, Response

from modelyard.common import headers, names
from modelyard.common.reasons import ErrorReason
from modelyard.gateway import errors, http
from modelyard.gateway.openai import chat_template
from modelyard.gateway.streams import FINISH_REASONS
from modelyard.gateway.upstream import Metadata, forward, metadata_value
from modelyard.inference.v1 import inference_service_pb2 as pb

TEXT_COMPLETION, CHAT_COMPLETION = "text_completion", "chat.completion"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI's, for an unknown model or path too
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_OPENAI_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "stop"}
# OpenAI's bounds of logit_bias (the service's too): entries, and each bias's magnitude.
MAX_BIASED_TOKENS = 300
MAX_BIAS = 100
_TOKEN_DIGITS = 19  # an int64 token id has at most 19 digits: longer keys are not read
# A message that names its field first ("max_tokens: ..."): the shared intake's and the service's.
# No `-`: a header's name ("x-request-id: ...") is not a request parameter (param stays null).
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def _off(value: Any) -> bool:
    """The value a client sends for a feature it does not use: null, false, 0, "" or empty."""
    if value is None or value is False:
        return True
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, str | list | dict) and not value


# OpenAI parameters this server does not implement: each is accepted at the value that asks for
# nothing (clients send some by default: `frequency_penalty: 0`, `logprobs: false`) and refused
# otherwise with 400 naming it, rather than ignored.
_UNIMPLEMENTED: dict[str, Any] = {
    "logprobs": _off,
    "top_logprobs": _off,
    "echo": _off,
    "suffix": _off,
    "tools": _off,
    "functions": _off,
    "best_of": lambda v: v is None or v == 1,
    "tool_choice": lambda v: v is None or v in ("none", "auto"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    kind: str  # TEXT_COMPLETION or CHAT_COMPLETION: the kind of the response objects
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    generate: pb.GenerateRequest
    metadata: Metadata  # the forwarded headers, and `user` as x-user-id when the header is absent
    opening: str = ""  # the start of the answer the chat template wrote (the content begins with it)


def unsupported(name: str, message: str) -> errors.HttpError:
    """A parameter this server does not implement, at a value that asks for it: 400 naming it."""
    return errors.HttpError(
        400, "INVALID_ARGUMENT", ErrorReason.UNSUPPORTED, f"{name}: {message}", param=name
    )


def parse_completion(body: dict[str, Any], request_headers: Mapping[str, str]) -> CompletionRequest:
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
    return _completion(body, request_headers, fields, TEXT_COMPLETION, DEFAULT_COMPLETION_MAX_TOKENS)


def parse_chat_completion(body: dict[str, Any], request_headers: Mapping[str, str]) -> CompletionRequest:
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
    rendered = chat_template.render(messages)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        # Checked under its own name first, so that a bad value's error names what was sent.
        http.get_int(body, "max_completion_tokens", http.UINT32)
        body["max_tokens"] = body["max_completion_tokens"]
    if body.get("stop") is None:
        body["stop"] = list(rendered.stop)
    completion = _completion(body, request_headers, {"prompt": rendered.prompt}, CHAT_COMPLETION, 0)
    return replace(completion, opening=rendered.opening)


def _completion(
    body: dict[str, Any],
    request_headers: Mapping[str, str],
    fields: dict[str, Any],
    kind: str,
    default_max: int,
) -> CompletionRequest:
    model = http.get_str(body, "model")
    if not model:
        raise http.invalid("model", "required")
    model = http.model_name(model, "model")
    if http.get_int(body, "n", http.INT64, 1, minimum=1) != 1:
        raise unsupported("n", "only n=1 is supported (one choice per request)")
    for name, off in _UNIMPLEMENTED.items():
        if not off(body.get(name)):
            raise unsupported(name, "not supported by this server")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise http.invalid("stream", "must be a boolean")
    options = http.get_dict(body, "stream_options")
    if options and not stream:
        raise errors.HttpError(
            400,
            "INVALID_ARGUMENT",
            ErrorReason.INVALID_ARGUMENT,
            "stream_options: only allowed when stream is true",
            param="stream_options",
        )
    metadata = forward(request_headers)  # 400 before anything starts when a header cannot travel
    include_usage = bool(options.get("include_usage", False))
    generate = pb.GenerateRequest(
        model_name=model,
        max_tokens=http.get_int(body, "max_tokens", http.UINT32, default_max),
        temperature=http.get_float(body, "temperature", 1.0),
        top_p=http.get_float(body, "top_p", 1.0),
        stop=http.get_str_list(body, "stop"),
        request_id=request_headers.get(headers.REQUEST_ID, ""),
        **fields,
    )
    if body.get("seed") is not None:
        generate.seed = http.get_int(body, "seed", http.UINT64)
    generate.frequency_penalty = http.get_float(body, "frequency_penalty", 0.0)
    generate.presence_penalty = http.get_float(body, "presence_penalty", 0.0)
    generate.logit_bias.update(_logit_bias(body))
    # As OpenAI: a prompt plus an asked-for max_tokens over the context is refused, not cut short.
    generate.strict_context = body.get("max_tokens") is not None
    user = http.get_str(body, "user")
    if user and not request_headers.get(headers.USER_ID):
        metadata += ((headers.USER_ID, metadata_value(user, "user")),)
    return CompletionRequest(kind, model, stream, include_usage, generate, metadata)


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids as JSON object keys (strings) -> biases in [-100, 100].
    A key must be a token id written as JSON writes an integer (`"5"`; not `" 5 "`, `"5_0"`,
    `"+5"`, `"05"` or U+0665, which int() would read as 5, 50...); the service then checks the
    ids against the model's vocabulary. Each fault is 400 `invalid_argument`, param `logit_bias`."""
    raw = http.get_dict(body, "logit_bias")
    if len(raw) > MAX_BIASED_TOKENS:
        raise _bias_error(f"at most {MAX_BIASED_TOKENS} tokens, got {len(raw)}")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        token = http.decimal_int(key) if len(key) <= _TOKEN_DIGITS else None
        if token is None or not 0 <= token <= http.INT64[2]:
            raise _bias_error(f"keys must be token ids (decimal integers from 0), got {names.echo(key, 64)}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bias_error(f"the bias of token {token} must be a number")
        # Compared before float(): an int of 400 digits is past a float's range (OverflowError).
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise _bias_error(
                f"the bias of token {token} must be in [-100, 100], got {names.echo(value, 40)}"
            )
        bias[token] = float(value)
    return bias


def _bias_error(message: str) -> errors.HttpError:
    return errors.bad_request(f"logit_bias: {message}", param="logit_bias")


class Chunks:
    """OpenAI's response objects for one completion."""

    def __init__(self, ident: str, model: str, kind: str, created: int, opening: str = "") -> None:
        self.opening = opening  # the chat template's start of the answer: the content begins with it
        self.ident = ident
        self.model = model
        self.kind = kind
        self.chat = kind == CHAT_COMPLETION
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
        text = self.opening + "".join(r.text for r in responses)
        last = responses[-1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish(last), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = self._envelope(self.kind, [choice])
        out["usage"] = usage(last)
        return out

    def piece(self, text: str | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """A streamed chunk: text (the first one opens the assistant's message in chat)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
                text = self.opening + (text or "") if self.opening else text
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text or ""
        return self._envelope("text_completion", [choice])

    def last(self, response: pb.GenerateResponse) -> dict[str, Any]:
        """The streamed chunk that ends the choice (its finish reason, no text)."""
        return self.piece(None if self.chat else "", finish(response), False)

    def usage_chunk(self, response: pb.GenerateResponse) -> dict[str, Any]:
        """The streamed chunk with the usage (stream_options.include_usage): no choices."""
        out = self._envelope(self.kind + ("" if not self.chat else ".chunk"), [])
        out["usage"] = usage(response)
        return out


def finish(response: pb.GenerateResponse) -> str | None:
    if response.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return _OPENAI_FINISH.get(FINISH_REASONS[response.finish_reason], "stop")


def usage(response: pb.GenerateResponse) -> dict[str, int]:
    prompt, completion = response.usage.prompt_tokens, response.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def data(value: dict[str, Any]) -> bytes:
    """One `data: {json}` event."""
    return b"data: " + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def status(exc: errors.HttpError) -> int:
    """OpenAI's status for an error: a missing or mistyped field is 400 there, not 422."""
    return 400 if exc.status == 422 else exc.status


def param_of(exc: errors.HttpError, kind: str = TEXT_COMPLETION) -> str | None:
    """The request field at fault: the error's own, else the one its message names first
    (client errors only); the service's `prompt` is the chat's `messages`."""
    param = exc.param
    if param is None and 400 <= exc.status < 500 and (named := _FIELD.match(exc.message)):
        param = named.group(1)
    if param in ("prompt", "prompt_token_ids"):
        param = "messages" if kind == CHAT_COMPLETION else "prompt"
    return param


def error_object(exc: errors.HttpError) -> dict[str, Any]:
    code = status(exc)
    kind = _ERROR_TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error")
    return {"error": {"message": exc.message, "type": kind, "param": param_of(exc), "code": exc.reason}}


def error_response(exc: errors.HttpError) -> Response:
    return JSONResponse(error_object(exc), status_code=status(exc), headers=exc.headers())
