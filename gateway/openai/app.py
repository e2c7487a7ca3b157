"""The OpenAI-compatible API as the gateway mounts it: its routes, and errors in OpenAI's error object."""

from __future__ import annotations

from starlette.routing import Route

from modelyard.gateway import mount
from modelyard.gateway.config import Settings
from modelyard.gateway.openai.protocol import error_response
from modelyard.gateway.openai.serving import OpenAIEndpoints
from modelyard.gateway.upstream import Upstream

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def owns(path: str) -> bool:
    """These paths (and their trailing-slash forms) answer in OpenAI's error object."""
    return path.rstrip("/") in PATHS


def api(upstream: Upstream, settings: Settings) -> mount.Api:
    openai = OpenAIEndpoints(upstream, settings)
    routes = [
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    ]
    return mount.Api("openai", owns, routes, error_response)
