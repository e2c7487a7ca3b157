"""Tensors as both gRPC APIs carry them <-> numpy arrays: the client-side helpers of the contracts.

Element types have KServe V2 names ("FP32", "INT64", "BF16", "BYTES", ...); numeric tensors travel as
row-major little-endian bytes, BYTES tensors as KServe's length-prefixed encoding. Clients use
`to_tensor` / `to_array` with our API's `Tensor` message; the service uses the same functions (one
implementation for both sides). Needs numpy; the rest of the contracts package does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

try:
    import ml_dtypes
    import numpy as np
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("modelyard.tensors needs numpy and ml_dtypes: pip install 'modelyard[client]'") from exc

from modelyard.inference.v1 import tensor_pb2


class TensorError(ValueError):
    """A tensor's bytes, shape or datatype do not fit together; the message names the tensor."""


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
    # numpy has no bfloat16; ml_dtypes' is a real numpy dtype, distinct from uint16, so a BF16
    # tensor keeps its name through every check and computes like a float for clients.
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(np.object_),
}

_NAME_BY_DTYPE = {dt: name for name, dt in NUMPY_BY_NAME.items() if name != "BYTES"}
_NAME_BY_KIND_SIZE = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_BY_NAME.items() if name != "BYTES"}

_PREFIX = "DATA_TYPE_"
# Precomputed: these run for every tensor of every request.
_NAME_BY_VALUE = {
    value: name.removeprefix(_PREFIX)
    for name, value in tensor_pb2.DataType.items()
    if value != tensor_pb2.DATA_TYPE_UNSPECIFIED
}
_VALUE_BY_NAME = {name: value for value, name in _NAME_BY_VALUE.items()}


def name_of(dtype: np.dtype[np.generic]) -> str:
    """KServe name of a numpy dtype; object and string arrays are BYTES."""
    known = _NAME_BY_DTYPE.get(dtype)  # the common case, on every tensor of every request
    if known is not None:
        return known
    if dtype.kind in "OSU":
        return "BYTES"
    try:
        return _NAME_BY_KIND_SIZE[(dtype.kind, dtype.itemsize)]
    except KeyError:
        raise ValueError(f"unsupported numpy dtype {dtype}") from None


def is_known(name: str) -> bool:
    return name in NUMPY_BY_NAME


def to_wire(array: np.ndarray) -> tuple[str, bytes]:
    """An array's KServe datatype name and its bytes as both wire formats carry them: row-major,
    little-endian, BYTES length-prefixed. ValueError for a dtype with no KServe name."""
    name = _NAME_BY_DTYPE.get(array.dtype)
    if name is not None:  # little-endian numeric: the common case, no conversion
        return name, array.tobytes()
    name = name_of(array.dtype)
    if name == "BYTES":
        return name, encode_bytes(array)
    return name, array.astype(NUMPY_BY_NAME[name], copy=False).tobytes()


# No tensor a message can carry comes near this many elements (or bytes); shapes beyond it (whose
# element count would overflow numpy's sizes) are the client's error, refused before any work.
MAX_SHAPE_ELEMENTS = 1 << 48


def element_count(shape: tuple[int, ...], tensor: str) -> int:
    """The number of elements of `shape`, after checking that every dimension is >= 0 and that the
    shape, zero dimensions aside, stays under MAX_SHAPE_ELEMENTS (numpy refuses larger ones even
    when they hold no element). Raises TensorError naming the tensor."""
    count = math.prod(shape)
    if 0 < count <= MAX_SHAPE_ELEMENTS and min(shape, default=1) > 0:
        return count  # the common case, on every tensor of every request
    if min(shape, default=0) < 0:
        raise TensorError(f"input {tensor!r}: shape {list(shape)} has a negative dimension")
    span = 1
    for dim in shape:
        span *= max(dim, 1)
        if span > MAX_SHAPE_ELEMENTS:
            raise TensorError(
                f"input {tensor!r}: shape {list(shape)} has more elements than any tensor may "
                f"({MAX_SHAPE_ELEMENTS})"
            )
    return count


def decode_bytes(raw: bytes | memoryview, shape: tuple[int, ...], tensor: str) -> np.ndarray:
    """KServe's BYTES encoding (each element: 4-byte little-endian length, then its bytes) -> an
    object array of bytes. Raises TensorError naming the tensor when the encoding is broken."""
    count = element_count(shape, tensor)
    if count > len(raw) // 4:  # every element takes at least its 4-byte length prefix
        raise TensorError(
            f"tensor {tensor!r}: shape {list(shape)} needs {count} BYTES elements, the data "
            f"({len(raw)} bytes) cannot hold that many"
        )
    items: list[bytes] = []
    view = memoryview(raw)
    offset = 0
    while offset < len(view) and len(items) < count:
        if offset + 4 > len(view):
            raise TensorError(f"tensor {tensor!r}: BYTES element {len(items)} has a truncated length prefix")
        size = int.from_bytes(view[offset : offset + 4], "little")
        offset += 4
        if offset + size > len(view):
            raise TensorError(
                f"tensor {tensor!r}: BYTES element {len(items)} claims {size} bytes past the end"
            )
        items.append(bytes(view[offset : offset + size]))
        offset += size
    if len(items) != count or offset != len(view):
        raise TensorError(
            f"tensor {tensor!r}: shape {list(shape)} needs {count} BYTES elements, the data holds "
            f"{len(items)}{' and trailing bytes' if offset != len(view) else ''}"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array.reshape(shape)


def encode_bytes(array: np.ndarray) -> bytes:
    """An object/str/bytes array -> KServe's length-prefixed BYTES encoding."""
    parts = []
    for item in array.reshape(-1):
        # As tritonclient does: bytes as they are, anything else by its text (bytes(3) would be 3 zeros).
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def datatype_name(value: tensor_pb2.DataType.ValueType) -> str | None:
    """The KServe datatype name of our API's DataType enum value; None when unknown or unset."""
    return _NAME_BY_VALUE.get(value)


def datatype_value(name: str) -> tensor_pb2.DataType.ValueType:
    """Our API's DataType enum value for a KServe datatype name."""
    return _VALUE_BY_NAME[name]


def to_arrays(tensors: Iterable[tensor_pb2.Tensor]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in arrays:
            raise TensorError(f"input {tensor.name!r} is given twice")
        arrays[tensor.name] = to_array(tensor)
    return arrays


def to_array(tensor: tensor_pb2.Tensor) -> np.ndarray:
    """A zero-copy view of the tensor's bytes (BYTES tensors are decoded into an object array)."""
    name = _NAME_BY_VALUE.get(tensor.datatype)
    if name is None:
        raise TensorError(f"input {tensor.name!r}: datatype is missing or unknown ({tensor.datatype})")
    shape = tuple(tensor.shape)
    count = element_count(shape, tensor.name)
    if name == "BYTES":
        return decode_bytes(tensor.raw_data, shape, tensor.name)
    dtype = NUMPY_BY_NAME[name]
    if len(tensor.raw_data) != count * dtype.itemsize:
        raise TensorError(
            f"input {tensor.name!r}: shape {list(shape)} of {name} needs {count * dtype.itemsize} bytes, "
            f"raw_data has {len(tensor.raw_data)}"
        )
    return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(shape)


def to_tensors(arrays: Mapping[str, np.ndarray]) -> list[tensor_pb2.Tensor]:
    return [to_tensor(name, array) for name, array in arrays.items()]


def to_tensor(name: str, array: np.ndarray) -> tensor_pb2.Tensor:
    datatype, raw = to_wire(array)
    return tensor_pb2.Tensor(name=name, datatype=_VALUE_BY_NAME[datatype], shape=array.shape, raw_data=raw)
