"""The admin HTTP endpoint: /metrics, GET /breakers, GET /canary, PUT /canary/<model>.

A WSGI server on its own thread (modelyard.common.metrics_http.HttpServer: HTTPS and mTLS when TLS
files are given, as the metrics endpoint of every process); anything that reads or changes the
sidecar's state runs on the event loop, handed over with run_coroutine_threadsafe.

With a tokens file (modelyard.common.auth, the service's format), every change needs
`Authorization: Bearer <token>`, and with `auth_reads` every read too; a missing or wrong token is
answered 401 with the same body whatever was wrong, and counted.

    curl -X PUT localhost:9101/canary/scaler -H "authorization: Bearer $TOKEN" -d '{"canary_weight": 25}'
    curl localhost:9101/breakers
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from modelyard.common.auth import Authorizer, Decision
from modelyard.common.metrics_http import HttpServer
from modelyard.common.throttle import LogThrottle
from modelyard.common.tls import TlsFiles
from prometheus_client import CollectorRegistry, Counter, make_wsgi_app

from sidecar.routes import ConfigError, RouteSource, parse_model_route

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
READS = frozenset({"GET", "HEAD"})


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        routes: RouteSource,
        breakers: Callable[[], list[dict[str, object]]],
        loop: asyncio.AbstractEventLoop,
        *,
        tls: TlsFiles | None = None,
        authorizer: Authorizer | None = None,  # None or unconfigured: no credential asked
        auth_reads: bool = False,
        denials: Counter | None = None,  # labelled by outcome
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._routes = routes
        self._breakers = breakers
        self._loop = loop
        self._authorizer = authorizer if authorizer is not None and authorizer.configured else None
        self._auth_reads = auth_reads
        self._denials = denials
        self._throttle = LogThrottle(log)
        self._http = HttpServer(self._app, host, port, tls, what="the sidecar's admin endpoint")

    @property
    def port(self) -> int:
        return self._http.port

    def stop(self) -> None:
        self._http.stop()

    def _refusal(self, environ: dict[str, Any]) -> Decision | None:
        """None when the request may go on; otherwise why not."""
        if self._authorizer is None:
            return None
        if environ.get("REQUEST_METHOD", "GET") in READS and not self._auth_reads:
            return None
        presented = [("authorization", str(environ.get("HTTP_AUTHORIZATION", "")))]
        decision = self._authorizer.check(presented, {})
        if decision is Decision.ALLOW:
            return None
        if self._denials is not None:
            self._denials.labels(decision.value).inc()
        self._throttle.log(
            logging.INFO,
            "admin: denied %s %s (%s)",
            environ.get("REQUEST_METHOD"),
            environ.get("PATH_INFO"),
            decision.value,
        )
        return decision

    def _on_loop(self, work: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return work()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=5)

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path: str = environ.get("PATH_INFO", "")
        method: str = environ.get("REQUEST_METHOD", "GET")
        refusal = self._refusal(environ)
        if refusal is Decision.DENIED:
            return _json(start_response, "403 Forbidden", {"error": "this client may not make this request"})
        if refusal is not None:  # the same words whether the token was missing, malformed or wrong
            return _json(
                start_response,
                "401 Unauthorized",
                {"error": "this request needs valid credentials"},
                [("WWW-Authenticate", "Bearer")],
            )
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


def _json(
    start_response: StartResponse, status: str, doc: object, extra: Iterable[tuple[str, str]] = ()
) -> list[bytes]:
    body = json.dumps(doc).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *extra])
    return [body]
