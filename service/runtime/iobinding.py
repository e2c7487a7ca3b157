"""IO binding: how the runs of a CUDA session (Infer, and each dynamic batch) move their tensors.

Each input is bound where it lies, in host memory (`bind_cpu_input`: ONNX Runtime keeps a view of
the array, no copy), and ONNX Runtime copies it to the device once, for the kernels that read it
there. Each output is bound on the session's device (`bind_output(name, "cuda", device_id)`: ONNX
Runtime allocates it there, at the shape the run gives it), and is copied back to host memory once,
after the run, into the array the answer is built from (`copy_outputs_to_cpu`). So a run makes one
host-to-device copy per input and one device-to-host copy per output, and nothing else; its
outputs' device memory goes back to the session's arena when the binding is dropped.

A plain `session.run` on CUDA makes the same two copies, inside the run (ONNX Runtime copies
each input to the device, and each output to a host buffer that numpy then views). The binding
says where each tensor is meant to be rather than leaving ONNX Runtime to find out at each run;
whether that is faster on a given model is for the GPU check to say (bench/gpu.py measures
both), and `execution.io_binding: false` keeps a version on `session.run`.

Not used on the CPU: there `session.run` copies nothing (ONNX Runtime reads the numpy arrays, and
its outputs come back as views of its own buffers), while `copy_outputs_to_cpu` would copy each
output once more. The same code runs there with device "cpu", so its results are tested
everywhere against `session.run`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

from modelyard.service.runtime.device_errors import names_a_device_failure
from modelyard.service.runtime.providers import CUDA
from modelyard.service.runtime.signature import Signature

# How run_with_iobinding fails: a plain RuntimeError, "Error in execution: <message>" (ONNX Runtime
# 1.31's binding; session.run raises the typed error of the status: InvalidArgument, Fail, ...).
UNTYPED_PREFIX = "Error in execution: "
# ONNX Runtime's device names for OrtDevice.make, by execution provider.
DEVICE_TYPES = {CUDA: "cuda"}


@dataclass(frozen=True)
class DeviceBinding:
    """Runs a session with its outputs bound on one device. Thread-safe: each run has its own
    IOBinding (a session's runs may go side by side on several executor threads)."""

    device_type: str  # "cuda" (or "cpu", where the tests run the same code)
    device_id: int = 0

    def run(
        self,
        session: ort.InferenceSession,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]:
        """The outputs named, in that order, as host arrays of their own."""
        binding = session.io_binding()
        for name, array in feeds.items():
            # A view is bound as it is: ONNX Runtime reads the array's buffer, so it must be one
            # contiguous block (the batcher's concatenation and decoded requests are).
            binding.bind_cpu_input(name, array if array.flags.c_contiguous else np.ascontiguousarray(array))
        for name in output_names:
            binding.bind_output(name, self.device_type, self.device_id)
        try:
            session.run_with_iobinding(binding, options)
        except RuntimeError as exc:
            if not str(exc).startswith(UNTYPED_PREFIX):
                raise
            raise typed_failure(exc, session, feeds, output_names, options) from None
        outputs: list[np.ndarray] = binding.copy_outputs_to_cpu()
        return outputs


def binding_for(
    provider: str, device_id: int, signature: Signature, enabled: bool = True
) -> DeviceBinding | None:
    """The binding a session's runs use, or None for `session.run`: only on a device (CUDA), and
    not for BYTES tensors (ONNX Runtime keeps strings in host memory only) nor for bfloat16 models
    (bf16.run converts at the boundary with its own run)."""
    device_type = DEVICE_TYPES.get(provider)
    if not enabled or device_type is None:
        return None
    if signature.string_inputs or signature.string_outputs or signature.has_bf16:
        return None
    return DeviceBinding(device_type, device_id)


def typed_failure(
    exc: RuntimeError,
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str],
    options: ort.RunOptions | None,
) -> Exception:
    """The typed error of a bound run that failed. run_with_iobinding drops ONNX Runtime's status
    code, which is what tells the request's fault (InvalidArgument) from the model's or the
    device's (session.run_error): the same run through session.run fails with it (only on a
    failure; a stopped run stops at once). A message that names a device failure is one as it is
    (ONNX Runtime's generic runtime error, which run_error reads), with no run again on that
    device; so is the bound run's own error where session.run succeeds."""
    own: Exception = RuntimeException(str(exc).removeprefix(UNTYPED_PREFIX))
    if names_a_device_failure(str(own)):
        return own  # the device failed: no run again on it, and the message says what it is
    try:
        session.run(list(output_names), dict(feeds), options)
    except Exception as typed:
        return typed
    return own
