"""config.yaml's sequence_batching and decoupled sections, Triton's JSON for them (both ways), the
graph checks at load, and the control and state tensors the sequence batcher feeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.demo_models import serialize
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.api.kserve.triton_config import parse_triton_config
from modelyard.service.api.kserve.triton_sequences import sequence_message
from modelyard.service.errors import InvalidInput, ModelLoadError
from modelyard.service.repository.model_config import ConfigError, load_config, parse_config
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.session import load_runner
from modelyard.service.sequences.tensors import check_corrid, control_tensor, initial_state
from tests.sequence_models import ACCUMULATOR_STATE, REPEAT_CONFIG, _int32_controls, accumulator, repeat_int32

START = {"name": "START", "kind": "start", "datatype": "INT32", "false_true": [0, 1]}
CPU = ProviderChoice(False, "test: CPU")


def config(**sequence: Any) -> dict[str, Any]:
    return {"max_batch_size": 8, "sequence_batching": {"control_inputs": [START], **sequence}}


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({**config(), "dynamic_batching": {}}, "one scheduler"),
        ({**config(), "decoupled": {}}, "decoupled sequence model"),
        (
            config(control_inputs=[{**START, "datatype": "INT64"}]),
            "control_inputs[0] (START).datatype: a start control is one of",
        ),
        (config(control_inputs=[{"name": "START", "kind": "start", "datatype": "INT32"}]), "false_true"),
        (config(control_inputs=[START, {**START, "name": "S2"}]), "one control of each kind"),
        (
            config(control_inputs=[{"name": "C", "kind": "corrid", "datatype": "FP32"}]),
            "a corrid control is one of",
        ),
        (config(states=[{**ACCUMULATOR_STATE, "shape": [1]}]), "starts with the batch dimension"),
        (
            config(states=[{**ACCUMULATOR_STATE, "initial_state": {"shape": [1, 1]}}]),
            "give zero_data: true or a data_file",
        ),
        (
            config(states=[{**ACCUMULATOR_STATE, "initial_state": {"shape": [2, 1], "zero_data": True}}]),
            "does not fit the state's shape",
        ),
        (config(states=[{**ACCUMULATOR_STATE, "input_name": "START"}]), "distinct names"),
        ({**config(), "inputs": [{"name": "START", "datatype": "INT32", "shape": [-1, 1]}]}, "leave it out"),
        (config(preferred_batch_sizes=[16]), "above max_batch_size"),
        ({**REPEAT_CONFIG, "max_batch_size": 4}, "needs max_batch_size 0"),
        (
            {**REPEAT_CONFIG, "decoupled": {"repeat": {"inputs": ["IN"], "delay_input": "DELAY"}}},
            "is not one of inputs",
        ),
        ({"decoupled": {"repeat": {"inputs": ["IN"], "index_input": "IN"}}}, "is one of inputs"),
    ],
)
def test_config_mistakes_are_refused_by_key(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(doc)
    assert says in str(caught.value)


def test_internal_inputs_and_hidden_outputs() -> None:
    parsed = parse_config(config(states=[ACCUMULATOR_STATE]))
    assert parsed.internal_inputs == ("START", "INPUT_STATE")
    assert parsed.hidden_outputs == ("OUTPUT_STATE",)
    # A state output the config lists is one clients may ask for (as Triton's).
    listed = parse_config(
        {
            **config(states=[ACCUMULATOR_STATE]),
            "outputs": [
                {"name": "OUTPUT", "datatype": "INT32", "shape": [-1, 1]},
                {"name": "OUTPUT_STATE", "datatype": "INT32", "shape": [-1, 1]},
            ],
        }
    )
    assert listed.hidden_outputs == ()
    assert parse_config(REPEAT_CONFIG).internal_inputs == ("REPEAT_INDEX",)


def test_an_initial_state_file_is_read_with_the_config(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "initial_state").mkdir(parents=True)
    state = {**ACCUMULATOR_STATE, "initial_state": {"shape": [1, 1], "data_file": "start"}}
    (model / "config.yaml").write_text(json.dumps(config(states=[state])))
    (model / "initial_state" / "start").write_bytes(np.array([[42]], "<i4").tobytes())
    (loaded,) = load_config(model, tmp_path).sequence_batching.states
    assert initial_state(loaded, batched=True).tolist() == [[42]]
    (model / "initial_state" / "start").write_bytes(b"\0" * 3)
    with pytest.raises(ConfigError, match=r"holds 3 bytes; .* takes 4"):
        load_config(model, tmp_path)
    outside = {**ACCUMULATOR_STATE, "initial_state": {"shape": [1, 1], "data_file": "../config.yaml"}}
    with pytest.raises(ConfigError, match="data_file"):
        parse_config(config(states=[outside]))


def test_graphs_are_checked_against_the_config_at_load(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(serialize(accumulator()))
    good = parse_config(config(control_inputs=_int32_controls("START", "READY"), states=[ACCUMULATOR_STATE]))
    runner = load_runner(path, good, CPU)
    assert [s.name for s in runner.signature.inputs] == ["INPUT"]
    assert [s.name for s in runner.signature.outputs] == ["OUTPUT"]
    assert [s.name for s in runner.internal_inputs] == ["START", "READY", "INPUT_STATE"]
    missing = parse_config(
        config(control_inputs=[*_int32_controls("START", "READY"), {**START, "name": "END", "kind": "end"}])
    )
    with pytest.raises(ModelLoadError, match="'END' is not an input of the graph"):
        load_runner(path, missing, CPU)
    wrong = parse_config(config(control_inputs=[{**START, "datatype": "FP32"}, *_int32_controls("READY")]))
    with pytest.raises(ModelLoadError, match="start control 'START' is INT32"):
        load_runner(path, wrong, CPU)
    repeat = tmp_path / "repeat.onnx"
    repeat.write_bytes(serialize(repeat_int32()))
    runner = load_runner(repeat, parse_config(REPEAT_CONFIG), CPU)
    assert {s.name: s.shape for s in runner.signature.inputs} == {"IN": (-1,), "DELAY": (-1,), "WAIT": (1,)}


TRITON_DYNA = {
    "name": "dyna",
    "platform": "onnxruntime_onnx",
    "max_batch_size": 8,
    "sequence_batching": {
        "max_sequence_idle_microseconds": 5000000,
        "oldest": {
            "max_candidate_sequences": 4,
            "preferred_batch_size": [2],
            "max_queue_delay_microseconds": 100,
        },
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "fp32_false_true": [0, 1]}]},
            {
                "name": "READY",
                "control": [{"kind": "CONTROL_SEQUENCE_READY", "bool_false_true": [False, True]}],
            },
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_STRING"}]},
        ],
        "state": [
            {
                "input_name": "S_IN",
                "output_name": "S_OUT",
                "data_type": "TYPE_INT32",
                "dims": [-1],
                "initial_state": [
                    {"data_type": "TYPE_INT32", "dims": [3], "zero_data": True, "name": "zeros"}
                ],
            }
        ],
    },
    "model_transaction_policy": {"decoupled": False},
}


def test_triton_json_maps_onto_config_and_back() -> None:
    parsed = parse_triton_config(json.dumps(TRITON_DYNA), "dyna")
    batching = parsed.sequence_batching
    assert batching is not None and parsed.decoupled is None
    assert (batching.strategy, batching.max_candidate_sequences, batching.preferred_batch_sizes) == (
        "oldest",
        4,
        (2,),
    )
    assert [(c.name, c.kind, c.datatype, c.false_true) for c in batching.controls] == [
        ("START", "start", "FP32", (0.0, 1.0)),
        ("READY", "ready", "BOOL", (0.0, 1.0)),
        ("CORRID", "corrid", "BYTES", (0.0, 1.0)),
    ]
    (state,) = batching.states
    assert (state.shape, state.initial_shape) == ((-1, -1), (1, 3))
    back = sequence_message(batching, 8)
    assert back.oldest.max_candidate_sequences == 4
    assert back.state[0].dims == [-1] and back.state[0].initial_state[0].dims == [3]
    assert back.control_input[2].control[0].data_type == config_pb.TYPE_STRING
    assert list(back.control_input[1].control[0].bool_false_true) == [False, True]
    assert parse_triton_config(json.dumps({"model_transaction_policy": {"decoupled": True}}), "r").decoupled


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"direct": {"minimum_slot_utilization": 0.5}}, "minimum_slot_utilization"),
        ({"iterative_sequence": True}, "iterative_sequence"),
        (
            {
                "control_input": [
                    {
                        "name": "S",
                        "control": [{"kind": "CONTROL_SEQUENCE_START"}, {"kind": "CONTROL_SEQUENCE_END"}],
                    }
                ]
            },
            "one control per input",
        ),
        (
            {
                "state": [
                    {
                        "input_name": "a",
                        "output_name": "b",
                        "data_type": "TYPE_INT32",
                        "dims": [1],
                        "initial_state": [{"data_type": "TYPE_INT32", "dims": [1], "data_file": "f"}],
                    }
                ]
            },
            "needs the model's folder",
        ),
        (
            {
                "state": [
                    {
                        "input_name": "a",
                        "output_name": "b",
                        "data_type": "TYPE_INT32",
                        "use_growable_memory": True,
                    }
                ]
            },
            "use_growable_memory",
        ),
    ],
)
def test_triton_json_without_a_counterpart_is_refused(change: dict[str, Any], says: str) -> None:
    doc = {"max_batch_size": 8, "sequence_batching": change}
    with pytest.raises(InvalidInput, match=says):
        parse_triton_config(json.dumps(doc), "m")


def test_control_tensors_as_triton_feeds_them() -> None:
    start = parse_config(config()).sequence_batching.controls[0]
    assert control_tensor(start, [True, False], batched=True).tolist() == [[1], [0]]
    assert control_tensor(start, [True], batched=False).shape == (1,)
    (flag,) = parse_config(
        config(control_inputs=[{"name": "R", "kind": "ready", "datatype": "FP32", "false_true": [-1, 2.5]}])
    ).sequence_batching.controls
    assert control_tensor(flag, [False, True], batched=True).tolist() == [[-1.0], [2.5]]
    corrid = parse_config(
        config(control_inputs=[{"name": "C", "kind": "corrid", "datatype": "UINT32"}])
    ).sequence_batching.controls[0]
    assert control_tensor(corrid, [7, 0], batched=True).dtype == np.uint32
    with pytest.raises(InvalidInput, match="does not fit"):
        check_corrid(corrid, 2**40, "m")
    with pytest.raises(InvalidInput, match="a string sequence_id"):
        check_corrid(corrid, "abc", "m")
