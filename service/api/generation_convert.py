"""Generate messages (modelyard.inference.v1) <-> the generation plane's request and events."""

from __future__ import annotations

from typing import Any

from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.process.request_metadata import invocation_metadata
from modelyard.service.generation.logprobs import Logprob
from modelyard.service.generation.params import GenerateParams
from modelyard.service.generation.sequence import FinishReason, TokenEvent

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def headers_early(context: Any) -> bool:
    """Whether a Generate stream sends its headers once accepted, before its prefill, rather than
    with its first token: every stream but a sidecar's canary attempt. That one keeps them for its
    first token, so that a fault before it stays a status-only answer, which the sidecar retries
    on stable (it reads a stream that sent headers as one under way)."""
    for key, value in invocation_metadata(context):
        if key == headers.MODEL_DYE:
            return value != headers.DYE_CANARY  # answered by stable if it fails first
    return True


def to_generate_params(request: pb.GenerateRequest) -> GenerateParams:
    return GenerateParams(
        prompt=request.prompt,
        prompt_token_ids=tuple(request.prompt_token_ids),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logit_bias=tuple(request.logit_bias.items()),
        strict_context=request.strict_context,
        messages=tuple((m.role, m.content) for m in request.messages),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        prompt_only=request.prompt_only,
        model_defaults=tuple(request.model_defaults),
    )


def _logprob(entry: Logprob, into: pb.TokenLogprob) -> None:
    into.token_id = entry.token_id
    into.token = entry.token
    if entry.logprob is not None:
        into.logprob = entry.logprob
    for alternative in entry.top:
        _logprob(alternative, into.top_logprobs.add())


def to_generate_response(event: TokenEvent, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        sequence_number=event.index,
        model_version=str(event.version),
        text=event.text,
        token_ids=event.token_ids,
        request_id=request_id,
    )
    for entry in event.logprobs:
        _logprob(entry, response.logprobs.add())
    for entry in event.prompt_logprobs:
        _logprob(entry, response.prompt_logprobs.add())
    if event.finish is not None:
        response.finish_reason = _FINISH[event.finish]
        if event.usage is not None:
            response.usage.prompt_tokens = event.usage.prompt_tokens
            response.usage.completion_tokens = event.usage.completion_tokens
        response.time_to_first_token.FromNanoseconds(round(event.time_to_first_token_s * 1e9))
    return response
