"""The composition root: `build_gateway(settings)` wires the upstream channel, the stream registry,
the APIs (one sub-application each: sse, openai, kserve) and the HTTP server; `Gateway` is the
process that run_process drives."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.common import headers
from modelyard.gateway import mount, origin
from modelyard.gateway.kserve import app as kserve_app
from modelyard.gateway.listener import Limits, protocol_class
from modelyard.gateway.metrics import GatewayMetrics, metrics_app
from modelyard.gateway.openai import app as openai_app
from modelyard.gateway.settings import ENV_PREFIX, Settings
from modelyard.gateway.sse import app as sse_app
from modelyard.gateway.streams import Registry
from modelyard.gateway.tls import UpstreamTls, listener_context
from modelyard.gateway.upstream import Upstream
from modelyard.process import calls
from modelyard.process.lifecycle import bound
from modelyard.process.metrics_http import HttpServer
from modelyard.process.settings import split_address
from modelyard.process.tls import TlsFiles, warn_if_plaintext

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


def build_app(
    settings: Settings, upstream: Upstream, registry: Registry, metrics: GatewayMetrics
) -> Starlette:
    async def live(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def index(request: Request) -> Response:
        return RedirectResponse("/static/index.html")

    async def favicon(request: Request) -> Response:  # browsers and tools ask for it at the root
        return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon")

    # One sub-application per API, each owning its own paths and answering errors in its
    # protocol's body; the rest (health, the page) is the root's. /metrics is on --metrics-listen.
    routes: list[BaseRoute] = [
        openai_app.api(upstream, settings),
        sse_app.api(upstream, registry, settings, metrics),
        kserve_app.api(upstream, settings),
        Route("/healthz", live, methods=["GET"]),
    ]
    if STATIC.is_dir():
        routes += [
            Route("/", index, methods=["GET"]),
            Route("/favicon.ico", favicon, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC)),
        ]
    # No route (404), a wrong method (405) or an error outside the APIs: errors.py's body.
    app = Starlette(routes=routes, exception_handlers=mount.error_handlers(mount.error_body))
    # Innermost (added first): its refusals are counted and logged like any answer.
    app.add_middleware(origin.CrossSiteGuard)
    app.add_middleware(_Counted, metrics=metrics)
    if settings.access_log or settings.log_format == "json":
        app.add_middleware(_Logged, access=settings.access_log)
    return app


class _Logged:
    """Each request's context for its log lines (method and path, request_id, model, version from the
    route) and, with --access-log, its access line when the response ends (an SSE stream: at its end)."""

    def __init__(self, app: ASGIApp, access: bool) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k == headers.REQUEST_ID.encode()), ""
        )
        status, reason = [0], [""]
        reason_header = headers.ERROR_REASON.encode()

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                reason[0] = next(
                    (v.decode("latin-1") for k, v in message.get("headers", ()) if k == reason_header), ""
                )
            await send(message)

        started = time.perf_counter()
        with calls.call(f"{scope['method']} {scope['path']}", request_id) as fields:
            try:
                await self.app(scope, receive, watched)
            finally:
                params = scope.get("path_params", {})
                calls.note(model=str(params.get("model", "")), version=str(params.get("version", "")))
                if self.access:
                    client = scope.get("client")
                    peer = f"{client[0]}:{client[1]}" if client else ""
                    calls.write(fields, str(status[0] or 500), reason[0], time.perf_counter() - started, peer)


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
            settings.max_detached_per_client,
        )
        self.upstream: Upstream | None = None
        self.metrics_server: HttpServer | None = None
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
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = bound(
            ENV_PREFIX, "listen", settings.listen, lambda: socket.create_server((host, port), family=family)
        )
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
        if settings.metrics_listen:
            app_of_metrics = metrics_app(self.metrics.registry, asyncio.get_running_loop())
            metrics_host, metrics_port = split_address(settings.metrics_listen)
            self.metrics_server = bound(
                ENV_PREFIX,
                "metrics_listen",
                settings.metrics_listen,
                lambda: HttpServer(
                    app_of_metrics, metrics_host, metrics_port, self.tls, "the gateway's metrics endpoint"
                ),
            )
        log.info(
            "serving HTTP on %s (metrics %s); upstream %s%s;",
            self.url,
            f"on {self.metrics_url}/metrics" if self.metrics_server else "off: no --metrics-listen",
            settings.upstream,
            " over TLS" if self.upstream_tls is not None else "",
        )

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.address}"

    @property
    def metrics_url(self) -> str:
        assert self.metrics_server is not None
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{split_address(self.settings.metrics_listen)[0]}:{self.metrics_server.port}"

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
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)


def build_gateway(settings: Settings) -> Gateway:
    return Gateway(settings)
