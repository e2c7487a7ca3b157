"""BF16 tensors through ONNX Runtime's Python binding, which has no numpy type for bfloat16.

The service carries BF16 as ml_dtypes.bfloat16 arrays. ORT refuses them in `run` (it cannot map
ml_dtypes' type) and cannot turn a bfloat16 result into numpy, so a model with BF16 inputs or
outputs runs through OrtValues: a BF16 input is handed over as its raw 2-byte values declared as
ONNX BFLOAT16, and a BF16 output's bytes are copied out of the OrtValue's CPU buffer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto

from modelyard.service.errors import ModelRunError
from modelyard.tensors import NUMPY_BY_NAME

Array = npt.NDArray[Any]
BF16 = NUMPY_BY_NAME["BF16"]
_ORT_BF16 = "tensor(bfloat16)"


def run(
    session: ort.InferenceSession,
    feeds: Mapping[str, Array],
    output_names: Sequence[str],
    options: ort.RunOptions | None = None,
) -> list[Array]:
    values = {name: _to_ort(array) for name, array in feeds.items()}
    results = session.run_with_ort_values(list(output_names), values, options)
    return [_from_ort(value) for value in results]


def _to_ort(array: Array) -> ort.OrtValue:
    if array.dtype == BF16:
        raw = np.ascontiguousarray(array).view(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def _from_ort(value: ort.OrtValue) -> Array:
    if value.data_type() != _ORT_BF16:
        return value.numpy()  # type: ignore[no-any-return]
    if value.device_name().lower() != "cpu":  # data_ptr would point into device memory
        raise ModelRunError(f"a BF16 output was left on {value.device_name()}; only CPU results are read")
    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype=BF16)
    # A copy of the buffer while `value` (and so the buffer) is alive.
    buffer = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.frombuffer(bytes(buffer), dtype=np.uint16).view(BF16).reshape(shape)
