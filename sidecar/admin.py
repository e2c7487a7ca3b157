"""The admin HTTP endpoint: /metrics, GET /breakers, GET /canary, PUT /canary/<model>.

A WSGI server on its own thread (as the metrics endpoint of every process); anything that reads
or changes the sidecar's state runs on the event loop, handed over with run_coroutine_threadsafe.

    curl -X PUT localhost:9101/canary/scaler -d '{"canary_weight": 25}'
    curl localhost:9101/breakers
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from sidecar.routes import ConfigError, RouteSource, parse_model_route

StartResponse = Callable[..., Any]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(WSGIServer):
    daemon_threads = True


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        routes: RouteSource,
        breakers: Callable[[], list[dict[str, object]]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._routes = routes
        self._breakers = breakers
        self._loop = loop
        self._httpd = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="admin", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _on_loop(self, work: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return work()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=5)

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path: str = environ.get("PATH_INFO", "")
        method: str = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        if path == "/breakers" and method == "GET":
            return _json(start_response, "200 OK", self._on_loop(self._breakers))
        if path == "/canary" and method == "GET":
            return _json(start_response, "200 OK", self._on_loop(self._canary_view))
        if path.startswith("/canary/") and method == "PUT":
            model = path[len("/canary/") :]
            try:
                size = int(environ.get("CONTENT_LENGTH") or 0)
                body = json.loads(environ["wsgi.input"].read(size) or b"{}")
                current = self._routes.table.route(model)
                base = {
                    "canary_weight": current.canary_weight,
                    "stable": current.stable,
                    "canary": current.canary,
                }
                route = parse_model_route({**base, **body}, f"canary/{model}")
            except (ValueError, ConfigError) as exc:
                return _json(start_response, "400 Bad Request", {"error": str(exc)})
            self._on_loop(lambda: self._routes.set_route(model, route))
            return _json(start_response, "200 OK", {"model": model, **_route_doc(route)})
        return _json(start_response, "404 Not Found", {"error": f"no {method} {path}"})

    def _canary_view(self) -> dict[str, object]:
        table = self._routes.table
        return {
            "stickiness_header": table.stickiness_header,
            "canary_weight": table.canary_weight,
            "models": {name: _route_doc(route) for name, route in table.models.items()},
        }


def _route_doc(route: Any) -> dict[str, object]:
    return {"canary_weight": route.canary_weight, "stable": route.stable, "canary": route.canary}


def _json(start_response: StartResponse, status: str, doc: object) -> list[bytes]:
    body = json.dumps(doc).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]
