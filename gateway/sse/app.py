"""The SSE API as the gateway mounts it: its routes, and errors in errors.py's body."""

from __future__ import annotations

from starlette.routing import Route

from modelyard.gateway import mount
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.settings import Settings
from modelyard.gateway.sse.serving import GenerateEndpoints
from modelyard.gateway.streams import Registry
from modelyard.gateway.upstream import Upstream

GENERATE = "/v1/models/{model}/generate"


def owns(path: str) -> bool:
    """Paths below a model, /v1/models/<model>/... (mount.below_a_model)."""
    return mount.below_a_model(path)


def api(upstream: Upstream, registry: Registry, settings: Settings, metrics: GatewayMetrics) -> mount.Api:
    generate = GenerateEndpoints(upstream, registry, settings, metrics)
    routes = [
        Route(GENERATE, generate.post, methods=["POST"]),
        Route(GENERATE, generate.get, methods=["GET"]),
    ]
    return mount.Api("sse", owns, routes, mount.error_body)
