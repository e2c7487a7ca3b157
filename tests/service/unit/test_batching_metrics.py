"""Batching metrics of a model version: series shared by its batchers, removed with the last one."""

from __future__ import annotations

import pytest

from modelyard.service.metrics import ServiceMetrics


def depth(metrics: ServiceMetrics, version: str) -> float | None:
    labels = {"model": "m", "version": version, "priority": "1"}
    return metrics.registry.get_sample_value("modelyard_queue_depth", labels)


def test_series_stay_while_another_batcher_of_the_version_uses_them() -> None:
    metrics = ServiceMetrics()
    old = metrics.batching("m", "1", levels=1)  # a version reloaded with a new config: two batchers
    new = metrics.batching("m", "1", levels=1)
    other = metrics.batching("m", "2", levels=1)
    old.dropped(1, "deadline")
    old.close()
    new.depth(1, 3)
    other.depth(1, 1)
    assert depth(metrics, "1") == 3  # the newer batcher's updates still show
    rejections = {"model": "m", "version": "1", "priority": "1", "reason": "deadline"}
    assert metrics.registry.get_sample_value("modelyard_queue_rejections_total", rejections) == 1
    new.close()
    new.close()  # closing twice changes nothing
    assert depth(metrics, "1") is None
    assert metrics.registry.get_sample_value("modelyard_queue_rejections_total", rejections) is None
    assert depth(metrics, "2") == 1


def test_queue_waits_are_a_histogram_per_level_that_leaves_with_the_version() -> None:
    metrics = ServiceMetrics()
    queue = metrics.batching("m", "1", levels=2)
    queue.dequeued(1, 0.0002)
    queue.dequeued(1, 0.003)
    queue.dequeued(2, 20.0)  # beyond the largest bucket: +Inf only
    queue.depth(2, 5)

    def sample(name: str, level: str, **extra: str) -> float | None:
        labels = {"model": "m", "version": "1", "priority": level, **extra}
        return metrics.registry.get_sample_value(f"modelyard_queue_duration_seconds_{name}", labels)

    assert sample("bucket", "1", le="0.0001") == 0
    assert sample("bucket", "1", le="0.00025") == 1  # buckets are cumulative, "less or equal"
    assert sample("bucket", "1", le="0.005") == 2
    assert sample("bucket", "1", le="+Inf") == 2
    assert sample("count", "1") == 2
    assert sample("sum", "1") == pytest.approx(0.0032)
    assert sample("bucket", "2", le="10.0") == 0
    assert sample("count", "2") == 1
    assert depth_at(metrics, "2") == 5
    assert depth_at(metrics, "1") == 0  # bound at once: every level has its series from the start
    queue.close()
    assert sample("count", "1") is None
    assert depth_at(metrics, "2") is None


def depth_at(metrics: ServiceMetrics, level: str) -> float | None:
    labels = {"model": "m", "version": "1", "priority": level}
    return metrics.registry.get_sample_value("modelyard_queue_depth", labels)
