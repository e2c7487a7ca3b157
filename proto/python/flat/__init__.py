"""modelyard.flat.v1 (proto/modelyard/flat/v1/inference.fbs): Infer requests and responses as
FlatBuffers, for large tensors. Decoding gives numpy arrays that are read-only views of the
received bytes (no copy); encoding writes each array into the message. Malformed input raises
TensorError, as modelyard.tensors does. Needs numpy and flatbuffers ('modelyard[client]').

The tables are read and written through the accessors and builder functions that flatc generates
from the schema (modelyard.flat.v1.*, `make gen`; never edited by hand); this module only adds
the numpy views over them and the checks.

gRPC method: /modelyard.flat.v1.Inference/Infer, bytes in and out:

    answer = channel.unary_unary(flat.METHOD, None, None)(flat.encode_request("m", {"x": array}))
    response = flat.decode_response(answer)
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import flatbuffers
import numpy as np

from modelyard.flat.v1 import InferRequest as request_table
from modelyard.flat.v1 import InferResponse as response_table
from modelyard.flat.v1 import Tensor as tensor_table
from modelyard.tensors import NUMPY_BY_NAME, TensorError, element_count, name_of

METHOD = "/modelyard.flat.v1.Inference/Infer"
SERVICE, METHOD_NAME = "modelyard.flat.v1.Inference", "Infer"
_ALIGN = 16  # a tensor's data starts on 16 bytes, so a view of any element type is aligned


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
    builder = _builder(inputs)
    tensors_at = _tensors(builder, inputs, request_table.InferRequestStartInputsVector)
    names_at = None
    if output_names:
        names = [builder.CreateString(n) for n in output_names]
        request_table.InferRequestStartOutputNamesVector(builder, len(names))
        names_at = _end_offsets(builder, names)
    model_at, version_at = builder.CreateString(model_name), builder.CreateString(model_version)
    request_table.InferRequestStart(builder)
    request_table.InferRequestAddModelName(builder, model_at)
    request_table.InferRequestAddModelVersion(builder, version_at)
    request_table.InferRequestAddInputs(builder, tensors_at)
    if names_at is not None:
        request_table.InferRequestAddOutputNames(builder, names_at)
    return _finish(builder, request_table.InferRequestEnd(builder))


def encode_response(model_name: str, model_version: str, outputs: Mapping[str, np.ndarray]) -> bytes:
    builder = _builder(outputs)
    tensors_at = _tensors(builder, outputs, response_table.InferResponseStartOutputsVector)
    model_at, version_at = builder.CreateString(model_name), builder.CreateString(model_version)
    response_table.InferResponseStart(builder)
    response_table.InferResponseAddModelName(builder, model_at)
    response_table.InferResponseAddModelVersion(builder, version_at)
    response_table.InferResponseAddOutputs(builder, tensors_at)
    return _finish(builder, response_table.InferResponseEnd(builder))


def _builder(arrays: Mapping[str, np.ndarray]) -> flatbuffers.Builder:
    size = sum(a.nbytes for a in arrays.values())
    return flatbuffers.Builder(size + 256 + 64 * len(arrays))  # no regrowth (each would copy)


def _tensors(
    builder: flatbuffers.Builder, arrays: Mapping[str, np.ndarray], start_vector: Callable[[Any, int], Any]
) -> int:
    tensors = [_tensor(builder, name, array) for name, array in arrays.items()]
    start_vector(builder, len(tensors))
    return _end_offsets(builder, tensors)


def _tensor(builder: flatbuffers.Builder, name: str, array: np.ndarray) -> int:
    datatype = name_of(array.dtype)
    if datatype == "BYTES":
        raise TensorError(f"tensor {name!r}: BYTES tensors are not carried by the FlatBuffers encoding")
    # The Builder's public API writes a byte vector from bytes or a bytearray only: the array's
    # bytes (row-major) are staged in a bytearray, which CreateByteVector copies in once (bytes
    # it would copy twice). Through the array's memoryview (.data): bytearray() of a 0-d integer
    # array would take it for a length. Aligned here, since the generated data starter aligns to 1.
    try:
        staged = bytearray(array.data)
    except ValueError:  # numpy exports no buffer of ml_dtypes' types (BF16): of their bytes then
        staged = bytearray(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    builder.Prep(_ALIGN, len(staged))
    data_at = builder.CreateByteVector(staged)
    tensor_table.TensorStartShapeVector(builder, array.ndim)
    for dim in reversed(array.shape):
        builder.PrependInt64(dim)
    shape_at = builder.EndVector()
    name_at, type_at = builder.CreateString(name), builder.CreateString(datatype)
    tensor_table.TensorStart(builder)
    tensor_table.TensorAddName(builder, name_at)
    tensor_table.TensorAddDatatype(builder, type_at)
    tensor_table.TensorAddShape(builder, shape_at)
    tensor_table.TensorAddData(builder, data_at)
    return int(tensor_table.TensorEnd(builder))


def _end_offsets(builder: flatbuffers.Builder, offsets: Sequence[int]) -> int:
    """Fills and ends the offset vector just started by a generated Start...Vector."""
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return int(builder.EndVector())


def _finish(builder: flatbuffers.Builder, root: int) -> bytes:
    builder.Finish(root)
    # gRPC's Python API sends bytes: the one copy out (Output() would copy twice, via a bytearray).
    return bytes(memoryview(builder.Bytes)[builder.Head() :])


# -- decoding ------------------------------------------------------------------------------


def decode_request(buffer: bytes) -> Infer:
    try:
        root = request_table.InferRequest.GetRootAs(buffer, 0)
        inputs = _read_tensors([root.Inputs(j) for j in range(root.InputsLength())])
        names = tuple(root.OutputNames(j).decode("utf-8") for j in range(root.OutputNamesLength()))
        return Infer(_text(root.ModelName()), _text(root.ModelVersion()), inputs, names)
    except TensorError:
        raise
    except _MALFORMED:
        raise TensorError("the request is not a valid modelyard.flat.v1 message") from None


def decode_response(buffer: bytes) -> Infer:
    try:
        root = response_table.InferResponse.GetRootAs(buffer, 0)
        outputs = _read_tensors([root.Outputs(j) for j in range(root.OutputsLength())])
        return Infer(_text(root.ModelName()), _text(root.ModelVersion()), outputs)
    except TensorError:
        raise
    except _MALFORMED:
        raise TensorError("the response is not a valid modelyard.flat.v1 message") from None


# What the generated accessors raise on bytes that are not a message (offsets out of range, ...);
# TensorError, a ValueError, is re-raised first.
_MALFORMED = (IndexError, ValueError, struct.error, TypeError, UnicodeDecodeError, OverflowError)


def _read_tensors(tables: list[tensor_table.Tensor]) -> dict[str, np.ndarray]:
    """The tensors of a vector whose tables were all located first (a broken vector fails whole)."""
    tensors: dict[str, np.ndarray] = {}
    for table in tables:
        name, array = _read_tensor(table)
        if name in tensors:
            raise TensorError(f"tensor {name!r} appears twice")
        tensors[name] = array
    return tensors


def _read_tensor(table: tensor_table.Tensor) -> tuple[str, np.ndarray]:
    name, datatype = _text(table.Name()), _text(table.Datatype())
    dtype = NUMPY_BY_NAME.get(datatype)
    if dtype is None or datatype == "BYTES":
        raise TensorError(
            f"tensor {name!r}: datatype {datatype!r} is not carried by the FlatBuffers encoding"
        )
    dims = table.ShapeAsNumpy()  # the generated accessors give 0 for a vector that is absent
    shape = tuple(dims.tolist()) if isinstance(dims, np.ndarray) else ()
    count = element_count(shape, name)
    try:
        data = table.DataAsNumpy()  # a uint8 view of the message: no copy
    except ValueError:  # the vector runs past the end of the message
        data = None
    if isinstance(data, int):
        raise TensorError(f"tensor {name!r} has no data")
    if data is None or data.size != count * dtype.itemsize:
        raise TensorError(
            f"tensor {name!r}: {table.DataLength()} bytes of data for shape {list(shape)} of "
            f"{datatype} ({count * dtype.itemsize} bytes)"
        )
    array = data.view(dtype)
    if not array.flags.aligned:  # a writer that did not align: one copy rather than a fault
        array = np.frombuffer(data.tobytes(), dtype)
    return name, array.reshape(shape)


def _text(value: bytes | None) -> str:
    return value.decode("utf-8") if value else ""
