"""Which ONNX Runtime execution provider this process uses, decided once at start.

CUDA is chosen only when it really works: the provider is compiled in, an NVIDIA driver is
present, and a probe session actually runs on it. The probe's own provider errors are silenced,
so the choice is reported in one clear log line instead of a stack of ORT errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True)
class ProviderChoice:
    cuda_usable: bool
    reason: str  # why CUDA is or is not used, for the start-up log line and metadata

    @property
    def default(self) -> str:
        return CUDA if self.cuda_usable else CPU


def detect_providers() -> ProviderChoice:
    if CUDA not in ort.get_available_providers():
        return ProviderChoice(False, "this onnxruntime build has no CUDA execution provider")
    if not _NVIDIA_DRIVER.exists():
        return ProviderChoice(False, "no NVIDIA driver found")
    ort.set_default_logger_severity(4)  # the probe's failures are reported below, in one line
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(_probe_model(), sess_options=options, providers=[CUDA, CPU])
        if CUDA not in session.get_providers():
            return ProviderChoice(False, "the CUDA provider failed to initialise (CUDA/cuDNN libraries?)")
        session.run(None, {"x": np.ones((1,), np.float32)})
        return ProviderChoice(True, f"CUDA device available (onnxruntime {ort.__version__})")
    except Exception as exc:  # any probe failure means: not usable
        return ProviderChoice(False, f"CUDA probe failed: {exc}".splitlines()[0])
    finally:
        ort.set_default_logger_severity(2)  # ORT's default: warnings


def _probe_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()
