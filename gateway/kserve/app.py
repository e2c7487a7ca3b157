"""The KServe V2 REST API as the gateway mounts it: its routes (every path under /v2), and errors
as KServe's `{"error": "<message>"}` (what tritonclient reads), with the code and reason beside it."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelyard.gateway import errors, mount
from modelyard.gateway.config import Settings
from modelyard.gateway.kserve.serving import KServeEndpoints
from modelyard.gateway.upstream import Upstream


def owns(path: str) -> bool:
    return path.startswith("/v2")


def error_response(exc: errors.HttpError) -> Response:
    body = {"error": exc.message, "code": exc.code, "reason": exc.reason}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers())


def api(upstream: Upstream, settings: Settings) -> mount.Api:
    kserve = KServeEndpoints(upstream, settings)
    routes = [
        Route("/v2/health/live", kserve.live, methods=["GET"]),
        Route("/v2/health/ready", kserve.ready, methods=["GET"]),
        Route("/v2", kserve.server_metadata, methods=["GET"]),
        Route("/v2/models/{model}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/infer", kserve.infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", kserve.infer, methods=["POST"]),
    ]
    return mount.Api("kserve", owns, routes, error_response)
