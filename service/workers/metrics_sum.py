"""The service's rules for one scrape of all workers (modelyard.process.metrics_sum sums them):
which gauges say what each worker has, not how much."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric

from modelyard.process import metrics_sum
from modelyard.process.metrics_sum import carry, parse

__all__ = ["HIGHEST", "LOWEST", "carry", "parse", "sum_families", "sum_scrapes"]

# Gauges that say what each worker has, not how much: summing would count one model N times.
# Device memory: every worker reads the same devices. Instance health (each worker has its own
# instances of a version): healthy only where healthy on every worker.
LOWEST = frozenset(
    {
        "modelyard_model_versions_ready",
        "modelyard_gpu_memory_used_bytes",
        "modelyard_gpu_memory_total_bytes",
        "modelyard_instance_healthy",
    }
)
# A version degraded in any worker is degraded.
HIGHEST = frozenset({"modelyard_model_versions_degraded"})


def sum_families(scrapes: Iterable[Iterable[Metric]]) -> Iterator[Metric]:
    return metrics_sum.sum_families(scrapes, LOWEST, HIGHEST)


def sum_scrapes(scrapes: Iterable[str]) -> Iterator[Metric]:
    return metrics_sum.sum_scrapes(scrapes, LOWEST, HIGHEST)
