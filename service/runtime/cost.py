"""Whether every run of a graph costs what its warm-up run did, whatever the inputs' values.

Only such a graph may run inline on the event loop: its warm-up time then bounds every run. A
graph whose work follows its inputs' VALUES (ConstantOfShape, Expand, Tile, Range, Pad, Resize,
Reshape or OneHot with a computed shape, NonZero, NonMaxSuppression, a Loop's trip count, an If's
branch...) can be made to run for minutes by a request of a few bytes, so it never runs inline.

The rule (sound, and conservative where ONNX cannot tell):
- every input's shape is fixed, but for a batch dimension bounded by max_batch_size (the graph is
  inspected, and timed, at max_batch_size rows); no BYTES input (its cost follows string lengths);
- ONNX shape inference, with the inputs' shapes fixed and shape values propagated (data_prop),
  gives every tensor of the graph a fully known shape: a tensor whose size it cannot tell has a
  size that follows some value (or an op ONNX does not know, which is treated alike);
- no node holds a subgraph (Loop, If, Scan, or any custom op with one): iteration counts and
  branches follow values.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import shape_inference

from modelyard.service.runtime.signature import Signature

log = logging.getLogger(__name__)

# Larger model files are not parsed a second time at load: a model this big is no microsecond run.
MAX_INSPECTED_BYTES = 64 << 20


def value_driven(model_file: Path, signature: Signature) -> str:
    """'' when every run costs the same whatever the inputs' values, else why not (for the log)."""
    batch = signature.max_batch_size
    fixed: dict[str, list[int]] = {}
    for spec in signature.inputs:
        if spec.datatype == "BYTES":
            return f"input {spec.name!r} holds strings, whose lengths set the cost"
        dims = list(spec.shape)
        if batch and dims and dims[0] == -1:
            dims[0] = batch
        if any(d < 0 for d in dims):
            return f"input {spec.name!r} has a dynamic dimension {list(spec.shape)}"
        fixed[spec.name] = dims
    try:
        if model_file.stat().st_size > MAX_INSPECTED_BYTES:
            return "the model file is too large to inspect"
        model = onnx.load(str(model_file), load_external_data=False)
        for value in model.graph.input:
            given = fixed.get(value.name)
            if given is None or not value.type.HasField("tensor_type"):
                continue
            shape = value.type.tensor_type.shape
            shape.ClearField("dim")
            for d in given:
                shape.dim.add().dim_value = d
        inferred = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # ONNX cannot tell: treated as value-driven
        return f"its shapes cannot be inferred ({type(exc).__name__})"
    graph = inferred.graph
    known = {v.name: v for v in (*graph.value_info, *graph.output, *graph.input)}
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return f"{node.op_type} node {node.name!r} runs a subgraph (iterations or a branch follow values)"
        for name in node.output:
            if name and not _static(known.get(name)):
                return f"the size of {node.op_type} node {node.name!r}'s output {name!r} follows values"
    return ""


def _static(value: onnx.ValueInfoProto | None) -> bool:
    if value is None or not value.type.HasField("tensor_type"):
        return False
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return False
    return all(d.HasField("dim_value") and d.dim_value >= 0 for d in tensor.shape.dim)
