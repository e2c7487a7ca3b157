"""modelyard.flat.v1 (proto/modelyard/flat/v1/inference.fbs): Infer requests and responses as
FlatBuffers, for large tensors. Decoding gives numpy arrays that are read-only views of the
received bytes (no copy); encoding writes each array once into the message. Malformed input
raises TensorError, as modelyard.tensors does. Needs numpy and flatbuffers ('modelyard[client]').

gRPC method: /modelyard.flat.v1.Inference/Infer, bytes in and out:

    answer = channel.unary_unary(flat.METHOD, None, None)(flat.encode_request("m", {"x": array}))
    response = flat.decode_response(answer)
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import flatbuffers
import numpy as np
from flatbuffers import number_types
from flatbuffers.table import Table

from modelyard.tensors import NUMPY_BY_NAME, TensorError, element_count, name_of

METHOD = "/modelyard.flat.v1.Inference/Infer"
SERVICE, METHOD_NAME = "modelyard.flat.v1.Inference", "Infer"
_ALIGN = 16


@dataclass(frozen=True)
class Infer:
    """A decoded request (`tensors` are its inputs) or response (its outputs)."""

    model_name: str
    model_version: str
    tensors: dict[str, np.ndarray]
    output_names: tuple[str, ...] = field(default=())


# -- encoding ------------------------------------------------------------------------------


def encode_request(
    model_name: str,
    inputs: Mapping[str, np.ndarray],
    model_version: str = "",
    output_names: Sequence[str] = (),
) -> bytes:
    return _encode(model_name, model_version, inputs, output_names)


def encode_response(model_name: str, model_version: str, outputs: Mapping[str, np.ndarray]) -> bytes:
    return _encode(model_name, model_version, outputs, None)


def _encode(
    model: str, version: str, arrays: Mapping[str, np.ndarray], output_names: Sequence[str] | None
) -> bytes:
    size = sum(a.nbytes for a in arrays.values())
    builder = flatbuffers.Builder(size + 256 + 64 * len(arrays))  # no regrowth (each would copy)
    tensors = [_tensor(builder, name, array) for name, array in arrays.items()]
    tensors_at = _offsets(builder, tensors)
    names_at = None
    if output_names:
        names_at = _offsets(builder, [builder.CreateString(n) for n in output_names])
    model_at, version_at = builder.CreateString(model), builder.CreateString(version)
    builder.StartObject(4 if output_names is not None else 3)
    builder.PrependUOffsetTRelativeSlot(0, model_at, 0)
    builder.PrependUOffsetTRelativeSlot(1, version_at, 0)
    builder.PrependUOffsetTRelativeSlot(2, tensors_at, 0)
    if names_at is not None:
        builder.PrependUOffsetTRelativeSlot(3, names_at, 0)
    builder.Finish(builder.EndObject())
    return bytes(builder.Output())  # gRPC's Python API sends bytes: the one copy out


def _tensor(builder: Any, name: str, array: np.ndarray) -> int:
    datatype = name_of(array.dtype)
    if datatype == "BYTES":
        raise TensorError(f"tensor {name!r}: BYTES tensors are not carried by the FlatBuffers encoding")
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    builder.StartVector(1, data.size, _ALIGN)
    builder.head -= data.size
    np.frombuffer(builder.Bytes, np.uint8, data.size, builder.head)[:] = data  # the one copy in
    builder.vectorNumElems = data.size
    data_at = builder.EndVector()
    builder.StartVector(8, array.ndim, 8)
    for dim in reversed(array.shape):
        builder.PrependInt64(dim)
    shape_at = builder.EndVector()
    name_at, type_at = builder.CreateString(name), builder.CreateString(datatype)
    builder.StartObject(4)
    builder.PrependUOffsetTRelativeSlot(0, name_at, 0)
    builder.PrependUOffsetTRelativeSlot(1, type_at, 0)
    builder.PrependUOffsetTRelativeSlot(2, shape_at, 0)
    builder.PrependUOffsetTRelativeSlot(3, data_at, 0)
    return int(builder.EndObject())


def _offsets(builder: Any, offsets: Sequence[int]) -> int:
    builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return int(builder.EndVector())


# -- decoding ------------------------------------------------------------------------------


def decode_request(buffer: bytes) -> Infer:
    return _decode(buffer, "request", with_names=True)


def decode_response(buffer: bytes) -> Infer:
    return _decode(buffer, "response", with_names=False)


def _decode(buffer: bytes, what: str, with_names: bool) -> Infer:
    try:
        root = Table(buffer, flatbuffers.encode.Get(number_types.UOffsetTFlags.packer_type, buffer, 0))
        tensors: dict[str, np.ndarray] = {}
        for at in _vector_tables(root, 2):
            name, array = _read_tensor(Table(buffer, at))
            if name in tensors:
                raise TensorError(f"tensor {name!r} appears twice")
            tensors[name] = array
        names = tuple(_strings(root, 3)) if with_names else ()
        return Infer(_string(root, 0), _string(root, 1), tensors, names)
    except TensorError:
        raise
    except (IndexError, ValueError, struct.error, TypeError, UnicodeDecodeError, OverflowError):
        raise TensorError(f"the {what} is not a valid modelyard.flat.v1 message") from None


def _read_tensor(table: Table) -> tuple[str, np.ndarray]:
    name, datatype = _string(table, 0), _string(table, 1)
    dtype = NUMPY_BY_NAME.get(datatype)
    if dtype is None or datatype == "BYTES":
        raise TensorError(
            f"tensor {name!r}: datatype {datatype!r} is not carried by the FlatBuffers encoding"
        )
    slot = table.Offset(8)
    shape = tuple(int(d) for d in table.GetVectorAsNumpy(number_types.Int64Flags, slot)) if slot else ()
    count = element_count(shape, name)
    slot = table.Offset(10)
    if not slot:
        raise TensorError(f"tensor {name!r} has no data")
    start, length = table.Vector(slot), table.VectorLen(slot)
    if length != count * dtype.itemsize or start + length > len(table.Bytes):
        raise TensorError(
            f"tensor {name!r}: {length} bytes of data for shape {list(shape)} of {datatype} "
            f"({count * dtype.itemsize} bytes)"
        )
    if start % dtype.alignment:  # a writer that did not align: one copy rather than a fault
        return name, np.frombuffer(bytes(table.Bytes[start : start + length]), dtype).reshape(shape)
    return name, np.frombuffer(table.Bytes, dtype, count, start).reshape(shape)


def _string(table: Table, slot: int) -> str:
    at = table.Offset(4 + 2 * slot)
    return table.String(at + table.Pos).decode("utf-8") if at else ""


def _vector_tables(table: Table, slot: int) -> list[int]:
    at = table.Offset(4 + 2 * slot)
    if not at:
        return []
    start = table.Vector(at)
    return [table.Indirect(start + 4 * i) for i in range(table.VectorLen(at))]


def _strings(table: Table, slot: int) -> list[str]:
    at = table.Offset(4 + 2 * slot)
    if not at:
        return []
    start = table.Vector(at)
    return [table.String(start + 4 * i).decode("utf-8") for i in range(table.VectorLen(at))]
