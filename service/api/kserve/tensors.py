"""KServe V2 tensors (ModelInferRequest / ModelInferResponse) <-> numpy arrays.

Pure conversions for the KServe servicer: no gRPC, no model logic. Inputs may come either as
`raw_input_contents` (one entry per input, in the order of `inputs`: little-endian elements, or
length-prefixed elements for BYTES) or as typed `contents`; outputs are always written as
`raw_output_contents`, which is what tritonclient reads. Every problem with a request raises
InvalidInput naming the tensor.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from modelyard.kserve.v2.grpc_service_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from modelyard.service.answers import ShmLocation
from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput, Unsupported
from modelyard.service.shm.registry import Regions
from modelyard.tensors import NUMPY_BY_NAME, TensorError, decode_bytes, element_count, name_of, to_wire

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

# Triton's tensor parameters for shared memory.
_SHM_REGION = "shared_memory_region"
_SHM_OFFSET = "shared_memory_offset"
_SHM_SIZE = "shared_memory_byte_size"
_SHM_KEYS = (_SHM_REGION, _SHM_OFFSET, _SHM_SIZE)


def decode_inputs(request: ModelInferRequest, shm: Regions | None = None) -> dict[str, Array]:
    """The request's input tensors as arrays, by name.

    Arrays decoded from raw contents are read-only, zero-copy views of the request's bytes (or of
    a shared memory region, for an input that names one); BYTES tensors become object arrays of
    `bytes`. Raw contents are given for the inputs not in shared memory, in their order.
    """
    located = [_shm_location(tensor, "input") for tensor in request.inputs]
    inline = [t for t, at in zip(request.inputs, located, strict=True) if at is None]
    raw = request.raw_input_contents
    if raw:
        for tensor in inline:
            if tensor.HasField("contents"):
                # Triton's words, which its clients match; checked before the counts, as Triton does.
                raise InvalidInput(
                    f"contents field must not be specified when using raw_input_contents for "
                    f"{quoted(tensor.name)} for model {quoted(request.model_name)}"
                )
    if raw and len(raw) != len(inline):
        if len(raw) < len(inline):
            missing = inline[len(raw)].name
            raise InvalidInput(
                f"input {quoted(missing)} has no raw_input_contents entry: the request has "
                f"{len(inline)} inputs {'outside shared memory ' if len(inline) < len(located) else ''}"
                f"but {len(raw)} raw entries (raw contents must be given for every input, in the order "
                "of 'inputs')"
            )
        raise InvalidInput(
            f"the request has {len(raw)} raw_input_contents entries but only {len(inline)} inputs"
        )
    arrays: dict[str, Array] = {}
    raw_index = 0
    for index, (tensor, at) in enumerate(zip(request.inputs, located, strict=True)):
        if not tensor.name:
            raise InvalidInput(f"input #{index} has no name")
        if tensor.name in arrays:
            raise InvalidInput(f"input {quoted(tensor.name)} is given more than once")
        if at is not None:
            if tensor.HasField("contents"):
                raise InvalidInput(
                    f"input {quoted(tensor.name)}: 'contents' must not be set with shared memory"
                )
            if shm is None:
                raise Unsupported(f"input {quoted(tensor.name)}: shared memory is not enabled on this server")
            region, offset, size = at
            arrays[tensor.name] = _from_raw(tensor, shm.read(region, offset, size, tensor.name))
        elif raw:
            arrays[tensor.name] = _from_raw(tensor, raw[raw_index])
            raw_index += 1
        else:
            arrays[tensor.name] = _from_contents(tensor)
    return arrays


def encode_outputs(
    response: ModelInferResponse, outputs: Mapping[str, npt.ArrayLike], in_shm: Collection[str] = ()
) -> None:
    """Append each array to the response as an output tensor with its data in raw_output_contents;
    one named in `in_shm` was written into its shared memory region (answers.write_to_regions),
    so that, as Triton, it gets an empty raw entry (raw contents stay aligned with outputs)."""
    # Each container read once: each read of a protobuf field makes a new object.
    tensors, raw = response.outputs, response.raw_output_contents
    if len(tensors) != len(raw):
        raise ValueError("response already holds outputs without raw contents; cannot append raw outputs")
    add, append = tensors.add, raw.append
    for name, value in outputs.items():
        array = np.asarray(value)
        try:
            if in_shm and name in in_shm:
                datatype, data = name_of(array.dtype), b""
            else:
                datatype, data = to_wire(array)
        except ValueError:
            raise Unsupported(
                f"output {quoted(name)}: numpy dtype {array.dtype} has no KServe V2 datatype"
            ) from None
        add(name=name, datatype=datatype, shape=array.shape)
        append(data)


def requested_outputs(outputs: Sequence[ModelInferRequest.InferRequestedOutputTensor]) -> list[str]:
    """The names of the requested outputs (a request's `outputs`, read once by the caller), in
    order; an empty list means all outputs."""
    names: list[str] = []
    if not outputs:  # all outputs (most requests)
        return names
    for output in outputs:
        if not output.name:
            raise InvalidInput("a requested output has no name")
        if output.name in names:
            raise InvalidInput(f"output {quoted(output.name)} is requested more than once")
        names.append(output.name)
    return names


@dataclass(frozen=True)
class OutputOptions:
    """What the requested outputs ask beyond their names: Triton's classification (k, by output)
    and shared memory (region, offset, byte size, by output)."""

    classify: dict[str, int] = field(default_factory=dict)
    in_shm: dict[str, ShmLocation] = field(default_factory=dict)


# The options of a request whose outputs ask nothing beyond their names (most): read, never written.
NO_OPTIONS = OutputOptions()


def output_options(outputs: Sequence[ModelInferRequest.InferRequestedOutputTensor]) -> OutputOptions:
    """The requested outputs' parameters (a request's `outputs`); any we do not handle is refused,
    never ignored."""
    if not outputs or not any(output.parameters for output in outputs):
        return NO_OPTIONS
    options = OutputOptions()
    for output in outputs:
        at = _shm_location(output, "output")
        if at is not None:
            options.in_shm[output.name] = at
        for key, value in output.parameters.items():
            if key == "classification":
                count = parameter_value(value)
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise InvalidInput(
                        f"output {quoted(output.name)}: parameter 'classification' must be a positive integer"
                    )
                options.classify[output.name] = count
            elif key not in _SHM_KEYS:
                raise InvalidInput(f"output {quoted(output.name)}: unknown parameter {quoted(key)}")
    return options


def _shm_location(tensor: Any, kind: str) -> ShmLocation | None:
    """(region, offset, byte size) when the tensor's parameters put it in shared memory."""
    parameters = tensor.parameters
    if not any(key in parameters for key in _SHM_KEYS):
        return None
    region = parameter_value(parameters[_SHM_REGION]) if _SHM_REGION in parameters else None
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{kind} {quoted(tensor.name)}: shared_memory_region must name a region")
    values = []
    for key in (_SHM_OFFSET, _SHM_SIZE):
        value = parameter_value(parameters[key]) if key in parameters else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{kind} {quoted(tensor.name)}: {key} must be a non-negative integer")
        values.append(value)
    if _SHM_SIZE not in parameters:
        raise InvalidInput(f"{kind} {quoted(tensor.name)}: shared memory needs shared_memory_byte_size")
    return region, values[0], values[1]


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
        raise InvalidInput(
            f"input {quoted(tensor.name)}: unknown datatype {quoted(tensor.datatype)} (known: {_KNOWN})"
        )
    shape = tuple(tensor.shape)
    try:
        count = element_count(shape, tensor.name)
    except TensorError as exc:
        raise InvalidInput(str(exc)) from None
    return shape, count, dtype


def _from_raw(tensor: _InputTensor, data: bytes | memoryview) -> Array:
    shape, count, dtype = _checked_shape(tensor)
    if tensor.datatype == "BYTES":
        try:
            return decode_bytes(data, shape, tensor.name)
        except TensorError as exc:
            raise InvalidInput(str(exc)) from None
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"input {quoted(tensor.name)}: shape {list(shape)} of {tensor.datatype} needs {expected} "
            f"bytes of raw data, got {len(data)}"
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
            f"input {quoted(tensor.name)}: {tensor.datatype} data must be sent in raw_input_contents"
        )
    stray = [name for name in given if name != field]
    if stray:
        raise InvalidInput(
            f"input {quoted(tensor.name)}: datatype {tensor.datatype} takes its data in {field}, "
            f"got {', '.join(stray)}"
        )
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input {quoted(tensor.name)}: shape {list(shape)} needs {count} elements in {field}, "
            f"got {len(values)}"
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
                f"input {quoted(tensor.name)}: a value in {field} is outside the range of {tensor.datatype} "
                f"[{info.min}, {info.max}]"
            )
    return wide.astype(dtype, copy=False).reshape(shape)
