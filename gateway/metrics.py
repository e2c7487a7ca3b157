"""The gateway's Prometheus metrics, in its own registry, and the listener apart from the public
port that serves them (`--metrics-listen`): `/metrics`, and `/healthz` for probes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from modelyard.process.metrics_http import WsgiApp

# /healthz answers 503 when the event loop does not run a no-op within this long (it is stuck).
LOOP_CHECK_S = 2.0

_TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self._counted: dict[tuple[str, int], Any] = {}  # (route, status) -> its counter child
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "modelyard_gateway_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "modelyard_gateway_streams",
            "SSE generation streams held (attached or kept for resume)",
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "modelyard_gateway_open_streams",
            "SSE generation streams whose upstream call still runs (what --max-streams bounds)",
            registry=self.registry,
        )
        self.detached_streams = Gauge(
            "modelyard_gateway_detached_streams",
            "Open SSE streams nobody reads, kept for resume (what gives way to live streams)",
            registry=self.registry,
        )
        self.evicted = Counter(
            "modelyard_gateway_detached_evictions",
            "Detached streams cancelled to make room: over their client's --max-detached-per-client "
            "(cause=client) or for a new stream at --max-streams (cause=full)",
            ["cause"],
            registry=self.registry,
        )
        self.finished_bytes = Gauge(
            "modelyard_gateway_finished_stream_bytes",
            "Encoded bytes buffered by finished streams kept for resume (bounded by --resume-buffer-bytes)",
            registry=self.registry,
        )
        self.attached = Gauge(
            "modelyard_gateway_stream_connections",
            "SSE connections currently open",
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "modelyard_gateway_time_to_first_byte_seconds",
            "From request to the response's first byte (the first event of a stream)",
            ["route"],
            buckets=_TTFB_BUCKETS,
            registry=self.registry,
        )
        self.resumes = Counter(
            "modelyard_gateway_resumes",
            "Last-Event-ID reconnects, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "modelyard_gateway_disconnects",
            "SSE clients that went away before their stream ended",
            registry=self.registry,
        )
        self.cancelled = Counter(
            "modelyard_gateway_upstream_cancels",
            "Upstream calls cancelled because nobody was reading them",
            registry=self.registry,
        )

    def count(self, route: str, status: int) -> None:
        """One answer; the labelled child is kept, as looking it up costs more than the increment."""
        child = self._counted.get((route, status))
        if child is None:
            child = self._counted[(route, status)] = self.requests.labels(route, str(status))
        child.inc()


def metrics_app(registry: CollectorRegistry, loop: asyncio.AbstractEventLoop) -> WsgiApp:
    """`/metrics` (the registry) and `/healthz` (200 while the gateway's event loop runs: this
    server runs on a thread of its own, so it asks the loop); anything else 404."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            scraped: Iterable[bytes] = exposition(environ, start_response)
            return scraped
        if path == "/healthz":
            try:
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=LOOP_CHECK_S)
                status, body = "200 OK", {"status": "ok"}
            except Exception:
                status, body = "503 Service Unavailable", {"status": "event loop not responding"}
            start_response(status, [("content-type", "application/json")])
            return [json.dumps(body).encode()]
        start_response("404 Not Found", [("content-type", "text/plain")])
        return [b"/metrics or /healthz\n"]

    return app
