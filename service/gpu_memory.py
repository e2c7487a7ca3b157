"""Device memory as the GPU driver reports it (NVML, through NVIDIA's nvidia-ml-py), for /metrics
when the service runs models with the CUDA provider: used and total bytes per device, read at
each scrape. ONNX Runtime does not report its arena's device memory; the driver's view covers
every process on the device, which is what an operator sizing `gpu_mem_limit_mb` needs.

NVML numbers devices as the driver does (PCI order), which is CUDA's order unless
CUDA_DEVICE_ORDER or CUDA_VISIBLE_DEVICES reorder them; the `device` label is NVML's index."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

USED = "modelyard_gpu_memory_used_bytes"
TOTAL = "modelyard_gpu_memory_total_bytes"


@dataclass(frozen=True)
class DeviceMemory:
    device: int
    used: int
    total: int


@functools.cache
def _nvml() -> Any:
    """NVML, initialised once for the process's life (the driver's state is loaded then, not at
    every scrape); None where it cannot be used (no NVIDIA driver or library)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("no device memory from NVML: %s", exc)
        return None
    return pynvml


def read_nvml() -> list[DeviceMemory] | None:
    """Every device's memory; None where NVML cannot be used."""
    nvml = _nvml()
    if nvml is None:
        return None
    devices = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            devices.append(DeviceMemory(index, int(info.used), int(info.total)))
    except nvml.NVMLError as exc:
        log.debug("no device memory from NVML: %s", exc)
        return None
    return devices


def used_mib() -> float | None:
    """Used memory summed over every device (NVML sees every process's), in MiB; None where NVML
    cannot be used. For the benchmarks and the CUDA tests: a version's device memory back."""
    devices = read_nvml()
    return sum(d.used for d in devices) / 2**20 if devices else None


def cuda_to_nvml(device: int, visible: str | None = None) -> int | None:
    """The NVML index of CUDA device `device` (a session's device_id): CUDA numbers only the
    devices CUDA_VISIBLE_DEVICES lists, in its order; None where it names them otherwise (UUIDs,
    MIG instances), which this reading does not map. (CUDA's default order is fastest first, NVML's
    the PCI bus's: the same on a host of one device model; set CUDA_DEVICE_ORDER=PCI_BUS_ID on
    a mixed host.)"""
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return device
    listed = [entry.strip() for entry in visible.split(",")]
    if device >= len(listed) or not listed[device].isdigit():
        return None
    return int(listed[device])


def memory_of(
    devices: Iterable[int], read: Callable[[], list[DeviceMemory] | None] = read_nvml
) -> dict[int, DeviceMemory] | None:
    """The memory of each CUDA device named (by CUDA device id), for a version's load and release;
    None where NVML cannot be used. A device NVML does not see is left out."""
    seen = read()
    if seen is None:
        return None
    by_index = {memory.device: memory for memory in seen}
    found = {}
    for device in devices:
        index = cuda_to_nvml(device)
        if index is not None and index in by_index:
            found[device] = by_index[index]
    return found


class GpuMemoryCollector(Collector):
    def __init__(self, read: Callable[[], list[DeviceMemory] | None] = read_nvml) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        devices = self._read()
        if not devices:
            return
        used = GaugeMetricFamily(
            USED, "Device memory in use (every process), by NVML device.", labels=["device"]
        )
        total = GaugeMetricFamily(TOTAL, "Device memory in all, by NVML device.", labels=["device"])
        for memory in devices:
            used.add_metric([str(memory.device)], memory.used)
            total.add_metric([str(memory.device)], memory.total)
        yield used
        yield total
