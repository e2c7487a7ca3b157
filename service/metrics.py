"""Prometheus metrics of the service, in a registry of their own (so tests can run several servers
in one process), served over HTTP on the metrics address."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

# Sub-millisecond buckets: the service's own overhead is measured in tens of microseconds.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

M = TypeVar("M", bound=MetricWrapperBase)

# Rows per batched run: powers of two up to the largest max_batch_size worth batching on one device.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BatchingMetrics:
    """The batching metrics of one model version, labels bound once (they are on the hot path).
    It is the version's queue observer (service.batching.queue.QueueObserver)."""

    def __init__(self, metrics: ServiceMetrics, model: str, version: str, levels: int) -> None:
        self._owner = metrics
        self._labels = (model, version)
        # Shared with any other batcher of the same model and version (a version reloaded with a
        # new config has two for a while): they update the same series.
        self._series = metrics.batching_series(self._labels)
        self._rejections_family = metrics.queue_rejections
        self._queue_seconds = [self._bind(metrics.queue_seconds, str(n)) for n in range(1, levels + 1)]
        self._depth = [self._bind(metrics.queue_depth, str(n)) for n in range(1, levels + 1)]
        self._rejections: dict[tuple[int, str], Counter] = {}
        self.batch_size = self._bind(metrics.batch_size)
        self._closed = False

    def _bind(self, family: M, *extra: str) -> M:
        labels = (*self._labels, *extra)
        self._series.add((family, labels))
        return family.labels(*labels)

    def depth(self, level: int, depth: int) -> None:
        self._depth[level - 1].set(depth)

    def dequeued(self, level: int, waited_s: float) -> None:
        self._queue_seconds[level - 1].observe(waited_s)

    def dropped(self, level: int, reason: str) -> None:
        child = self._rejections.get((level, reason))
        if child is None:
            child = self._bind(self._rejections_family, str(level), reason)
            self._rejections[(level, reason)] = child
        child.inc()

    def close(self) -> None:
        """The batcher is gone. When it was the last of its model version, the version's series
        leave the registry, so that dashboards do not show a retired version's queue for ever."""
        if self._closed:
            return
        self._closed = True
        for family, labels in self._owner.release_batching_series(self._labels):
            with contextlib.suppress(KeyError):
                family.remove(*labels)


@dataclass
class ServiceMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        labels = ["method", "model", "version", "code"]
        self.requests = Counter(
            "modelyard_requests",
            "Requests answered, by method, model, version and gRPC status code.",
            labels,
            registry=self.registry,
        )
        self.latency = Histogram(
            "modelyard_request_duration_seconds",
            "Time from a request's arrival to its answer.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.model_loads = Counter(
            "modelyard_model_loads",
            "Model version loads, by model and result (ready or failed).",
            ["model", "result"],
            registry=self.registry,
        )
        self.load_failures = Counter(
            "modelyard_model_load_failures",
            "Failed version loads, by model and reason "
            "(config, checksum, load, schema, incompatible, warmup, memory, provider).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "modelyard_model_load_duration_seconds",
            "Time to validate, load and warm up a version.",
            ["model"],
            registry=self.registry,
        )
        self.swaps = Counter(
            "modelyard_model_swaps",
            "Atomic swaps of a model's served versions that brought in new ones.",
            ["model"],
            registry=self.registry,
        )
        self.drain_seconds = Histogram(
            "modelyard_model_drain_duration_seconds",
            "Time a retired version waited for its in-flight requests.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.versions_ready = Gauge(
            "modelyard_model_versions_ready",
            "Versions currently serving, by model.",
            ["model"],
            registry=self.registry,
        )
        # Names a request made up must not grow the label set without bound.
        self.known_models: set[str] = set()
        # labels() takes a lock and builds a key on every call; the hot path caches the children.
        self._children: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        self._batching_series: dict[
            tuple[str, str], tuple[int, set[tuple[MetricWrapperBase, tuple[str, ...]]]]
        ] = {}
        self._batching_families()

    def _batching_families(self) -> None:
        levels = ["model", "version", "priority"]
        self.queue_seconds = Histogram(
            "modelyard_queue_duration_seconds",
            "Time a request waited in its model version's batching queue before its batch ran.",
            levels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "modelyard_queue_depth",
            "Requests waiting in a model version's batching queue, by priority level (1 is highest).",
            levels,
            registry=self.registry,
        )
        self.queue_rejections = Counter(
            "modelyard_queue_rejections",
            "Requests refused by a batching queue or removed from it without running, by reason: "
            "queue_full, deadline, cancelled, shutdown.",
            [*levels, "reason"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "modelyard_batch_size",
            "Rows per batched model run (the requests' rows concatenated).",
            ["model", "version"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )

    def batching(self, model: str, version: str, levels: int) -> BatchingMetrics:
        return BatchingMetrics(self, model, version, levels)

    def batching_series(self, labels: tuple[str, str]) -> set[tuple[MetricWrapperBase, tuple[str, ...]]]:
        """The batching series of one model version, shared by its batchers (counted)."""
        users, series = self._batching_series.get(labels, (0, set()))
        self._batching_series[labels] = (users + 1, series)
        return series

    def release_batching_series(
        self, labels: tuple[str, str]
    ) -> set[tuple[MetricWrapperBase, tuple[str, ...]]]:
        """One batcher of the version is gone; the series to remove once none is left."""
        users, series = self._batching_series.pop(labels, (1, set()))
        if users > 1:
            self._batching_series[labels] = (users - 1, series)
            return set()
        return series

    def observe_request(
        self, method: str, model: str, version: str, code: grpc.StatusCode, seconds: float
    ) -> None:
        key = (method, model if model in self.known_models else "_unknown", version, code.name)
        children = self._children.get(key)
        if children is None:
            children = (self.requests.labels(*key), self.latency.labels(*key))
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)


class MetricsServer:
    """The /metrics HTTP endpoint (prometheus_client's WSGI server on a thread)."""

    def __init__(self, metrics: ServiceMetrics, host: str, port: int) -> None:
        self._httpd: WSGIServer
        self._thread: threading.Thread
        self._httpd, self._thread = start_http_server(port, addr=host, registry=metrics.registry)

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
