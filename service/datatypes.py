"""Tensor element types: KServe V2 names <-> numpy dtypes <-> ONNX Runtime type strings.

The KServe names ("FP32", "INT64", ...) are the service's own vocabulary for element types; every
API converts to and from them here.
"""

from __future__ import annotations

import numpy as np

# KServe V2 datatype name -> numpy dtype (little-endian, as the wire formats are).
NUMPY_BY_NAME: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}

# ONNX Runtime's NodeArg.type strings -> KServe names.
NAME_BY_ORT: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

_NAME_BY_KIND_SIZE = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_BY_NAME.items() if name != "BYTES"}


def name_of(dtype: np.dtype[np.generic]) -> str:
    """KServe name of a numpy dtype; object and string arrays are BYTES."""
    if dtype.kind in "OSU":
        return "BYTES"
    try:
        return _NAME_BY_KIND_SIZE[(dtype.kind, dtype.itemsize)]
    except KeyError:
        raise ValueError(f"unsupported numpy dtype {dtype}") from None


def is_known(name: str) -> bool:
    return name in NUMPY_BY_NAME
