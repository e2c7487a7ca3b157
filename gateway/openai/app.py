"""The OpenAI-compatible API as the gateway mounts it: its routes, and errors in OpenAI's error object."""

from __future__ import annotations

from starlette.routing import Route

from modelyard.gateway import mount
from modelyard.gateway.openai.protocol import error_response
from modelyard.gateway.openai.serving import OpenAIEndpoints
from modelyard.gateway.settings import Settings
from modelyard.gateway.upstream import Upstream


def owns(path: str) -> bool:
    """Every path under /v1 but the SSE API's answers in OpenAI's error object, an unknown one
    too (404 `invalid_request_error`, as OpenAI's)."""
    return (path == "/v1" or path.startswith("/v1/")) and not mount.below_a_model(path)  # SSE's


def api(upstream: Upstream, settings: Settings) -> mount.Api:
    openai = OpenAIEndpoints(upstream, settings)
    routes = [
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/models/{model}", openai.model, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    ]
    return mount.Api("openai", owns, routes, error_response)
