"""The OpenAI API's request and response models.

Requests: `parse_completion` (/v1/completions: `prompt` a string, token ids, or a list of either)
and `parse_chat_completion` (/v1/chat/completions: `messages`, which the service renders with the
model's own chat template), each a `CompletionRequest`: one upstream GenerateRequest per choice
(`n` per prompt, seeds `seed + j` for choice j), the forwarded headers, and how to answer
(streaming, usage, logprobs, echo). Fields are checked by the shared intake (gateway/http.py), in
the order below; the forwarded headers are checked where OpenAI's sampling fields begin.

Responses: `Chunks` makes OpenAI's objects for one completion (the whole answer, or the stream's
`data: {chunk}` events ending in `data: [DONE]`), logprobs in OpenAI's two shapes (completions':
tokens / token_logprobs / top_logprobs / text_offset; chat's: content [{token, logprob, bytes,
top_logprobs}]); errors are OpenAI's error object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from modelyard.common import headers, names
from modelyard.common.reasons import ErrorReason
from modelyard.gateway import errors, http
from modelyard.gateway.streams import FINISH_REASONS
from modelyard.gateway.upstream import Metadata, forward, metadata_value
from modelyard.inference.v1 import inference_service_pb2 as pb

TEXT_COMPLETION, CHAT_COMPLETION = "text_completion", "chat.completion"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_CHOICES = 64  # n times the prompts of one request: each is an upstream stream
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (chat's top_logprobs; completions' logprobs here too)
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
    generate: pb.GenerateRequest  # the first choice's
    metadata: Metadata  # the forwarded headers, and `user` as x-user-id when the header is absent
    choices: tuple[pb.GenerateRequest, ...] = ()  # every choice's, in OpenAI's index order
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # top alternatives per token when logprobs were asked for
    echo: bool = False  # each choice's text (and logprobs) begins with its prompt


def unsupported(name: str, message: str) -> errors.HttpError:
    """A parameter this server does not implement, at a value that asks for it: 400 naming it."""
    return errors.HttpError(
        400, "INVALID_ARGUMENT", ErrorReason.UNSUPPORTED, f"{name}: {message}", param=name
    )


def parse_completion(body: dict[str, Any], request_headers: Mapping[str, str]) -> CompletionRequest:
    prompt = body.get("prompt")
    prompts: list[dict[str, Any]] = []
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise http.invalid("prompt", "must be a string, token ids, or a list of strings or of token id lists")
    for one in prompt:
        if isinstance(one, str):
            prompts.append({"prompt": one})
        elif (
            isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) for t in one)
        ):
            prompts.append({"prompt_token_ids": http.int_list(one, "prompt", http.INT64)})
        else:
            raise http.invalid(
                "prompt", "must be a string, token ids, or a list of strings or of token id lists"
            )
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise http.invalid("echo", "must be a boolean")
    return _completion(body, request_headers, prompts, TEXT_COMPLETION, DEFAULT_COMPLETION_MAX_TOKENS)


def parse_chat_completion(body: dict[str, Any], request_headers: Mapping[str, str]) -> CompletionRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise http.invalid("messages", "must be a non-empty list of {role, content} objects")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise http.invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and message["role"] == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(t for t in texts if isinstance(t, str))
        if not isinstance(content, str):
            raise http.invalid(f"messages[{i}].content", "must be a string")
        conversation.append(pb.ChatMessage(role=message["role"], content=content))
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        # Checked under its own name first, so that a bad value's error names what was sent.
        http.get_int(body, "max_completion_tokens", http.UINT32)
        body["max_tokens"] = body["max_completion_tokens"]
    if body.get("echo") is not None:
        raise unsupported("echo", "only /v1/completions echoes its prompt")
    # The service renders the messages with the model's template, and applies the model's
    # chat_stop when the client sends no stop sequences.
    return _completion(body, request_headers, [{"messages": conversation}], CHAT_COMPLETION, 0)


def _top_logprobs(body: dict[str, Any], kind: str) -> int | None:
    """The alternatives per token the client asks for, None when it asks for no logprobs:
    completions' `logprobs: N`; chat's `logprobs: true` with `top_logprobs: N`."""
    if kind == TEXT_COMPLETION:
        if body.get("top_logprobs") is not None:
            raise unsupported("top_logprobs", "a chat parameter: completions take logprobs: N")
        if body.get("logprobs") is None or body.get("logprobs") is False:
            return None
        if body.get("logprobs") is True:
            raise http.invalid("logprobs", "completions take an integer (the alternatives per token)")
        return _at_most(http.get_int(body, "logprobs", http.UINT32), "logprobs")
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise http.invalid("logprobs", "must be a boolean (top_logprobs gives the alternatives)")
    top = _at_most(http.get_int(body, "top_logprobs", http.UINT32), "top_logprobs")
    if top and not wanted:
        raise http.invalid("top_logprobs", "needs logprobs: true")
    return top if wanted else None


def _at_most(value: int, name: str) -> int:
    if value > MAX_TOP_LOGPROBS:
        raise http.invalid(name, f"at most {MAX_TOP_LOGPROBS} alternatives per token, got {value}")
    return value


def _completion(
    body: dict[str, Any],
    request_headers: Mapping[str, str],
    prompts: list[dict[str, Any]],
    kind: str,
    default_max: int,
) -> CompletionRequest:
    model = http.get_str(body, "model")
    if not model:
        raise http.invalid("model", "required")
    model = http.model_name(model, "model")
    n = http.get_int(body, "n", http.INT64, 1, minimum=1)
    if n * len(prompts) > MAX_CHOICES:
        raise http.invalid("n", f"at most {MAX_CHOICES} choices a request (n times the prompts)")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1 and best_of != n:
        raise unsupported("best_of", "only best_of equal to n (every choice is returned)")
    logprobs = _top_logprobs(body, kind)
    echo = body.get("echo") is True
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
    max_tokens = http.get_int(body, "max_tokens", http.UINT32, default_max)
    generate = pb.GenerateRequest(
        model_name=model,
        max_tokens=max_tokens,
        temperature=http.get_float(body, "temperature", 1.0),
        top_p=http.get_float(body, "top_p", 1.0),
        stop=http.get_str_list(body, "stop"),
        request_id=request_headers.get(headers.REQUEST_ID, ""),
    )
    # Sampling values the client leaves out are the model's (generation_config.json), as vLLM's;
    # OpenAI's defaults (temperature 1, top_p 1) where the model states none.
    generate.model_defaults.extend(name for name in ("temperature", "top_p") if body.get(name) is None)
    seed = http.get_int(body, "seed", http.UINT64) if body.get("seed") is not None else None
    generate.frequency_penalty = http.get_float(body, "frequency_penalty", 0.0)
    generate.presence_penalty = http.get_float(body, "presence_penalty", 0.0)
    generate.logit_bias.update(_logit_bias(body))
    # As OpenAI: a prompt plus an asked-for max_tokens over the context is refused, not cut short.
    generate.strict_context = body.get("max_tokens") is not None
    if logprobs is not None:
        generate.logprobs = True
        generate.top_logprobs = logprobs
    if echo and max_tokens == 0 and body.get("max_tokens") is not None:
        generate.prompt_only = True  # lm-evaluation-harness's scoring: the prompt's logprobs only
    user = http.get_str(body, "user")
    if user and not request_headers.get(headers.USER_ID):
        metadata += ((headers.USER_ID, metadata_value(user, "user")),)
    choices = []
    for fields in prompts:
        for j in range(n):
            choice = pb.GenerateRequest()
            choice.CopyFrom(generate)
            if "messages" in fields:
                choice.messages.extend(fields["messages"])
            elif "prompt" in fields:
                choice.prompt = fields["prompt"]
            else:
                choice.prompt_token_ids.extend(fields["prompt_token_ids"])
            # The prompt's own tokens come back when echoed with logprobs, or to echo token ids.
            choice.prompt_logprobs = echo and (logprobs is not None or "prompt_token_ids" in fields)
            if choice.prompt_logprobs:
                choice.top_logprobs = logprobs or 0
            if seed is not None:
                choice.seed = (seed + j) % 2**64  # independent choices, each reproducible
            choices.append(choice)
    return CompletionRequest(
        kind,
        model,
        stream,
        include_usage,
        choices[0],
        metadata,
        tuple(choices),
        n,
        logprobs,
        echo,
    )


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
    """OpenAI's response objects for one completion: its choices, whole or streamed."""

    def __init__(
        self,
        ident: str,
        model: str,
        kind: str,
        created: int,
        logprobs: int | None = None,
        echo: bool = False,
        n: int = 1,
    ) -> None:
        self.n = n  # choices per prompt (their usage counts the prompt once)
        self.ident = ident
        self.model = model
        self.kind = kind
        self.chat = kind == CHAT_COMPLETION
        self.created = created
        self.logprobs = logprobs  # None: no logprobs asked for
        self.echo = echo

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(self, index: int, request: pb.GenerateRequest) -> Choice:
        return Choice(self, index, request)

    def whole(self, answers: list[tuple[pb.GenerateRequest, list[pb.GenerateResponse]]]) -> dict[str, Any]:
        choices = []
        for index, (request, responses) in enumerate(answers):
            state = self.choice(index, request)
            text, logprobs = "", Logprobs(self.chat)
            for response in responses:
                piece, entries = state.take(response)
                text += piece
                logprobs.extend(entries)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": finish(responses[-1]),
                "logprobs": logprobs.whole() if self.logprobs is not None else None,
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        out = self._envelope(self.kind, choices)
        out["usage"] = total_usage([(request, responses[-1]) for request, responses in answers], self.n)
        return out

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        """The streamed chunk with the usage (stream_options.include_usage): no choices."""
        out = self._envelope(self.kind + ("" if not self.chat else ".chunk"), [])
        out["usage"] = usage_
        return out


class Logprobs:
    """One choice's logprobs in OpenAI's shape for its API, built from the service's entries."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.entries: list[pb.TokenLogprob] = []
        self.offset = 0  # completions' text_offset: characters of the choice's text before a token

    def extend(self, entries: list[pb.TokenLogprob]) -> None:
        self.entries.extend(entries)

    def whole(self) -> dict[str, Any]:
        return self.part(self.entries, reset=True)

    def part(self, entries: list[pb.TokenLogprob], reset: bool = False) -> dict[str, Any]:
        if self.chat:
            return {"content": [_chat_entry(e, top=True) for e in entries], "refusal": None}
        if reset:
            self.offset = 0
        offsets = []
        for entry in entries:
            offsets.append(self.offset)
            self.offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if e.HasField("logprob") else None for e in entries],
            # The top alternatives and the chosen token (OpenAI: up to logprobs + 1 entries).
            "top_logprobs": [_top_dict(e) if e.HasField("logprob") else None for e in entries],
            "text_offset": offsets,
        }


def _top_dict(entry: pb.TokenLogprob) -> dict[str, float]:
    top = {t.token: t.logprob for t in entry.top_logprobs}
    top.setdefault(entry.token, entry.logprob)
    return top


def _chat_entry(entry: pb.TokenLogprob, top: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
    }
    if top:
        out["top_logprobs"] = [_chat_entry(t) for t in entry.top_logprobs]
    return out


class Choice:
    """One choice of a completion, as its upstream stream's responses come."""

    def __init__(self, chunks: Chunks, index: int, request: pb.GenerateRequest) -> None:
        self.chunks = chunks
        self.index = index
        self.request = request
        self.opened = False
        self.logprobs = Logprobs(chunks.chat)

    def take(self, response: pb.GenerateResponse) -> tuple[str, list[pb.TokenLogprob]]:
        """A response's text and logprob entries, the echoed prompt before the first one's."""
        text = response.text
        entries: list[pb.TokenLogprob] = list(response.logprobs)
        if not self.opened and self.chunks.echo:
            prompt = list(response.prompt_logprobs)
            echoed = self.request.prompt or "".join(e.token for e in prompt)
            text = echoed + text
            if self.chunks.logprobs is not None:
                entries = prompt + entries
        self.opened = True
        return text, entries

    def pieces(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The streamed chunks of one upstream response: its text (the first one opens the
        assistant's message in chat), then the finish reason when it is the last."""
        first = not self.opened
        text, entries = self.take(response)
        out = []
        if text or first or entries:
            out.append(self._chunk(text, None, first, entries))
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            out.append(self._chunk(None if self.chunks.chat else "", finish(response), False, []))
        return out

    def _chunk(
        self, text: str | None, finish_reason: str | None, first: bool, entries: list[pb.TokenLogprob]
    ) -> dict[str, Any]:
        logprobs = self.logprobs.part(entries) if self.chunks.logprobs is not None and entries else None
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chunks.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            return self.chunks._envelope("chat.completion.chunk", [choice])
        choice["text"] = text or ""
        return self.chunks._envelope("text_completion", [choice])


def total_usage(ends: list[tuple[pb.GenerateRequest, pb.GenerateResponse]], n: int) -> dict[str, int]:
    """A completion's usage: each prompt counted once (its n choices share it), every choice's
    completion tokens."""
    prompt = sum(response.usage.prompt_tokens for i, (_, response) in enumerate(ends) if i % n == 0)
    completion = sum(response.usage.completion_tokens for _, response in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish(response: pb.GenerateResponse) -> str | None:
    if response.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return _OPENAI_FINISH.get(FINISH_REASONS[response.finish_reason], "stop")


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
