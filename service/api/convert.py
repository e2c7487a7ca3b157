"""Schema messages of our API from the runtime's tensor specs (tensors themselves convert in
modelyard.tensors, the same code clients use)."""

from __future__ import annotations

from collections.abc import Iterable

from modelyard.inference.v1 import tensor_pb2
from modelyard.service.runtime.signature import TensorSpec
from modelyard.tensors import datatype_value


def to_specs(specs: Iterable[TensorSpec]) -> list[tensor_pb2.TensorSpec]:
    return [
        tensor_pb2.TensorSpec(name=s.name, datatype=datatype_value(s.datatype), shape=s.shape) for s in specs
    ]
