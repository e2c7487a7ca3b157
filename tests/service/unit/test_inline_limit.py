"""Which runs go inline on the event loop: per machine (the cores a process may use, shared by
the worker processes) and per model (its warm-up run time)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from onnx import TensorProto, helper

from models import demo_models
from modelyard.service.repository.model_config import load_config
from modelyard.service.runtime.providers import detect_providers
from modelyard.service.runtime.session import (
    INLINE_RUN_LIMIT_S,
    ONE_CORE_INLINE_RUN_LIMIT_S,
    WARMUP_RUNS,
    WARMUP_SETTLE_RUNS,
    ModelRunner,
    _warm_up,
    inline_run_limit_s,
    load_runner,
)


@pytest.mark.parametrize(
    ("cores", "processes", "limit"),
    [
        ({0}, 1, ONE_CORE_INLINE_RUN_LIMIT_S),  # pinned to one core: the executor adds only the hop
        ({0, 1}, 1, INLINE_RUN_LIMIT_S),  # a second core: slower runs go to the executor, in parallel
        ({0, 1}, 2, ONE_CORE_INLINE_RUN_LIMIT_S),  # as many workers as cores
        (set(range(8)), 2, INLINE_RUN_LIMIT_S),
    ],
)
def test_the_limit_follows_the_cores_each_process_has(
    monkeypatch: pytest.MonkeyPatch, cores: set[int], processes: int, limit: float
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert inline_run_limit_s(processes) == limit


def test_a_model_runs_inline_when_its_warm_up_run_is_under_the_limit(tmp_path: Path) -> None:
    # A batch dimension bounded by max_batch_size: timed at max_batch_size rows too.
    config_doc = {"max_batch_size": 8}
    model_file = demo_models.write_model(tmp_path, "tiny", 1, demo_models.scaled_identity(4, 2.0), config_doc)
    config = load_config(model_file.parent.parent)
    generous = load_runner(model_file, config, detect_providers(), inline_limit_s=1.0)
    assert generous.runs_inline
    assert generous.warmup_run_s < 1.0 and 0 < generous.peak_run_s < 1.0
    none = load_runner(model_file, config, detect_providers(), inline_limit_s=0.0)
    assert not none.runs_inline


def test_a_dimension_no_limit_bounds_keeps_a_model_off_the_loop(tmp_path: Path) -> None:
    # No max_batch_size: its first dimension takes any size a request brings (issue 17).
    model_file = demo_models.write_model(tmp_path, "tiny", 1, demo_models.scaled_identity(4, 2.0), {})
    runner = load_runner(
        model_file, load_config(model_file.parent.parent), detect_providers(), inline_limit_s=1.0
    )
    assert not runner.runs_inline
    assert "dynamic dimension" in runner.value_driven


def test_shapes_computed_from_fixed_shapes_keep_a_model_inline(tmp_path: Path) -> None:
    # As exporters write a flatten: Shape -> Gather -> Unsqueeze -> Concat -> Reshape. The shape
    # comes from the input's (fixed) shape, not from its values.
    nodes = [
        helper.make_node("Shape", ["X"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["X", "target"], ["Y"]),
    ]
    constants = [
        helper.make_tensor("zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
        helper.make_tensor("minus1", TensorProto.INT64, [1], [-1]),
    ]
    graph = helper.make_graph(
        nodes,
        "flatten",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 6])],
        constants,
    )
    model = demo_models.make_model(graph)
    model_file = demo_models.write_model(tmp_path, "flat", 1, model, {"max_batch_size": 8})
    config = load_config(model_file.parent.parent)
    runner = load_runner(model_file, config, detect_providers(), inline_limit_s=1.0)
    assert runner.value_driven == ""
    assert runner.runs_inline


class _Cooling:
    """A stand-in runner whose runs take the given times, in turn (the last one from then on),
    on a clock that only its runs advance."""

    def __init__(self, times: list[float]) -> None:
        self.times = times
        self.now = 0.0
        self.runs = 0
        self.signature = SimpleNamespace(output_names=("Y",))

    def clock(self) -> float:
        return self.now

    def run(self, feeds: object, output_names: object) -> None:
        self.now += self.times[min(self.runs, len(self.times) - 1)]
        self.runs += 1


def _warm(times: list[float], limit_s: float) -> tuple[float, int]:
    runner = _Cooling(times)
    fastest = _warm_up(cast(ModelRunner, runner), {}, Path("m.onnx"), limit_s, runner.clock)
    return fastest, runner.runs


def test_a_model_near_the_limit_warms_until_a_run_is_under_it() -> None:
    # Cold first runs (a fresh session's page faults, cold caches) over the limit, warm ones under.
    fastest, runs = _warm([1.4e-3, 0.9e-3, 0.8e-3, 0.7e-3, 0.6e-3, 0.55e-3, 0.52e-3, 0.3e-3], 500e-6)
    assert fastest == pytest.approx(0.3e-3) and runs == 8  # no run after the first under the limit


def test_warm_up_runs_stay_few_where_the_limit_is_far() -> None:
    assert _warm([0.1e-3], 500e-6)[1] == WARMUP_RUNS  # under it from the first run
    assert _warm([5e-3], 500e-6)[1] == WARMUP_RUNS  # 10x over: no warm run will be under it
    assert _warm([1e-3], 0.0)[1] == WARMUP_RUNS  # no limit (a layer above runs the graph)
    fastest, runs = _warm([1e-3], 500e-6)  # near, and never under: bounded
    assert fastest == pytest.approx(1e-3) and runs == WARMUP_RUNS + WARMUP_SETTLE_RUNS
