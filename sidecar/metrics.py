"""The sidecar's Prometheus metrics, in its own registry (tests run several sidecars at once).

The series every call adds to (requests, their latency, attempts) are plain Python numbers,
exported by a collector at scrape time with prometheus_client's names, labels and samples
(`_total`, `_created`, `_bucket`, `_count`, `_sum`): a prometheus_client child takes a lock per
increment and walks the buckets per observation, several times per call.
"""

from __future__ import annotations

import contextlib
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from modelyard.sidecar.breaker_policy import State
from modelyard.sidecar.breakers import BreakerKey

STATE_VALUES = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}
# model, configured canary weight, effective canary weight (canary_status.py), known models only
CanaryWeights = Callable[[], Iterable[tuple[str, float, float]]]


class _CanaryWeightCollector(Collector):
    """The canary weights, computed at each scrape (the effective one changes with time: a
    breaker's backoff ends without an event)."""

    def __init__(self, weights: CanaryWeights) -> None:
        self._weights = weights

    def collect(self) -> Iterator[GaugeMetricFamily]:
        configured = GaugeMetricFamily(
            "modelyard_sidecar_canary_weight",
            "The canary weight (percent) the route gives each served model with a canary",
            labels=["model"],
        )
        effective = GaugeMetricFamily(
            "modelyard_sidecar_canary_effective_weight",
            "The canary weight routing applies: 0 while the canary's breakers are open",
            labels=["model"],
        )
        for model, weight, applied in self._weights():
            configured.add_metric([model], weight)
            effective.add_metric([model], applied)
        yield configured
        yield effective


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_LE: tuple[str, ...] = (*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf")  # type: ignore[no-untyped-call]


class _Series:
    """A family's series: label values -> its cells (`width` floats), and when each series began."""

    width = 1

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.cells: dict[tuple[str, ...], list[float]] = {}
        self.created: dict[tuple[str, ...], float] = {}

    def cell(self, key: tuple[str, ...]) -> list[float]:
        found = self.cells.get(key)
        if found is None:
            self.created[key] = time.time()
            found = self.cells[key] = [0.0] * self.width
        return found


class _Counts(_Series):
    """A counter's series: label values -> [value]."""

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, cell in list(self.cells.items()):  # one step: the loop may add a series meanwhile
            family.add_metric(key, cell[0], created=self.created[key])
        return family


class _Histograms(_Series):
    """A histogram's series: label values -> [count per bucket (not cumulative)..., +Inf, sum]."""

    width = len(LATENCY_BUCKETS) + 2

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for key, cell in list(self.cells.items()):
            counts, total = cell[:-1], cell[-1]  # a copy: the sum may lag the counts by a call
            cumulative, running = [], 0.0
            for le, count in zip(_LE, counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric(key, cumulative, total)
            family.samples.append(
                Sample(f"{self.name}_created", dict(zip(self.labels, key, strict=True)), self.created[key])
            )
        return family


class _CallSeries(Collector):
    """The per-call series, read at each scrape (from the admin's thread, or the loop's)."""

    def __init__(self, *series: _Counts | _Histograms) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        for series in self._series:
            yield series.family()


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # One ended call's label values -> the cells it adds to (its requests series, its latency
        # series, its attempts series), kept: the label sets are bounded (scope.py), so these are.
        self._answered: dict[tuple[str | bool | None, ...], tuple[list[float], list[float], list[float]]] = {}
        # Labels only from bounded sets: a model the upstreams serve (else `_other`), a version
        # that has a breaker (served, or named by the route; else `_other`), the dye, the status
        # code's name, the fallback's reason (scope.py).
        self._requests = _Counts(
            "modelyard_sidecar_requests",
            "Calls the sidecar answered, by method, model, version and dye of the attempt that "
            "answered, status code, and fallback (why a canary-dyed call went to stable, else empty)",
            ["method", "model", "version", "dye", "code", "fallback"],
        )
        self._latency = _Histograms(
            "modelyard_sidecar_request_seconds",
            "Time from a call's arrival to its answer (unary) or end (streams), by method, model, "
            "version and dye of the attempt that answered",
            ["method", "model", "version", "dye"],
        )
        self._attempts = _Counts(
            "modelyard_sidecar_attempts",
            "Upstream attempts (a call has one, or more after a fault), by model, version, dye, "
            "status code and fault (true: it counted against the version, as a breaker counts it). "
            "A canary's fault answered by stable is a canary attempt with fault=true here, and a "
            "stable answer in requests",
            ["model", "version", "dye", "code", "fault"],
        )
        self.registry.register(_CallSeries(self._requests, self._latency, self._attempts))
        self.fallbacks = Counter(
            "modelyard_sidecar_dye_fallbacks",
            "Canary-dyed calls sent to the stable version instead, by reason",
            ["model", "reason"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "modelyard_sidecar_breaker_state",
            "Breaker state per upstream, model and version: 0 closed, 1 half-open, 2 open",
            ["upstream", "model", "version"],
            registry=self.registry,
        )
        self.breaker_transitions = Counter(
            "modelyard_sidecar_breaker_transitions",
            "Breaker state changes, by the state entered",
            ["upstream", "model", "version", "to"],
            registry=self.registry,
        )
        self.admin_denials = Counter(
            "modelyard_sidecar_admin_denials",
            "Admin endpoint requests refused by outcome: unauthenticated, denied (a credential "
            "without the scope), off (changes with no credential configured), cross_site",
            ["outcome"],
            registry=self.registry,
        )
        self.tenant_refusals = Counter(
            "modelyard_sidecar_tenant_refusals",
            "Calls refused by a tenant's rate or concurrency limit",
            ["tenant"],
            registry=self.registry,
        )

        self.shadow_calls = Counter(
            "modelyard_sidecar_shadow_calls",
            "Stable calls mirrored to the canary, by outcome: compared, failed, dropped (over the bound)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.shadow_max_abs_diff = Histogram(
            "modelyard_sidecar_shadow_max_abs_diff",
            "Largest absolute difference between the stable and canary outputs of a mirrored call",
            ["model"],
            buckets=(0.0, 1e-6, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0),
            registry=self.registry,
        )
        self.shadow_rows = Counter(
            "modelyard_sidecar_shadow_rows",
            "Output rows compared by argmax in mirrored calls",
            ["model"],
            registry=self.registry,
        )
        self.shadow_rows_agreeing = Counter(
            "modelyard_sidecar_shadow_rows_agreeing",
            "Output rows whose argmax agreed between stable and canary",
            ["model"],
            registry=self.registry,
        )

        self.shadow_tokens = Counter(
            "modelyard_sidecar_shadow_tokens",
            "Generated tokens compared in mirrored greedy generations (the longer output's length)",
            ["model"],
            registry=self.registry,
        )
        self.shadow_tokens_agreeing = Counter(
            "modelyard_sidecar_shadow_tokens_agreeing",
            "Generated tokens that agreed (the common prefix) in mirrored greedy generations",
            ["model"],
            registry=self.registry,
        )

    def answered(
        self,
        path: str,
        model: str,
        version: str,
        dye: str,
        code: str,
        fallback: str,
        seconds: float,
        fault: bool | None = None,
    ) -> None:
        """One call answered: its count and latency; and, unless `fault` is None (a call that had
        no attempt), its answering attempt (`attempted`). `path`: the call's (one of the method
        table's: bounded), labelled by its method's name (found once per series)."""
        key = (path, model, version, dye, code, fallback, fault)
        cells = self._answered.get(key)
        if cells is None:
            method = path.rpartition("/")[2]
            cells = self._answered[key] = (
                self._requests.cell((method, model, version, dye, code, fallback)),
                self._latency.cell((method, model, version, dye)),
                self._attempt(model, version, dye, code, fault) if fault is not None else [0.0],
            )
        requests, latency, attempts = cells
        requests[0] += 1
        latency[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bucket with le >= seconds
        latency[-1] += seconds
        if fault is not None:
            attempts[0] += 1

    def attempted(self, model: str, version: str, dye: str, code: str, fault: bool) -> None:
        """One upstream attempt ended (one that failed before another answered)."""
        self._attempt(model, version, dye, code, fault)[0] += 1

    def _attempt(self, model: str, version: str, dye: str, code: str, fault: bool) -> list[float]:
        return self._attempts.cell((model, version, dye, code, "true" if fault else "false"))

    def canary_weights(self, weights: CanaryWeights) -> None:
        """Export the configured and effective canary weights, read from `weights` at each scrape."""
        self.registry.register(_CanaryWeightCollector(weights))

    def breaker_known(self, key: BreakerKey) -> None:
        """A breaker made before its first call: its state series exists, at 0 (closed)."""
        self.breaker_state.labels(key.upstream, key.model, key.version).set(STATE_VALUES[State.CLOSED])

    def breaker_removed(self, key: BreakerKey) -> None:
        labels = (key.upstream, key.model, key.version)
        with contextlib.suppress(KeyError):  # a series it never had
            self.breaker_state.remove(*labels)
        for state in State:
            with contextlib.suppress(KeyError):
                self.breaker_transitions.remove(*labels, state.value)

    def breaker_changed(self, key: BreakerKey, new: State) -> None:
        labels = (key.upstream, key.model, key.version)
        self.breaker_state.labels(*labels).set(STATE_VALUES[new])
        self.breaker_transitions.labels(*labels, new.value).inc()
