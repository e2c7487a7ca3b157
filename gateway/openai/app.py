"""The OpenAI-compatible API as the gateway mounts it: its routes, and errors in OpenAI's error object."""

from __future__ import annotations

from starlette.routing import Route

from gateway import mount
from gateway.config import Settings
from gateway.openai.serving import OpenAIEndpoints, error_response, is_openai_path
from gateway.upstream import Upstream


def api(upstream: Upstream, settings: Settings) -> mount.Api:
    openai = OpenAIEndpoints(upstream, settings)
    routes = [
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    ]
    return mount.Api("openai", is_openai_path, routes, error_response)
