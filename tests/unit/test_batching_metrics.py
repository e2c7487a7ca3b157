"""Batching metrics of a model version: series shared by its batchers, removed with the last one."""

from __future__ import annotations

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
