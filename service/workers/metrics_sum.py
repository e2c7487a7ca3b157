"""One scrape for all workers: every worker's series summed (counters, histograms, and gauges of
amounts such as queue depth), except gauges of state, where the lowest worker speaks for all."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

# Gauges that say what each worker has, not how much: summing would count one model N times.
LOWEST = frozenset({"modelyard_model_versions_ready"})


def sum_scrapes(scrapes: Iterable[str]) -> Iterator[Metric]:
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in scrapes:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            lowest = family.name in LOWEST
            into = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in into:
                    into[key] = min(into[key], sample.value) if lowest else into[key] + sample.value
                else:
                    into[key] = sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        yield family
