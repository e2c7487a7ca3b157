"""Device memory on /metrics: the collector's series from what NVML reads, nothing where NVML is
unusable (no NVIDIA driver: this machine), and workers' scrapes not adding one device twice."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from modelyard.service.gpu_memory import DeviceMemory, GpuMemoryCollector, read_nvml
from modelyard.service.workers.metrics_sum import sum_scrapes
from tests.support import metric


def registry_with(devices: list[DeviceMemory] | None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(GpuMemoryCollector(lambda: devices))
    return registry


def test_each_device_reports_used_and_total_bytes() -> None:
    registry = registry_with([DeviceMemory(0, 3 << 30, 80 << 30), DeviceMemory(1, 1 << 30, 80 << 30)])
    assert metric(registry, "modelyard_gpu_memory_used_bytes", device="0") == 3 << 30
    assert metric(registry, "modelyard_gpu_memory_used_bytes", device="1") == 1 << 30
    assert metric(registry, "modelyard_gpu_memory_total_bytes", device="1") == 80 << 30


def test_no_nvml_means_no_series() -> None:
    assert read_nvml() is None  # no NVIDIA driver here; a GPU host reads its devices
    assert generate_latest(registry_with(None)) == b""
    assert generate_latest(registry_with([])) == b""


def test_workers_reading_the_same_device_do_not_add_it_twice() -> None:
    scrape = generate_latest(registry_with([DeviceMemory(0, 5 << 30, 80 << 30)])).decode()
    summed = CollectorRegistry()
    summed.register(Summed(scrape, scrape))
    assert metric(summed, "modelyard_gpu_memory_used_bytes", device="0") == 5 << 30
    assert metric(summed, "modelyard_gpu_memory_total_bytes", device="0") == 80 << 30


class Summed(Collector):
    """What the supervisor serves: the workers' scrapes summed."""

    def __init__(self, *scrapes: str) -> None:
        self._scrapes = scrapes

    def collect(self) -> Iterator[Metric]:
        return sum_scrapes(self._scrapes)
