"""The composition root: `build_gateway(settings)` wires the upstream channel, the stream registry,
the endpoints and the HTTP server; `Gateway` is the process that run_process drives."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from pathlib import Path

import uvicorn
from modelyard.common.reasons import ErrorReason
from modelyard.common.settings import split_address
from modelyard.common.tls import TlsFiles, warn_if_plaintext
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.config import Settings
from gateway.kserve import serving as kserve_rest
from gateway.listener import Limits, protocol_class
from gateway.metrics import GatewayMetrics
from gateway.openai import serving as openai_api
from gateway.sse.serving import GenerateEndpoints
from gateway.streams import Registry
from gateway.tls import UpstreamTls, listener_context
from gateway.upstream import Upstream

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


def build_app(
    settings: Settings, upstream: Upstream, registry: Registry, metrics: GatewayMetrics
) -> Starlette:
    generate = GenerateEndpoints(upstream, registry, settings, metrics)
    openai = openai_api.OpenAIEndpoints(upstream, settings)
    kserve = kserve_rest.KServeEndpoints(upstream, settings)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def index(request: Request) -> Response:
        return RedirectResponse("/static/index.html")

    routes: list[BaseRoute] = [
        Route("/v1/models/{model}/generate", generate.post, methods=["POST"]),
        Route("/v1/models/{model}/generate", generate.get, methods=["GET"]),
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v2/health/live", kserve.live, methods=["GET"]),
        Route("/v2/health/ready", kserve.ready, methods=["GET"]),
        Route("/v2", kserve.server_metadata, methods=["GET"]),
        Route("/v2/models/{model}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}", kserve.model_metadata, methods=["GET"]),
        Route("/v2/models/{model}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", kserve.model_ready, methods=["GET"]),
        Route("/v2/models/{model}/infer", kserve.infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", kserve.infer, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/healthz", live, methods=["GET"]),
    ]
    if STATIC.is_dir():
        routes += [Route("/", index, methods=["GET"]), Mount("/static", StaticFiles(directory=STATIC))]
    app = Starlette(
        routes=routes,
        exception_handlers={
            errors.HttpError: _error_response,  # type: ignore[dict-item]
            HTTPException: _starlette_error,  # type: ignore[dict-item]  # no route (404), wrong method (405)
        },
    )
    app.add_middleware(_Counted, metrics=metrics)
    return app


async def _error_response(request: Request, exc: errors.HttpError) -> Response:
    if openai_api.is_openai_path(request.url.path):
        return openai_api.error_response(exc)
    if request.url.path.startswith("/v2"):  # KServe V2: {"error": "<message>"}, as tritonclient reads it
        body = {"error": exc.message, "code": exc.code, "reason": exc.reason}
        return JSONResponse(body, status_code=exc.status, headers=exc.headers())
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _starlette_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own answers (no such route, a method a route lacks) in the same error body."""
    code = "NOT_FOUND" if exc.status_code == 404 else "UNIMPLEMENTED"
    error = errors.HttpError(exc.status_code, code, ErrorReason.UNSUPPORTED, f"{request.method} {exc.detail}")
    if exc.status_code < 400 or exc.status_code >= 500:
        error = errors.HttpError(exc.status_code, code, ErrorReason.INTERNAL, str(exc.detail))
    return await _error_response(request, error)


class _Counted:
    """Counts answers by route template and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(getattr(scope.get("route"), "path", "other"), message["status"])
            await send(message)

        await self.app(scope, receive, counting)


class Gateway:
    """The gateway process: an HTTP server (uvicorn) over one gRPC channel to the sidecar."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.registry = Registry(
            settings.resume_window_s,
            settings.resume_buffer_events,
            settings.max_streams,
            self.metrics,
            settings.resume_buffer_bytes,
        )
        self.upstream: Upstream | None = None
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self._main: asyncio.Task[None] | None = None
        self.address = ""
        # ValueError here (half a certificate pair) stops the process before it binds anything.
        self.tls = TlsFiles.from_settings(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        self.upstream_tls = UpstreamTls.of(settings)

    async def start(self) -> None:
        settings = self.settings
        self.upstream = Upstream(
            settings.upstream,
            settings.upstream_timeout_s,
            settings.upstream_lookahead_bytes,
            self.upstream_tls,
        )
        app = build_app(settings, self.upstream, self.registry, self.metrics)
        host, port = split_address(settings.listen)
        warn_if_plaintext(host, "the gateway's HTTP listener", self.tls)
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        # Accepted connections inherit it (Linux): small SSE writes go out at once, not after the
        # peer's delayed ACK (Nagle), which would add tens of ms to time to first token.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket = sock
        limits = Limits(
            settings.idle_timeout_s,
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_header_bytes,
            settings.write_stall_timeout_s,
        )
        config = uvicorn.Config(
            app,
            # httptools with the guard uvicorn lacks: idle, header and body deadlines, a header bound.
            http=protocol_class(limits),
            ws="none",  # no WebSocket routes: an Upgrade is a plain request (and the guard stays on)
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(max(1, settings.grace_s)),
            # uvicorn's own keep-alive timer, never before the guard's idle deadline.
            timeout_keep_alive=max(1, math.ceil(settings.idle_timeout_s or 3600)),
            limit_concurrency=settings.max_connections or None,
        )
        config.load()
        # Set after load(): uvicorn would build a fixed context from file names; ours follows the files.
        config.ssl = listener_context(self.tls) if self.tls is not None else None
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server = server
        self._main = asyncio.get_running_loop().create_task(server.main_loop())
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        log.info(
            "serving HTTP on %s (metrics at /metrics); upstream %s%s;",
            self.url,
            settings.upstream,
            " over TLS" if self.upstream_tls is not None else "",
        )

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.address}"

    async def stop(self) -> None:
        # Open streams end with an `event: error` (draining) so connections close, then the server drains.
        self.registry.close()
        if self._server is not None:
            self._server.should_exit = True
            if self._main is not None:
                await self._main
            await self._server.shutdown(sockets=[self._socket] if self._socket else None)
        if self.upstream is not None:
            await self.upstream.close()


def build_gateway(settings: Settings) -> Gateway:
    return Gateway(settings)
