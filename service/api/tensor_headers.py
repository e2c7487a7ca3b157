"""TensorHeaders (service/intake.py) of both APIs' request tensors, read without decoding them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2.grpc_service_pb2 import ModelInferRequest
from modelyard.service.intake import TensorHeader
from modelyard.tensors import NUMPY_BY_NAME, datatype_name, is_known


def our_headers(tensors: Iterable[tensor_pb2.Tensor]) -> list[TensorHeader]:
    headers = []
    for tensor in tensors:
        name = datatype_name(tensor.datatype)
        headers.append(
            TensorHeader(tensor.name, name, tuple(tensor.shape), len(tensor.raw_data), name == "BYTES")
        )
    return headers


# Datatypes whose raw contents decode without touching elements (np.frombuffer).
_FIXED_SIZE = frozenset(name for name in NUMPY_BY_NAME if name != "BYTES")
# A plain request's header per tensor, made as the tuple it is (`_header(TensorHeader, (...))`):
# a NamedTuple's own __new__ is a Python function, called for every tensor of every request. And
# a shape is read as `tensor.shape[:]` (a list) then made a tuple: tuple(tensor.shape) would
# iterate protobuf's container element by element.
_header = tuple.__new__


# A KServe request's tensors as its servicer hands them to the data plane (Call.take_inputs'
# source): its inputs and raw_input_contents (each read once by the servicer: each read of a
# protobuf field makes a new object), then the request and the call's context.
KServeSource = tuple[Sequence[ModelInferRequest.InferInputTensor], Sequence[bytes], ModelInferRequest, Any]


def kserve_plain(source: KServeSource) -> tuple[list[TensorHeader], list[bytes]] | None:
    """The headers and raw contents of a plain request (most): every input in
    raw_input_contents, one raw entry per input, of a fixed-size datatype, with no parameters (no
    shared memory) and no typed contents. Its tensors decode from their headers and these bytes
    (decode_fixed); each raw entry is read once (protobuf copies a bytes field on every read).
    None for any other request: kserve_headers and decode_inputs take it, with their answers.
    Called on the source as it is (no wrapper of the servicer's): it runs on every request."""
    inputs, raw = source[0], source[1]
    if len(raw) != len(inputs):
        return None
    headers, contents = [], []
    for index in range(len(raw)):  # by index: cheaper than zip over two protobuf containers
        tensor, data = inputs[index], raw[index]
        datatype = tensor.datatype
        if datatype not in _FIXED_SIZE or tensor.parameters or tensor.HasField("contents"):
            return None
        headers.append(
            _header(TensorHeader, (tensor.name, datatype, tuple(tensor.shape[:]), len(data), False))
        )
        contents.append(data)
    return headers, contents


def our_plain(tensors: Iterable[tensor_pb2.Tensor]) -> tuple[list[TensorHeader], list[bytes]] | None:
    """Our API's request tensors as kserve_plain reads KServe's: when every tensor is of a
    fixed-size datatype, their headers and raw_data (each read once); else None (our_headers and
    modelyard.tensors.to_arrays take them, with their answers)."""
    headers, contents = [], []
    for tensor in tensors:
        datatype = datatype_name(tensor.datatype)
        if datatype not in _FIXED_SIZE:
            return None
        data = tensor.raw_data
        headers.append(
            _header(TensorHeader, (tensor.name, datatype, tuple(tensor.shape[:]), len(data), False))
        )
        contents.append(data)
    return headers, contents


def kserve_headers(request: ModelInferRequest) -> list[TensorHeader]:
    raw = request.raw_input_contents
    headers = []
    raw_index = 0  # raw contents are given for the inputs outside shared memory only
    for tensor in request.inputs:
        parameters = tensor.parameters
        if "shared_memory_region" in parameters:
            # Its bytes are copied out of the region (per_element: an executor hop when large);
            # a malformed size counts 0 here and is refused by the decoder.
            declared = parameters.get("shared_memory_byte_size")
            kind = declared.WhichOneof("parameter_choice") if declared is not None else None
            nbytes = max(0, getattr(declared, kind)) if kind in ("int64_param", "uint64_param") else 0
            per_element = True
        elif raw:
            nbytes = len(raw[raw_index]) if raw_index < len(raw) else 0
            raw_index += 1
            per_element = tensor.datatype == "BYTES"
        else:
            nbytes = tensor.contents.ByteSize()  # computed in C, without touching elements in Python
            per_element = True
        datatype = tensor.datatype if is_known(tensor.datatype) else None  # the decoder names it
        headers.append(TensorHeader(tensor.name, datatype, tuple(tensor.shape), nbytes, per_element))
    return headers
