"""The SSE API's request model: a generation's fields, from the JSON body (POST) or the query
parameters (GET, for EventSource; numbers parsed by http.query_fields with QUERY_NUMBERS), checked
by the shared intake (gateway/http.py): 422 naming a field that is missing or mistyped, 400 naming
one whose value the field cannot hold.

The answer is a stream of events (gateway/streams.py encodes them): `token` {text, token_ids,
index, model_version}, `done` {finish_reason, usage, time_to_first_token_ms, model_version},
`error` {status, code, reason, message}, each with `id: <stream>:<seq>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelyard.gateway import http
from modelyard.inference.v1 import inference_service_pb2 as pb

# Query parameters that are numbers (the rest are strings; `stop` may repeat).
QUERY_NUMBERS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
    "priority": int,
}


@dataclass(frozen=True, slots=True)
class GenerateParams:
    model: str
    model_version: str
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: list[str]
    priority: int
    seed: int | None
    request_id: str

    def message(self) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            model_name=self.model,
            model_version=self.model_version,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop=self.stop,
            request_id=self.request_id,
            priority=self.priority,
        )
        if self.seed is not None:
            request.seed = self.seed
        return request


def parse_generate(model: str, body: dict[str, Any], request_id: str) -> GenerateParams:
    """The fields of `body` (or the query) for `model`, checked in this order."""
    prompt = http.check_string(http.get_str(body, "prompt", "") or "", "prompt")
    token_ids = body.get("prompt_token_ids")
    token_ids = [] if token_ids is None else http.int_list(token_ids, "prompt_token_ids", http.INT64)
    if not prompt and not token_ids:
        raise http.invalid("prompt", "required (or prompt_token_ids)")
    return GenerateParams(
        model=http.model_name(model, "model"),
        model_version=http.model_version(http.get_str(body, "model_version", "") or "", "model_version"),
        prompt=prompt,
        prompt_token_ids=token_ids,
        max_tokens=http.get_int(body, "max_tokens", http.UINT32),
        temperature=http.get_float(body, "temperature"),
        top_k=http.get_int(body, "top_k", http.UINT32),
        top_p=http.get_float(body, "top_p"),
        stop=[http.check_string(s, "stop") for s in http.get_str_list(body, "stop")],
        priority=http.get_int(body, "priority", http.UINT32),
        seed=http.get_int(body, "seed", http.UINT64) if body.get("seed") is not None else None,
        request_id=request_id,
    )
