"""A string Identity model for the BYTES tests (ONNX Runtime string tensors)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from models.demo_models import make_model


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
