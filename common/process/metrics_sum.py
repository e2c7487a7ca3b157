"""One scrape for all worker processes (the service's and the sidecar's): every worker's series
summed (counters, histograms, and gauges of amounts such as queue depth), except gauges of state
named by the caller, where the lowest (or highest) worker speaks for all.

Counters must not go backwards when a worker is replaced: the monotonic families of a dead
worker's last scrape are folded into carried-over totals that every later sum adds in."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

# Families whose values only grow while their process lives: carried over when it dies. Gauges
# are not (a dead worker's queue depth is gone with it).
MONOTONIC = frozenset({"counter", "histogram", "summary"})
_CREATED = "_created"


def parse(text: str) -> list[Metric]:
    """One worker's scrape, without prometheus_client's `<family>_created` series: creation
    timestamps (one per process) mean nothing summed or carried over, so the sum has none."""
    families = list(text_string_to_metric_families(text))
    monotonic = {f.name for f in families if f.type in MONOTONIC}
    return [
        f for f in families if not (f.name.endswith(_CREATED) and f.name.removesuffix(_CREATED) in monotonic)
    ]


def sum_families(
    scrapes: Iterable[Iterable[Metric]],
    lowest: AbstractSet[str] = frozenset(),  # gauges of state: the lowest worker's value
    highest: AbstractSet[str] = frozenset(),  # gauges of state: the highest worker's value
) -> Iterator[Metric]:
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for scrape in scrapes:
        for family in scrape:
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            merge = min if family.name in lowest else max if family.name in highest else _add
            into = values[family.name]
            for sample in family.samples:
                if family.type in MONOTONIC and sample.name == family.name + _CREATED:
                    continue  # the same timestamps, where a parser keeps them in the family
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in into:
                    into[key] = merge(into[key], sample.value)
                else:
                    into[key] = sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        yield family


def sum_scrapes(
    scrapes: Iterable[str], lowest: AbstractSet[str] = frozenset(), highest: AbstractSet[str] = frozenset()
) -> Iterator[Metric]:
    return sum_families((parse(text) for text in scrapes), lowest, highest)


def carry(carried: Sequence[Metric], last_scrape: str) -> list[Metric]:
    """The carried-over totals once a worker whose last scrape was `last_scrape` is gone: one set
    of totals however many workers came and went (its size is the number of series seen)."""
    monotonic = [f for f in parse(last_scrape) if f.type in MONOTONIC]
    return list(sum_families([carried, monotonic]))


def _add(a: float, b: float) -> float:
    return a + b


def per_worker(
    name: str, documentation: str, texts: Iterable[tuple[int, str]], counter: str
) -> GaugeMetricFamily:
    """A gauge `name{worker}`: each worker's own total of `counter` (a counter family, e.g.
    modelyard_requests) from its last scrape, so the spread of calls over the workers shows."""
    family = GaugeMetricFamily(name, documentation, labels=["worker"])
    for index, text in texts:
        total = sum(
            sample.value
            for found in text_string_to_metric_families(text)
            if found.name == counter
            for sample in found.samples
            if sample.name == counter + "_total"
        )
        family.add_metric([str(index)], total)
    return family
