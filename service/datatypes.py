"""Tensor element types: KServe V2 names <-> numpy dtypes <-> ONNX Runtime type strings.

The KServe names ("FP32", "INT64", ...) are the service's own vocabulary for element types; every
API converts to and from them here.
"""

from __future__ import annotations

import numpy as np

from service.errors import InvalidInput

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

_NAME_BY_DTYPE = {dt: name for name, dt in NUMPY_BY_NAME.items() if name != "BYTES"}
_NAME_BY_KIND_SIZE = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_BY_NAME.items() if name != "BYTES"}


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


def is_known(name: str) -> bool:
    return name in NUMPY_BY_NAME


def decode_bytes(raw: bytes, shape: tuple[int, ...], tensor: str) -> np.ndarray:
    """KServe's BYTES encoding (each element: 4-byte little-endian length, then its bytes) -> an
    object array of bytes. Raises InvalidInput naming the tensor when the encoding is broken."""
    count = int(np.prod(shape, dtype=np.int64))
    items: list[bytes] = []
    view = memoryview(raw)
    offset = 0
    while offset < len(view) and len(items) < count:
        if offset + 4 > len(view):
            raise InvalidInput(f"tensor {tensor!r}: BYTES element {len(items)} has a truncated length prefix")
        size = int.from_bytes(view[offset : offset + 4], "little")
        offset += 4
        if offset + size > len(view):
            raise InvalidInput(
                f"tensor {tensor!r}: BYTES element {len(items)} claims {size} bytes past the end"
            )
        items.append(bytes(view[offset : offset + size]))
        offset += size
    if len(items) != count or offset != len(view):
        raise InvalidInput(
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
