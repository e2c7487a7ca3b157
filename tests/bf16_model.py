"""A BF16 model for the BF16 tests: y = x + x in BF16 (through FP32, as ORT's CPU kernels need)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from models.demo_models import make_model


def bf16_double(features: int = 4) -> onnx.ModelProto:
    """X BF16 [batch, features] -> Y BF16 [batch, features] = 2x, and Y32 FP32 = 2x."""
    nodes = [
        helper.make_node("Cast", ["X"], ["x32"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x32", "x32"], ["Y32"]),
        helper.make_node("Cast", ["Y32"], ["Y"], to=TensorProto.BFLOAT16),
    ]
    graph = helper.make_graph(
        nodes,
        "bf16_double",
        [helper.make_tensor_value_info("X", TensorProto.BFLOAT16, ["batch", features])],
        [
            helper.make_tensor_value_info("Y", TensorProto.BFLOAT16, ["batch", features]),
            helper.make_tensor_value_info("Y32", TensorProto.FLOAT, ["batch", features]),
        ],
    )
    return make_model(graph, "BF16 doubling")
