"""An ensemble's config as it is read: the steps are a DAG over the ensemble's tensors, in an
order that runs each step after those that feed it; everything else is refused by name."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from modelyard.service.repository.model_config import ConfigError, parse_config
from tests.triton_models import ENSEMBLE_CONFIG


def config(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(ENSEMBLE_CONFIG)
    doc.update(changes)
    return doc


def steps(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"step": list(entries)}


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
    return {"model_name": model, "input_map": inputs, "output_map": outputs}


def test_steps_are_ordered_by_what_feeds_them() -> None:
    doc = config(
        ensemble_scheduling=steps(
            step("last", {"A": "b"}, {"Y": "OUTPUT"}), step("first", {"X": "INPUT"}, {"Z": "b"})
        )
    )
    parsed = parse_config(doc)
    assert parsed.platform == "ensemble" and parsed.ensemble is not None
    assert [s.model for s in parsed.ensemble.steps] == ["first", "last"]
    assert parsed.ensemble.steps[0].version == -1 and parsed.ensemble.steps[0].pinned == ""


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"ensemble_scheduling": None}, "platform: ensemble needs ensemble_scheduling"),
        ({"platform": "onnxruntime_onnx"}, "ensemble_scheduling: needs platform: ensemble"),
        ({"inputs": []}, "an ensemble declares its inputs and outputs"),
        ({"dynamic_batching": {}}, "dynamic_batching: not for an ensemble"),
        (
            {
                "ensemble_scheduling": steps(
                    step("a", {"X": "INPUT"}, {"Y": "t"}), step("b", {"X": "t"}, {"Y": "t"})
                )
            },
            "'t' is made by step 0 already",
        ),
        (
            {
                "ensemble_scheduling": steps(
                    step("a", {"X": "nowhere"}, {"Y": "OUTPUT"}), step("b", {"X": "INPUT"}, {"Y": "u"})
                )
            },
            "'nowhere' is neither an ensemble input nor made by a step",
        ),
        (
            {
                "ensemble_scheduling": steps(
                    step("a", {"X": "INPUT", "W": "v"}, {"Y": "u"}),
                    step("b", {"X": "u"}, {"Y": "v", "Z": "OUTPUT"}),
                )
            },
            "wait for each other's outputs (a cycle)",
        ),
        (
            {"ensemble_scheduling": steps(step("a", {"X": "INPUT"}, {"Y": "INPUT"}))},
            "'INPUT' is an ensemble input",
        ),
        (
            {"ensemble_scheduling": steps(step("a", {"X": "INPUT"}, {"Y": "other"}))},
            "'OUTPUT' is made by no step",
        ),
        ({"ensemble_scheduling": steps(step("../a", {"X": "INPUT"}, {"Y": "OUTPUT"}))}, "step[0].model_name"),
        ({"ensemble_scheduling": {"step": []}}, "ensemble_scheduling.step"),
    ],
)
def test_what_is_refused_is_named(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(**changes))
    assert words in str(caught.value)


def test_an_unused_input_is_refused() -> None:
    doc = config(inputs=[*ENSEMBLE_CONFIG["inputs"], {"name": "EXTRA", "datatype": "FP32", "shape": [-1, 1]}])
    with pytest.raises(ConfigError, match="'EXTRA' feeds no step"):
        parse_config(doc)
