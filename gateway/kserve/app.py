"""The KServe V2 REST API as the gateway mounts it: its routes (every path under /v2), and errors
as KServe's `{"error": "<message>"}` (what tritonclient reads), with the code and reason beside it."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelyard.gateway import errors, mount
from modelyard.gateway.kserve.extensions import ExtensionEndpoints
from modelyard.gateway.kserve.generate import GenerateEndpoints
from modelyard.gateway.kserve.serving import KServeEndpoints
from modelyard.gateway.settings import Settings
from modelyard.gateway.upstream import Upstream


def owns(path: str) -> bool:
    return path.startswith("/v2")


def error_response(exc: errors.HttpError) -> Response:
    body = {"error": exc.message, "code": exc.code, "reason": exc.reason}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers())


def _versioned(path: str, endpoint: Any, methods: list[str]) -> list[Route]:
    """A model route and its `/versions/{version}` form."""
    model = "/v2/models/{model}"
    return [
        Route(model + path, endpoint, methods=methods),
        Route(model + "/versions/{version}" + path, endpoint, methods=methods),
    ]


def api(upstream: Upstream, settings: Settings) -> mount.Api:
    kserve = KServeEndpoints(upstream, settings)
    ext = ExtensionEndpoints(kserve.call, upstream, settings.max_body_bytes)
    generate = GenerateEndpoints(upstream, settings.max_body_bytes)
    shm, cuda = "/v2/systemsharedmemory", "/v2/cudasharedmemory"
    routes = [
        Route("/v2/models/stats", ext.stats, methods=["GET"]),  # before /v2/models/{model}
        Route("/v2/health/live", kserve.live, methods=["GET"]),
        Route("/v2/health/ready", kserve.ready, methods=["GET"]),
        Route("/v2", kserve.server_metadata, methods=["GET"]),
        Route("/v2/models/{model}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/infer", kserve.infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", kserve.infer, methods=["POST"]),
        *_versioned("/config", ext.config, ["GET"]),
        *_versioned("/stats", ext.stats, ["GET"]),
        *_versioned("/generate", generate.generate, ["POST"]),
        *_versioned("/generate_stream", generate.generate_stream, ["POST"]),
        Route("/v2/repository/index", ext.index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", ext.load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", ext.unload, methods=["POST"]),
        Route("/v2/logging", ext.logging, methods=["GET", "POST"]),
        Route("/v2/trace/setting", ext.trace, methods=["GET", "POST"]),
        Route("/v2/trace", ext.trace, methods=["GET", "POST"]),
        Route("/v2/models/{model}/trace/setting", ext.trace, methods=["GET", "POST"]),
        Route("/v2/models/{model}/trace", ext.trace, methods=["GET", "POST"]),
        Route(shm + "/status", ext.shm_status, methods=["GET"]),
        Route(shm + "/region/{region}/status", ext.shm_status, methods=["GET"]),
        Route(shm + "/region/{region}/register", ext.shm_register, methods=["POST"]),
        Route(shm + "/unregister", ext.shm_unregister, methods=["POST"]),
        Route(shm + "/region/{region}/unregister", ext.shm_unregister, methods=["POST"]),
        Route(cuda + "/status", ext.cuda_status, methods=["GET"]),
        Route(cuda + "/region/{region}/status", ext.cuda_status, methods=["GET"]),
        Route(cuda + "/region/{region}/register", ext.cuda_register, methods=["POST"]),
        Route(cuda + "/unregister", ext.cuda_unregister, methods=["POST"]),
        Route(cuda + "/region/{region}/unregister", ext.cuda_unregister, methods=["POST"]),
    ]
    return mount.Api("kserve", owns, routes, error_response)
