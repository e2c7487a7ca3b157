"""Graphs whose work follows their inputs' values, for the runtime's hostile-input tests and the
hostile soak (bench/soak_hostile.py): a Loop whose trip count is an input (minutes of work from 8
bytes), a ConstantOfShape whose shape is an input (gigabytes from 16 bytes) and a Reshape whose
shape is an input (a failure from values)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from models.demo_models import BATCH_DIM, make_model

# About 1 us an iteration on this machine: 10**9 iterations keep a core busy for a quarter hour.
FOREVER = 10**9


def _counting_body() -> onnx.GraphProto:
    """A Loop body: keep going, add one to the carried [1] float."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    return helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
        ],
        "count",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1]),
        ],
        [one],
    )


def _loop_nodes(trip: str) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Constant", [], ["go"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node(
            "Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])
        ),
        helper.make_node("Loop", [trip, "go", "zero"], ["COUNT"], body=_counting_body()),
    ]


def spin() -> onnx.ModelProto:
    """N (INT64 [1]) -> COUNT (FP32 [1]) = N, counted one Loop iteration at a time."""
    nodes = [helper.make_node("Squeeze", ["N"], ["trip"]), *_loop_nodes("trip")]
    graph = helper.make_graph(
        nodes,
        "spin",
        [helper.make_tensor_value_info("N", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("COUNT", TensorProto.FLOAT, [1])],
    )
    return make_model(graph, "counts to its input, one Loop iteration at a time")


def batched_spin() -> onnx.ModelProto:
    """N (INT64 [batch, 1]) -> COUNT (FP32 [batch, 1]): every row gets max(N), counted."""
    nodes = [
        helper.make_node("ReduceMax", ["N"], ["trip"], keepdims=0),
        *_loop_nodes("trip"),
        helper.make_node("Cast", ["N"], ["n_float"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["n_float", "zero_row"], ["rows"]),
        helper.make_node("Add", ["rows", "COUNT"], ["OUT"]),
    ]
    zero_row = helper.make_tensor("zero_row", TensorProto.FLOAT, [1], [0.0])
    graph = helper.make_graph(
        nodes,
        "batched_spin",
        [helper.make_tensor_value_info("N", TensorProto.INT64, [BATCH_DIM, 1])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [BATCH_DIM, 1])],
        [zero_row],
    )
    return make_model(graph, "counts to the largest of its inputs, for every row")


def filled() -> onnx.ModelProto:
    """SHAPE (INT64 [2]) -> TOTAL (FP32 []) = the sum of a tensor of ones of that shape."""
    graph = helper.make_graph(
        [
            helper.make_node(
                "ConstantOfShape",
                ["SHAPE"],
                ["ones"],
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
            ),
            helper.make_node("ReduceSum", ["ones"], ["TOTAL"], keepdims=0),
        ],
        "filled",
        [helper.make_tensor_value_info("SHAPE", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("TOTAL", TensorProto.FLOAT, [])],
    )
    return make_model(graph, "sums a tensor of ones of the shape it is given")


def reshaped() -> onnx.ModelProto:
    """X (FP32 [4]) and SHAPE (INT64 [2]) -> Y = X reshaped to SHAPE + [4, 1] (zeros: [4, 1])."""
    base = helper.make_tensor("base", TensorProto.INT64, [2], [4, 1])
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["SHAPE", "base"], ["target"]),
            helper.make_node("Reshape", ["X", "target"], ["Y"]),
        ],
        "reshaped",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("SHAPE", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None])],
        [base],
    )
    return make_model(graph, "reshapes its input to the shape it is given")
