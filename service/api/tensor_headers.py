"""TensorHeaders (service/intake.py) of both APIs' request tensors, read without decoding them."""

from __future__ import annotations

from collections.abc import Iterable

from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2.grpc_service_pb2 import ModelInferRequest
from modelyard.tensors import datatype_name, is_known

from service.intake import TensorHeader


def our_headers(tensors: Iterable[tensor_pb2.Tensor]) -> list[TensorHeader]:
    headers = []
    for tensor in tensors:
        name = datatype_name(tensor.datatype)
        headers.append(
            TensorHeader(tensor.name, name, tuple(tensor.shape), len(tensor.raw_data), name == "BYTES")
        )
    return headers


def kserve_headers(request: ModelInferRequest) -> list[TensorHeader]:
    raw = request.raw_input_contents
    headers = []
    for index, tensor in enumerate(request.inputs):
        if raw:
            nbytes = len(raw[index]) if index < len(raw) else 0
            per_element = tensor.datatype == "BYTES"
        else:
            nbytes = tensor.contents.ByteSize()  # computed in C, without touching elements in Python
            per_element = True
        datatype = tensor.datatype if is_known(tensor.datatype) else None  # the decoder names it
        headers.append(TensorHeader(tensor.name, datatype, tuple(tensor.shape), nbytes, per_element))
    return headers
