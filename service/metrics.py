"""Prometheus metrics of the service, in a registry of their own (so tests can run several servers
in one process), served over HTTP on the metrics address."""

from __future__ import annotations

import contextlib
import functools
from bisect import bisect_left
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.utils import floatToGoString

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

# The `code` label of each status (StatusCode.name is a Python property: read on every request).
_CODE_NAMES = {code: code.name for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK

# Rows per batched run: powers of two up to the largest max_batch_size worth batching on one device.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BatchingMetrics:
    """The batching metrics of one model version, labels bound once (they are on the hot path).
    It is the version's queue observer (service.scheduling.queue.QueueObserver), for its batcher's
    queue and for its decode loop's wait queue alike."""

    def __init__(self, metrics: ServiceMetrics, model: str, version: str, levels: int) -> None:
        self._owner = metrics
        self._labels = (model, version)
        # Shared with any other batcher of the same model and version (a version reloaded with a
        # new config has two for a while): they update the same series.
        self._series = metrics.version_series(self._labels)
        self._rejections_family = metrics.queue_rejections
        queues = metrics.queues
        per_level = [(*self._labels, str(n)) for n in range(1, levels + 1)]
        self._series.update((queues, labels) for labels in per_level)
        self._depth = [queues.depth(labels) for labels in per_level]
        self._waits = [queues.waits(labels) for labels in per_level]
        self._rejections: dict[tuple[int, str], Counter] = {}
        self._closed = False

    @functools.cached_property
    def batch_size(self) -> Histogram:
        # Bound on first use: a decode loop's queue runs no batches and exports no batch sizes.
        return self._bind(self._owner.batch_size)

    def _bind(self, family: M, *extra: str) -> M:
        labels = (*self._labels, *extra)
        self._series.add((family, labels))
        return family.labels(*labels)

    def depth(self, level: int, depth: int) -> None:
        self._depth[level - 1][0] = depth

    def dequeued(self, level: int, waited_s: float) -> None:
        series = self._waits[level - 1]
        series[bisect_left(LATENCY_BUCKETS, waited_s)] += 1  # Prometheus buckets are "less or equal"
        series[-1] += waited_s

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
        for family, labels in self._owner.release_version_series(self._labels):
            with contextlib.suppress(KeyError):
                family.remove(*labels)


class Removable(Protocol):
    """A family whose series of one label set can leave the registry (a version retired)."""

    def remove(self, *labels: str) -> None: ...


class QueueSeries:
    """`modelyard_queue_depth` and `modelyard_queue_duration_seconds`, by model, version and priority
    level: plain numbers kept on the event loop, read at scrape time.

    A collector of its own because a queue reports on every request it admits and takes out (on the
    batched path, per request): prometheus_client's Gauge and Histogram take a lock per observation
    and walk the buckets in Python. A scrape (on the HTTP thread) copies each series, so it may see
    a wait in the count a moment before it is in the sum, never a torn number."""

    LABELS = ("model", "version", "priority")

    def __init__(self, registry: CollectorRegistry) -> None:
        # label values -> [depth]; label values -> [waits per bucket (the last one +Inf)..., sum]
        self._depths: dict[tuple[str, ...], list[float]] = {}
        self._waits: dict[tuple[str, ...], list[float]] = {}
        registry.register(self)

    def depth(self, labels: tuple[str, ...]) -> list[float]:
        """The depth of one queue (shared by every queue of the same labels: the last one set wins)."""
        series = self._depths.get(labels)
        if series is None:
            series = self._depths[labels] = [0.0]
        return series

    def waits(self, labels: tuple[str, ...]) -> list[float]:
        """The wait histogram of one queue level (shared by every queue of the same labels)."""
        series = self._waits.get(labels)
        if series is None:
            series = self._waits[labels] = [0.0] * (len(LATENCY_BUCKETS) + 2)
        return series

    def remove(self, *labels: str) -> None:
        # One assignment each: a scrape on the HTTP thread sees the old dict or the new one.
        self._depths = {key: series for key, series in self._depths.items() if key != labels}
        self._waits = {key: series for key, series in self._waits.items() if key != labels}

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "modelyard_queue_depth",
            "Requests waiting in a model version's queue (batching, or decode slots), by priority level "
            "(1 is highest).",
            labels=self.LABELS,
        )
        waits = HistogramMetricFamily(
            "modelyard_queue_duration_seconds",
            "Time a request waited in its model version's queue (batching, or decode slots) before it ran.",
            labels=self.LABELS,
        )
        for key, series in list(self._depths.items()):
            depth.add_metric(list(key), series[0])
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for key, series in list(self._waits.items()):
            snapshot = list(series)
            cumulative = list(accumulate(snapshot[:-1]))
            waits.add_metric(list(key), list(zip(bounds, cumulative, strict=True)), sum_value=snapshot[-1])
        yield depth
        yield waits


# Decode steps batch up to a model's max_concurrent_sequences rows.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RequestLog:
    """Count and latency histogram of answered requests (`modelyard_requests_total` and
    `modelyard_request_duration_seconds`), by method, model, version and status code.

    A collector of its own because it runs once per request: prometheus_client's Counter and
    Histogram take a lock per observation and walk the buckets in Python, several microseconds on
    a path whose whole cost is tens. Observations happen on the event loop thread only; a scrape
    (on the HTTP thread) copies each series, so it may see a request in the count a moment before
    its latency is in the sum, never a torn number."""

    LABELS = ("method", "model", "version", "code")

    def __init__(self, registry: CollectorRegistry, known_models: Container[str]) -> None:
        # label values -> [observations per bucket (the last one +Inf)..., sum of seconds]
        self._series: dict[tuple[str, ...], list[float]] = {}
        self._known = known_models  # the models labelled by name; any other is "_unknown"
        registry.register(self)

    def forget_model(self, model: str) -> None:
        # One assignment: a scrape on the HTTP thread sees the old dict or the new one.
        self._series = {key: series for key, series in self._series.items() if key[1] != model}

    def observe_request(
        self, method: str, model: str, version: str, code: grpc.StatusCode, seconds: float
    ) -> None:
        """One answered request (ServiceMetrics.observe_request is this method)."""
        # OK without the dict: a StatusCode hashes in Python (Enum.__hash__), on every request.
        name = "OK" if code is _OK else _CODE_NAMES[code]
        key = (method, model if model in self._known else "_unknown", version, name)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = [0.0] * (len(LATENCY_BUCKETS) + 2)
        series[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # Prometheus buckets are "less or equal"
        series[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(
            "modelyard_requests",
            "Requests answered, by method, model, version and gRPC status code.",
            labels=self.LABELS,
        )
        latency = HistogramMetricFamily(
            "modelyard_request_duration_seconds",
            "Time from a request's arrival to its answer.",
            labels=self.LABELS,
        )
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for key, series in list(self._series.items()):
            snapshot = list(series)
            cumulative = list(accumulate(snapshot[:-1]))
            latency.add_metric(list(key), list(zip(bounds, cumulative, strict=True)), sum_value=snapshot[-1])
            counts.add_metric(list(key), cumulative[-1])
        yield counts
        yield latency


class InstanceCounts(Protocol):
    """The model instances of one version (service.runtime.instances.Instances), as metrics read them."""

    def snapshot(
        self,
    ) -> Sequence[
        tuple[str, str, int, int, bool, int]
    ]: ...  # (index, device, pending, runs, healthy, faults)


class InstanceMetrics:
    """Per model instance, so that an operator sees how runs spread over instances and devices:
    `modelyard_instance_runs_total`, `modelyard_instance_in_flight`, `modelyard_instance_healthy` and
    `modelyard_instance_device_faults_total` (runs that failed on the instance's device, each of
    which rested it) by model, version, instance (its index) and device.

    A collector read at scrape time from the instances' own counts (plain ints kept on the event
    loop): nothing is added to a run's path. A version's series leave with it. Two loads of the same
    version number serve side by side while the older drains: their counts add up, and the runs of
    the one that leaves are carried, so that the counter never goes back."""

    LABELS = ("model", "version", "instance", "device")

    def __init__(self, registry: CollectorRegistry) -> None:
        # Replaced whole on every change (one assignment): a scrape on the HTTP thread sees the
        # old mapping or the new one.
        self._versions: dict[tuple[str, str], tuple[InstanceCounts, ...]] = {}
        self._carried: dict[tuple[str, ...], tuple[int, int]] = {}  # labels -> (runs, faults)
        registry.register(self)

    def add(self, model: str, version: str, counts: InstanceCounts) -> None:
        key = (model, version)
        self._versions = {**self._versions, key: (*self._versions.get(key, ()), counts)}

    def remove(self, model: str, version: str, counts: InstanceCounts) -> None:
        key = (model, version)
        rest = tuple(c for c in self._versions.get(key, ()) if c is not counts)
        versions = {k: v for k, v in self._versions.items() if k != key}
        carried = dict(self._carried)
        if rest:
            versions[key] = rest
            for index, device, _, runs, _, faults in counts.snapshot():
                labels = (model, version, index, device)
                had_runs, had_faults = carried.get(labels, (0, 0))
                carried[labels] = (had_runs + runs, had_faults + faults)
        else:
            carried = {labels: runs for labels, runs in carried.items() if labels[:2] != key}
        self._versions, self._carried = versions, carried

    def collect(self) -> Iterator[Metric]:
        runs = CounterMetricFamily(
            "modelyard_instance_runs",
            "Model runs started on each model instance (a batch is one run).",
            labels=self.LABELS,
        )
        in_flight = GaugeMetricFamily(
            "modelyard_instance_in_flight", "Runs in progress on each model instance.", labels=self.LABELS
        )
        healthy = GaugeMetricFamily(
            "modelyard_instance_healthy",
            "1 while a model instance takes runs, 0 while it rests after a run failed on its device.",
            labels=self.LABELS,
        )
        faults = CounterMetricFamily(
            "modelyard_instance_device_faults",
            "Runs that failed on a model instance's device (each rests the instance for a while).",
            labels=self.LABELS,
        )
        # labels -> [runs, in flight, healthy, faults]; what left is carried while its version serves.
        totals: dict[tuple[str, ...], list[int]] = {
            k: [runs, 0, 1, failed] for k, (runs, failed) in self._carried.items()
        }
        for (model, version), pools in list(self._versions.items()):
            for pool in pools:
                for index, device, pending, started, ok, failed in pool.snapshot():
                    total = totals.setdefault((model, version, index, device), [0, 0, 1, 0])
                    total[0] += started
                    total[1] += pending
                    total[2] = min(total[2], int(ok))
                    total[3] += failed
        for labels, (started, pending, healthy_now, failed) in totals.items():
            runs.add_metric(list(labels), started)
            in_flight.add_metric(list(labels), pending)
            healthy.add_metric(list(labels), healthy_now)
            faults.add_metric(list(labels), failed)
        yield runs
        yield in_flight
        yield healthy
        yield faults


@dataclass(frozen=True)
class GenerationMetrics:
    """The generation metrics of one model version, with their labels bound once (hot path)."""

    time_to_first_token: Histogram
    inter_token: Histogram
    tokens: Counter
    active: Gauge
    waiting: Gauge
    preempted: Gauge
    preemptions: Counter
    step_rows: Histogram
    step_seconds: Histogram
    _finished: Counter
    _cancellations: Counter
    _labels: tuple[str, str]
    _owner: ServiceMetrics
    _series: set[tuple[Removable, tuple[str, ...]]]

    def finished(self, reason: str) -> None:
        """A sequence ended: length, stop, eos, cancelled, deadline, stalled or error."""
        self._series.add((self._finished, (*self._labels, reason)))
        self._finished.labels(*self._labels, reason).inc()

    def cancelled(self, cause: str) -> None:
        """A sequence was abandoned by its client: cancelled (or disconnected), deadline, stalled
        (its reader took nothing past generation.stall_timeout_ms) or preempted (its reader was
        behind and it was the oldest over generation.max_preempted)."""
        self._series.add((self._cancellations, (*self._labels, cause)))
        self._cancellations.labels(*self._labels, cause).inc()

    def close(self) -> None:
        """The version's decode loop is gone: once nothing else serves this model version, its
        series leave the registry (dashboards do not show a retired version for ever)."""
        for family, labels in self._owner.release_version_series(self._labels):
            with contextlib.suppress(KeyError):
                family.remove(*labels)


@dataclass
class ServiceMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        # Requests label their model by name only while it is in the repository and has served:
        # names a request made up must not grow the label set without bound.
        self.known_models: set[str] = set()
        self.requests = RequestLog(self.registry, self.known_models)
        # The request log's own method: one call per answered request, no forwarding.
        self.observe_request = self.requests.observe_request
        self.instances = InstanceMetrics(self.registry)
        self.auth_denials = Counter(
            "modelyard_auth_denials",
            "Calls refused for want of a credential, by surface (management or inference) and "
            "outcome (unauthenticated, denied).",
            ["surface", "outcome"],
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
        self.versions_degraded = Gauge(
            "modelyard_model_versions_degraded",
            "Versions serving on the CPU where CUDA was expected (a host with an NVIDIA driver where "
            "CUDA could not be used, or a CUDA session that fell back), by model.",
            ["model"],
            registry=self.registry,
        )
        self.shadow_calls = Counter(
            "modelyard_shadow_calls",
            "Shadow calls (x-model-dye: shadow) by model and outcome: run (on spare capacity, at "
            "the lowest priority) or dropped (they would have delayed real calls).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self._generation_families(["model", "version"])
        self._version_series: dict[tuple[str, str], tuple[int, set[tuple[Removable, tuple[str, ...]]]]] = {}
        self._batching_families()

    def _batching_families(self) -> None:
        levels = ["model", "version", "priority"]
        self.queues = QueueSeries(self.registry)  # depth and waits
        self.queue_rejections = Counter(
            "modelyard_queue_rejections",
            "Requests refused by a queue (batching, or decode slots) or removed from it without running, "
            "by reason: "
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

    def version_series(self, labels: tuple[str, str]) -> set[tuple[Removable, tuple[str, ...]]]:
        """The series of one model version (batching and generation), shared by everything that
        serves that version (counted), so that a replaced version's leaving does not remove series
        its successor with the same number already uses."""
        users, series = self._version_series.get(labels, (0, set()))
        self._version_series[labels] = (users + 1, series)
        return series

    def release_version_series(self, labels: tuple[str, str]) -> set[tuple[Removable, tuple[str, ...]]]:
        """One user of the version's series is gone; the series to remove once none is left."""
        users, series = self._version_series.pop(labels, (1, set()))
        if users > 1:
            self._version_series[labels] = (users - 1, series)
            return set()
        return series

    def forget_model(self, model: str) -> None:
        """The model left the repository: its series leave the registry and requests that still
        name it count as `_unknown`, so that label sets follow the repository instead of growing."""
        self.known_models.discard(model)
        self.requests.forget_model(model)
        for family in (
            self.model_loads,
            self.load_failures,
            self.load_seconds,
            self.swaps,
            self.drain_seconds,
            self.versions_ready,
            self.versions_degraded,
            self.shadow_calls,
        ):
            family.remove_by_labels({"model": model})

    def _generation_families(self, labels: list[str]) -> None:
        self.generation_ttft = Histogram(
            "modelyard_generation_time_to_first_token_seconds",
            "Time from a generation's arrival (queueing included) to its first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation_inter_token = Histogram(
            "modelyard_generation_inter_token_seconds",
            "Time between consecutive tokens of one sequence.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "modelyard_generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.generation_active = Gauge(
            "modelyard_generation_active_sequences",
            "Sequences holding a decode slot (running or paused for a slow reader).",
            labels,
            registry=self.registry,
        )
        self.generation_waiting = Gauge(
            "modelyard_generation_waiting_sequences",
            "Sequences queued for a decode slot.",
            labels,
            registry=self.registry,
        )
        self.generation_preempted = Gauge(
            "modelyard_generation_preempted_sequences",
            "Paused sequences that gave their decode slot to waiting ones (cache kept in host memory).",
            labels,
            registry=self.registry,
        )
        self.generation_preemptions = Counter(
            "modelyard_generation_preemptions",
            "Paused sequences that gave up their decode slot because others waited for one.",
            labels,
            registry=self.registry,
        )
        self.generation_step_rows = Histogram(
            "modelyard_generation_decode_batch_rows",
            "Sequences per decode step (the batch that one model run advances).",
            labels,
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.generation_step_seconds = Histogram(
            "modelyard_generation_decode_step_seconds",
            "Duration of one decode step (model run and sampling).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation_finished = Counter(
            "modelyard_generation_finished",
            "Generations ended, by reason: length, stop, eos, cancelled, deadline, stalled, preempted, "
            "error.",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.generation_cancellations = Counter(
            "modelyard_generation_cancellations",
            "Generations abandoned by their client, by cause: cancelled (or disconnected), deadline, "
            "stalled, preempted (dropped over generation.max_preempted).",
            [*labels, "cause"],
            registry=self.registry,
        )

    def generation(self, model: str, version: str) -> GenerationMetrics:
        labels = (model, version)
        series = self.version_series(labels)
        for family in (
            self.generation_ttft,
            self.generation_inter_token,
            self.generation_tokens,
            self.generation_active,
            self.generation_waiting,
            self.generation_preempted,
            self.generation_preemptions,
            self.generation_step_rows,
            self.generation_step_seconds,
        ):
            series.add((family, labels))
        return GenerationMetrics(
            time_to_first_token=self.generation_ttft.labels(*labels),
            inter_token=self.generation_inter_token.labels(*labels),
            tokens=self.generation_tokens.labels(*labels),
            active=self.generation_active.labels(*labels),
            waiting=self.generation_waiting.labels(*labels),
            preempted=self.generation_preempted.labels(*labels),
            preemptions=self.generation_preemptions.labels(*labels),
            step_rows=self.generation_step_rows.labels(*labels),
            step_seconds=self.generation_step_seconds.labels(*labels),
            _finished=self.generation_finished,
            _cancellations=self.generation_cancellations,
            _labels=labels,
            _owner=self,
            _series=series,
        )
