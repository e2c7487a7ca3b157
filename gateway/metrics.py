"""The gateway's Prometheus metrics, in its own registry (served at /metrics by the app)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
