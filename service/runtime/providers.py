"""Which ONNX Runtime execution provider this process uses, decided once at start.

CUDA is chosen only when it really works: the provider is compiled in, an NVIDIA driver is
present, the CUDA and cuDNN libraries load (preloaded from the `nvidia-*` wheels that the
`service-cuda` extra installs, so a host with only a driver needs nothing else), and a probe
session actually runs on it. The probe's own provider errors are silenced, so the choice is
reported in one clear line that says why CUDA was not used.

A host with a driver that ends on the CPU is a fallback: versions with `execution.provider: auto`
serve there as degraded (their status says so and `modelyard_model_versions_degraded` counts
them); `execution.provider: cuda` fails the version's load.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from modelyard.service.gpu_memory import DeviceMemory, read_nvml

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
_FAILED_LOAD = re.compile(r"Failed to load (\S+?):")


@dataclass(frozen=True)
class ProviderChoice:
    cuda_usable: bool
    reason: str  # why CUDA is or is not used, for the start-up line and a version's status
    # An NVIDIA driver is on this host: running on the CPU here is a fallback, not the plan.
    driver_present: bool = False
    devices: tuple[DeviceMemory, ...] = ()

    @property
    def default(self) -> str:
        return CUDA if self.cuda_usable else CPU

    @property
    def fallback(self) -> bool:
        return self.driver_present and not self.cuda_usable

    def summary(self) -> str:
        """The start-up line's detail: versions, devices with free/total memory, or why not."""
        cuda = getattr(ort, "cuda_version", "")  # the CUDA this build of ONNX Runtime needs
        versions = f"onnxruntime {ort.__version__}" + (f", built for CUDA {cuda}" if cuda else "")
        if self.cuda_usable:
            return f"{versions}; {_describe(self.devices) or 'devices unknown (no NVML)'}"
        return f"{versions}; CUDA not used: {self.reason}"


def detect_providers(
    *,
    driver: Path = NVIDIA_DRIVER,
    available: Callable[[], Sequence[str]] = ort.get_available_providers,
    preload: Callable[[], list[str]] | None = None,
) -> ProviderChoice:
    """The seams (driver file, the build's providers, the library preload) let tests take each
    branch on any host."""
    driver_present = driver.exists()
    if CUDA not in available():
        return ProviderChoice(
            False,
            "this onnxruntime build has no CUDA execution provider (install modelyard[service-cuda])",
            driver_present,
        )
    # Loaded before the driver is looked at, so that the line says whether the install is whole
    # on a host where CUDA is not used yet (a node without its driver, an image built for GPUs).
    missing = (preload or preload_cuda_libraries)()
    if not driver_present:
        found = f"libraries missing: {', '.join(missing)}" if missing else "the CUDA libraries loaded"
        return ProviderChoice(False, f"no NVIDIA driver ({driver} is absent; {found})")
    ort.set_default_logger_severity(4)  # the probe's failures are reported below, in one line
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(_probe_model(), sess_options=options, providers=[CUDA, CPU])
        if CUDA not in session.get_providers():
            cause = f"libraries missing: {', '.join(missing)}" if missing else "see ORT_LOGGING_LEVEL=0"
            return ProviderChoice(False, f"the CUDA provider failed to create a session ({cause})", True)
        session.run(None, {"x": np.ones((1,), np.float32)})
    except Exception as exc:  # any probe failure means: not usable
        return ProviderChoice(False, f"the CUDA probe failed: {exc}".splitlines()[0], True)
    finally:
        ort.set_default_logger_severity(2)  # ORT's default: warnings
    return ProviderChoice(True, "CUDA probe ran", True, tuple(read_nvml() or ()))


def preload_cuda_libraries() -> list[str]:
    """Load CUDA and cuDNN from the nvidia-* wheels (or the loader path) before the first session,
    as ONNX Runtime's own `preload_dlls` does; the names of those that did not load. It prints
    what fails: captured here, to be said once in the start-up line."""
    if not hasattr(ort, "preload_dlls"):
        return []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            ort.preload_dlls()
        except Exception as exc:  # a broken install: the probe below will say it fails
            return [f"({exc})"]
    return sorted(set(_FAILED_LOAD.findall(printed.getvalue())))


def _describe(devices: Sequence[DeviceMemory]) -> str:
    gib = 1 << 30
    return ", ".join(
        f"device {d.device}: {(d.total - d.used) / gib:.1f} GiB free of {d.total / gib:.1f} GiB"
        for d in devices
    )


def _probe_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()
