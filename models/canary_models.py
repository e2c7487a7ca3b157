"""Stable and canary versions of one model for the sidecar's canary judgement (issue 34): the same
signature, INPUT0 FP32 [batch, 4] -> OUTPUT0 FP32 [batch, 4] = INPUT0 + 1, so the sidecar may send
a request to either. What tells them apart is a plausible canary bug or a cost:

- `adds_one(work)`: stable (and a healthy canary): adds one, after a Loop of `work` iterations
  (about a microsecond each, one core: a CPU-heavy graph when `work` is large);
- `reshape_bug()`: the same, but through a Reshape of the input to the constant [1, 4], right at
  batch 1 only (as its warm-up ran): the service answers a batch of 2 `model_rejected`.

Every version also looks each input value up in a table of 8 (Gather, the values cast to INT64):
a value outside -8..7 is refused inside the graph on every version (`model_rejected` again), a
request that no version serves, the client's own fault.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from models.demo_models import BATCH_DIM, make_model

FEATURES = 4
TABLE = 8  # the lookup's size: values from -TABLE to TABLE - 1 are served


def _counting_body() -> onnx.GraphProto:
    """A Loop body: keep going, add one to the carried [1] float."""
    one = helper.make_tensor("one_step", TensorProto.FLOAT, [1], [1.0])
    return helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "one_step"], ["acc_out"]),
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


def _model(reshaped: bool, work: int, name: str) -> onnx.ModelProto:
    """INPUT0 (or its Reshape to [1, 4]) + 1 + 0 x (the lookup's values + the Loop's count)."""
    initializers = [
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("table", TensorProto.FLOAT, [TABLE], [0.0] * TABLE),
        helper.make_tensor("trips", TensorProto.INT64, [], [work]),
        helper.make_tensor("go", TensorProto.BOOL, [], [True]),
        helper.make_tensor("start", TensorProto.FLOAT, [1], [0.0]),
    ]
    nodes = []
    x = "INPUT0"
    if reshaped:
        initializers.append(helper.make_tensor("row_shape", TensorProto.INT64, [2], [1, FEATURES]))
        nodes.append(helper.make_node("Reshape", ["INPUT0", "row_shape"], ["row"]))
        x = "row"
    nodes += [
        helper.make_node("Cast", [x], ["indices"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "indices"], ["looked"]),  # out of range: refused
        helper.make_node("Loop", ["trips", "go", "start"], ["count"], body=_counting_body()),
        helper.make_node("Add", ["looked", "count"], ["noise"]),
        helper.make_node("Mul", ["noise", "zero"], ["nothing"]),
        helper.make_node("Add", [x, "one"], ["plus_one"]),
        helper.make_node("Add", ["plus_one", "nothing"], ["OUTPUT0"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [BATCH_DIM, FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [BATCH_DIM, FEATURES])],
        initializers,
    )
    return make_model(graph, f"{name}: adds one (work {work})")


def adds_one(work: int = 1) -> onnx.ModelProto:
    """Adds one to its input, after `work` Loop iterations (about `work` microseconds of a core)."""
    if work < 1:
        raise ValueError(f"work must be >= 1, got {work}")
    return _model(False, work, "adds_one")


def reshape_bug(work: int = 1) -> onnx.ModelProto:
    """Adds one too, through a Reshape to the constant [1, 4]: a batch of more rows is refused."""
    if work < 1:
        raise ValueError(f"work must be >= 1, got {work}")
    return _model(True, work, "reshape_bug")


# The config both versions are served with: side by side (version_policy all), and the bug's
# output, which ONNX Runtime reads as [1, 4], allowed a schema of its own beside stable's.
CONFIG = {"version_policy": {"all": {}}, "reload": {"allow_schema_change": True}}
