"""Our API's tensors (modelyard.inference.v1.Tensor) <-> numpy arrays, and schema messages."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from modelyard.inference.v1 import tensor_pb2

from service.datatypes import NUMPY_BY_NAME, decode_bytes, to_wire
from service.errors import InvalidInput
from service.runtime.signature import TensorSpec

_PREFIX = "DATA_TYPE_"


# Precomputed: these run for every tensor of every request.
_NAME_BY_VALUE = {
    value: name.removeprefix(_PREFIX)
    for name, value in tensor_pb2.DataType.items()
    if value != tensor_pb2.DATA_TYPE_UNSPECIFIED
}
_VALUE_BY_NAME = {name: value for value, name in _NAME_BY_VALUE.items()}


def datatype_value(name: str) -> tensor_pb2.DataType.ValueType:
    return _VALUE_BY_NAME[name]


def to_arrays(tensors: Iterable[tensor_pb2.Tensor]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in arrays:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        arrays[tensor.name] = to_array(tensor)
    return arrays


def to_array(tensor: tensor_pb2.Tensor) -> np.ndarray:
    """A zero-copy view of the tensor's bytes (BYTES tensors are decoded into an object array)."""
    name = _NAME_BY_VALUE.get(tensor.datatype)
    if name is None:
        raise InvalidInput(f"input {tensor.name!r}: datatype is missing or unknown ({tensor.datatype})")
    shape = tuple(tensor.shape)
    if min(shape, default=0) < 0:
        raise InvalidInput(f"input {tensor.name!r}: shape {list(shape)} has a negative dimension")
    count = math.prod(shape)
    if name == "BYTES":
        return decode_bytes(tensor.raw_data, shape, tensor.name)
    dtype = NUMPY_BY_NAME[name]
    if len(tensor.raw_data) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(shape)} of {name} needs {count * dtype.itemsize} bytes, "
            f"raw_data has {len(tensor.raw_data)}"
        )
    return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(shape)


def to_tensors(arrays: Mapping[str, np.ndarray]) -> list[tensor_pb2.Tensor]:
    return [to_tensor(name, array) for name, array in arrays.items()]


def to_tensor(name: str, array: np.ndarray) -> tensor_pb2.Tensor:
    datatype, raw = to_wire(array)
    return tensor_pb2.Tensor(name=name, datatype=_VALUE_BY_NAME[datatype], shape=array.shape, raw_data=raw)


def to_specs(specs: Iterable[TensorSpec]) -> list[tensor_pb2.TensorSpec]:
    return [
        tensor_pb2.TensorSpec(name=s.name, datatype=datatype_value(s.datatype), shape=s.shape) for s in specs
    ]
