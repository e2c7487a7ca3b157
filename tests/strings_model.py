"""String models for the BYTES tests (ONNX Runtime string tensors)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from models.demo_models import IR_VERSION, OPSET, make_model


def string_identity(batch: bool = True) -> onnx.ModelProto:
    """TEXT BYTES [batch, n] -> ECHO BYTES [batch, n] (or [n] without a batch dimension)."""
    shape: list[int | str | None] = ["batch", "n"] if batch else ["n"]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["TEXT"], ["ECHO"])],
        "string_identity",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, shape)],
        [helper.make_tensor_value_info("ECHO", TensorProto.STRING, shape)],
    )
    return make_model(graph, "Identity on a string tensor")


def byte_lookup(keys: list[bytes], batch: bool = True) -> onnx.ModelProto:
    """TEXT BYTES [batch, n] -> ID INT64 [batch, n]: each element's index in `keys` (any bytes:
    ONNX Runtime compares them as bytes), -1 for any other (ai.onnx.ml LabelEncoder)."""
    shape: list[int | str | None] = ["batch", "n"] if batch else ["n"]
    node = helper.make_node(
        "LabelEncoder",
        ["TEXT"],
        ["ID"],
        domain="ai.onnx.ml",
        keys_strings=keys,
        values_int64s=list(range(len(keys))),
        default_int64=-1,
    )
    graph = helper.make_graph(
        [node],
        "byte_lookup",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, shape)],
        [helper.make_tensor_value_info("ID", TensorProto.INT64, shape)],
    )
    model = helper.make_model(
        graph,
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("ai.onnx.ml", 2)],
        producer_name="tests.strings_model",
        doc_string="LabelEncoder of byte strings",
    )
    onnx.checker.check_model(model, full_check=True)
    return model
