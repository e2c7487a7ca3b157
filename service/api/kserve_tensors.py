"""KServe V2 tensors (ModelInferRequest / ModelInferResponse) <-> numpy arrays.

Pure conversions for the KServe servicer: no gRPC, no model logic. Inputs may come either as
`raw_input_contents` (one entry per input, in the order of `inputs`: little-endian elements, or
length-prefixed elements for BYTES) or as typed `contents`; outputs are always written as
`raw_output_contents`, which is what tritonclient reads. Every problem with a request raises
InvalidInput naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from modelyard.kserve.v2.grpc_service_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from modelyard.tensors import NUMPY_BY_NAME, TensorError, decode_bytes, element_count, to_wire

from service.errors import InvalidInput, Unsupported

Array = npt.NDArray[Any]

# The typed `contents` field that carries each datatype (FP16 has none: it travels raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# The element type of each typed field, before narrowing to the tensor's datatype.
_FIELD_DTYPE = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}

_KNOWN = ", ".join(NUMPY_BY_NAME)

_InputTensor = ModelInferRequest.InferInputTensor


def decode_inputs(request: ModelInferRequest) -> dict[str, Array]:
    """The request's input tensors as arrays, by name.

    Arrays decoded from raw contents are read-only, zero-copy views of the request's bytes; BYTES
    tensors become object arrays of `bytes`.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        if len(raw) < len(request.inputs):
            missing = request.inputs[len(raw)].name
            raise InvalidInput(
                f"input {missing!r} has no raw_input_contents entry: the request has "
                f"{len(request.inputs)} inputs but {len(raw)} raw entries (raw contents must be "
                "given for every input, in the order of 'inputs')"
            )
        raise InvalidInput(
            f"the request has {len(raw)} raw_input_contents entries but only {len(request.inputs)} inputs"
        )
    arrays: dict[str, Array] = {}
    for index, tensor in enumerate(request.inputs):
        if not tensor.name:
            raise InvalidInput(f"input #{index} has no name")
        if tensor.name in arrays:
            raise InvalidInput(f"input {tensor.name!r} is given more than once")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput(
                    f"input {tensor.name!r}: 'contents' must not be set when raw_input_contents is used"
                )
            arrays[tensor.name] = _from_raw(tensor, raw[index])
        else:
            arrays[tensor.name] = _from_contents(tensor)
    return arrays


def encode_outputs(response: ModelInferResponse, outputs: Mapping[str, npt.ArrayLike]) -> None:
    """Append each array to the response as an output tensor with its data in raw_output_contents."""
    if len(response.outputs) != len(response.raw_output_contents):
        raise ValueError("response already holds outputs without raw contents; cannot append raw outputs")
    for name, value in outputs.items():
        array = np.asarray(value)
        try:
            datatype, data = to_wire(array)
        except ValueError:
            raise Unsupported(
                f"output {name!r}: numpy dtype {array.dtype} has no KServe V2 datatype"
            ) from None
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(data)


def requested_outputs(request: ModelInferRequest) -> list[str]:
    """The names of the requested outputs, in order; an empty list means all outputs."""
    names: list[str] = []
    for output in request.outputs:
        if not output.name:
            raise InvalidInput("a requested output has no name")
        if output.name in names:
            raise InvalidInput(f"output {output.name!r} is requested more than once")
        names.append(output.name)
    return names


def parameter_value(parameter: InferParameter) -> bool | int | str | float | None:
    """The value held by an InferParameter's oneof, or None when none is set."""
    match parameter.WhichOneof("parameter_choice"):
        case "bool_param":
            return parameter.bool_param
        case "int64_param":
            return parameter.int64_param
        case "string_param":
            return parameter.string_param
        case "double_param":
            return parameter.double_param
        case "uint64_param":
            return parameter.uint64_param
        case _:
            return None


def _checked_shape(tensor: _InputTensor) -> tuple[tuple[int, ...], int, np.dtype[Any]]:
    dtype = NUMPY_BY_NAME.get(tensor.datatype)
    if dtype is None:
        raise InvalidInput(f"input {tensor.name!r}: unknown datatype {tensor.datatype!r} (known: {_KNOWN})")
    shape = tuple(tensor.shape)
    try:
        count = element_count(shape, tensor.name)
    except TensorError as exc:
        raise InvalidInput(str(exc)) from None
    return shape, count, dtype


def _from_raw(tensor: _InputTensor, data: bytes) -> Array:
    shape, count, dtype = _checked_shape(tensor)
    if tensor.datatype == "BYTES":
        try:
            return decode_bytes(data, shape, tensor.name)
        except TensorError as exc:
            raise InvalidInput(str(exc)) from None
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(shape)} of {tensor.datatype} needs {expected} bytes of "
            f"raw data, got {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _from_contents(tensor: _InputTensor) -> Array:
    shape, count, dtype = _checked_shape(tensor)
    field = _CONTENTS_FIELD.get(tensor.datatype)
    contents: InferTensorContents = tensor.contents
    given = [descriptor.name for descriptor, _ in contents.ListFields()]
    if field is None:  # FP16: no typed field exists for it.
        if count == 0 and not given:
            return np.empty(shape, dtype=dtype)
        raise InvalidInput(
            f"input {tensor.name!r}: {tensor.datatype} data must be sent in raw_input_contents"
        )
    stray = [name for name in given if name != field]
    if stray:
        raise InvalidInput(
            f"input {tensor.name!r}: datatype {tensor.datatype} takes its data in {field}, "
            f"got {', '.join(stray)}"
        )
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(shape)} needs {count} elements in {field}, got {len(values)}"
        )
    if tensor.datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    wide = np.fromiter(values, dtype=_FIELD_DTYPE[field], count=count)
    if dtype != wide.dtype and count and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if int(wide.min()) < info.min or int(wide.max()) > info.max:
            raise InvalidInput(
                f"input {tensor.name!r}: a value in {field} is outside the range of {tensor.datatype} "
                f"[{info.min}, {info.max}]"
            )
    return wide.astype(dtype, copy=False).reshape(shape)
