"""Stateful and decoupled models for the Triton parity tests, built with onnx.helper.

- `simple_sequence`: Triton's example of that name (docs/examples/model_repository): OUTPUT =
  (INPUT + START) * READY, INT32 [batch, 1], controls START and READY (int32 0/1), direct.
- `simple_dyna_sequence`: Triton's `simple_dyna_sequence`: OUTPUT = READY * (INPUT + START +
  END * CORRID), CORRID UINT64, strategy oldest.
- `simple_string_dyna_sequence`: Triton's (a custom backend there): the running sum of the
  inputs as implicit state, + the correlation id (a string, CORRID BYTES) at END.
- `accumulator`: implicit state: OUTPUT_STATE = INPUT + INPUT_STATE * (1 - START), OUTPUT the
  same (the running sum of a sequence's inputs), Triton's create_onnx_modelfile_wo_initial_state.
- `counter`: FP32 state with an initial_state (zeros or a file): OUTPUT = STATE_IN + INPUT, no
  controls.
- `repeat_int32`: Triton's repeat example's model as a plain graph: OUT = IN, IDX = the run index
  the service feeds (decoupled.repeat splits IN and DELAY element by element).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from models.demo_models import make_model, write_model

INT32 = TensorProto.INT32
ROW: list[int | str | None] = ["batch", 1]


def _int32_controls(*names: str) -> list[dict[str, Any]]:
    kinds = {"START": "start", "END": "end", "READY": "ready"}
    return [{"name": n, "kind": kinds[n], "datatype": "INT32", "false_true": [0, 1]} for n in names]


def simple_sequence() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "START"], ["sum"]),
            helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
        ],
        "simple_sequence",
        [helper.make_tensor_value_info(n, INT32, ROW) for n in ("INPUT", "START", "READY")],
        [helper.make_tensor_value_info("OUTPUT", INT32, ROW)],
    )
    return make_model(graph, "Triton's simple_sequence: (INPUT + START) * READY")


def simple_dyna_sequence() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["CORRID"], ["corrid"], to=INT32),
            helper.make_node("Add", ["INPUT", "START"], ["sum0"]),
            helper.make_node("Mul", ["END", "corrid"], ["mul0"]),
            helper.make_node("Add", ["sum0", "mul0"], ["sum1"]),
            helper.make_node("Mul", ["READY", "sum1"], ["OUTPUT"]),
        ],
        "simple_dyna_sequence",
        [helper.make_tensor_value_info(n, INT32, ROW) for n in ("INPUT", "START", "END", "READY")]
        + [helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ROW)],
        [helper.make_tensor_value_info("OUTPUT", INT32, ROW)],
    )
    return make_model(graph, "Triton's simple_dyna_sequence: READY * (INPUT + START + END * CORRID)")


def simple_string_dyna_sequence() -> onnx.ModelProto:
    """Triton's simple_string_dyna_sequence (a custom backend there): the running sum of the
    sequence's inputs as implicit state, plus the correlation id (a string holding an integer,
    CORRID BYTES) on the END step: OUTPUT = READY * (STATE + END * int(CORRID))."""
    one = helper.make_tensor("one", INT32, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["not_start"]),
            helper.make_node("Mul", ["INPUT_STATE", "not_start"], ["kept"]),
            helper.make_node("Add", ["INPUT", "kept"], ["OUTPUT_STATE"]),
            helper.make_node("Cast", ["CORRID"], ["corrid"], to=INT32),
            helper.make_node("Mul", ["END", "corrid"], ["at_end"]),
            helper.make_node("Add", ["OUTPUT_STATE", "at_end"], ["sum"]),
            helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
        ],
        "simple_string_dyna_sequence",
        [
            helper.make_tensor_value_info(n, INT32, ROW)
            for n in ("INPUT", "START", "END", "READY", "INPUT_STATE")
        ]
        + [helper.make_tensor_value_info("CORRID", TensorProto.STRING, ROW)],
        [helper.make_tensor_value_info(n, INT32, ROW) for n in ("OUTPUT", "OUTPUT_STATE")],
        initializer=[one],
    )
    return make_model(graph, "Triton's simple_string_dyna_sequence: a running sum, + CORRID at END")


def accumulator() -> onnx.ModelProto:
    one = helper.make_tensor("one", INT32, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["not_start"]),
            helper.make_node("Mul", ["INPUT_STATE", "not_start"], ["kept"]),
            helper.make_node("Add", ["INPUT", "kept"], ["OUTPUT_STATE"]),
            helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"]),
        ],
        "accumulator",
        [helper.make_tensor_value_info(n, INT32, ROW) for n in ("INPUT", "START", "READY", "INPUT_STATE")],
        [helper.make_tensor_value_info(n, INT32, ROW) for n in ("OUTPUT", "OUTPUT_STATE")],
        initializer=[one],
    )
    return make_model(graph, "a sequence's running sum, kept as implicit state")


def counter() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "STATE_IN"], ["STATE_OUT"]),
            helper.make_node("Identity", ["STATE_OUT"], ["OUTPUT"]),
        ],
        "counter",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("INPUT", "STATE_IN")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("OUTPUT", "STATE_OUT")],
    )
    return make_model(graph, "a running sum from an initial state, no batch dimension, no controls")


def repeat_int32() -> onnx.ModelProto:
    u32 = TensorProto.UINT32
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["IN"], ["OUT"]),
            helper.make_node("Identity", ["REPEAT_INDEX"], ["IDX"]),
        ],
        "repeat_int32",
        [
            helper.make_tensor_value_info("IN", INT32, [1]),
            helper.make_tensor_value_info("DELAY", u32, [1]),
            helper.make_tensor_value_info("WAIT", u32, [1]),
            helper.make_tensor_value_info("REPEAT_INDEX", u32, [1]),
        ],
        [helper.make_tensor_value_info("OUT", INT32, [1]), helper.make_tensor_value_info("IDX", u32, [1])],
    )
    return make_model(graph, "Triton's repeat example: OUT = IN[i], IDX = i, one run per element")


def sequence_config(
    controls: list[dict[str, Any]],
    strategy: str = "direct",
    idle_us: int = 60_000_000,
    max_batch_size: int = 8,
    **more: Any,
) -> dict[str, Any]:
    return {
        "max_batch_size": max_batch_size,
        "sequence_batching": {
            "strategy": strategy,
            "max_sequence_idle_us": idle_us,
            "control_inputs": controls,
            **more,
        },
    }


REPEAT_CONFIG: dict[str, Any] = {
    "max_batch_size": 0,
    "inputs": [
        {"name": "IN", "datatype": "INT32", "shape": [-1]},
        {"name": "DELAY", "datatype": "UINT32", "shape": [-1]},
        {"name": "WAIT", "datatype": "UINT32", "shape": [1]},
    ],
    "outputs": [
        {"name": "OUT", "datatype": "INT32", "shape": [1]},
        {"name": "IDX", "datatype": "UINT32", "shape": [1]},
    ],
    "decoupled": {
        "repeat": {
            "inputs": ["IN", "DELAY"],
            "index_input": "REPEAT_INDEX",
            "delay_input": "DELAY",
            "hold_input": "WAIT",
        }
    },
}

ACCUMULATOR_STATE = {
    "input_name": "INPUT_STATE",
    "output_name": "OUTPUT_STATE",
    "datatype": "INT32",
    "shape": [-1, 1],
}


def write_triton_models(root: Path, idle_us: int = 60_000_000, instances: int = 1) -> Path:
    """simple_sequence, simple_dyna_sequence, accumulator and repeat_int32 in `root` (the models
    Triton's example clients expect, and ours)."""
    execution = {"execution": {"provider": "cpu", "instances": instances}}
    write_model(
        root,
        "simple_sequence",
        1,
        simple_sequence(),
        {**sequence_config(_int32_controls("START", "READY"), idle_us=idle_us), **execution},
    )
    dyna_controls = [
        *_int32_controls("START", "END", "READY"),
        {"name": "CORRID", "kind": "corrid", "datatype": "UINT64"},
    ]
    write_model(
        root,
        "simple_dyna_sequence",
        1,
        simple_dyna_sequence(),
        {
            **sequence_config(
                dyna_controls,
                strategy="oldest",
                idle_us=idle_us,
                max_candidate_sequences=64,
                max_queue_delay_us=0,
            ),
            **execution,
        },
    )
    write_model(
        root,
        "simple_string_dyna_sequence",
        1,
        simple_string_dyna_sequence(),
        {
            **sequence_config(
                [*dyna_controls[:3], {"name": "CORRID", "kind": "corrid", "datatype": "BYTES"}],
                strategy="oldest",
                idle_us=idle_us,
                states=[ACCUMULATOR_STATE],
            ),
            **execution,
        },
    )
    write_model(
        root,
        "accumulator",
        1,
        accumulator(),
        {
            **sequence_config(_int32_controls("START", "READY"), idle_us=idle_us, states=[ACCUMULATOR_STATE]),
            **execution,
        },
    )
    write_model(root, "repeat_int32", 1, repeat_int32(), {**REPEAT_CONFIG, "execution": {"provider": "cpu"}})
    return root
