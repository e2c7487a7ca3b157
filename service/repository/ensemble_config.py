"""`platform: ensemble` and `ensemble_scheduling` in config.yaml (its keys: model_config_schema's
EnsembleSchedulingDoc): Triton's ensembles, a DAG of steps that feed tensors from model to model
(service/ensembles/ runs them).

    platform: ensemble
    max_batch_size: 8
    inputs:  [{name: IMAGE, datatype: BYTES, shape: [-1, 1]}]
    outputs: [{name: CLASSES, datatype: FP32, shape: [-1, 1000]}]
    ensemble_scheduling:
      step:
        - {model_name: preprocess, model_version: -1, input_map: {RAW: IMAGE}, output_map: {OUT: pixels}}
        - {model_name: classifier, input_map: {INPUT: pixels}, output_map: {OUTPUT: CLASSES}}

The version folders of an ensemble are empty (as Triton's): they name its versions. Checked here,
as the config is read: every step input is fed by an ensemble input or by exactly one step's
output, every ensemble output is made by a step, every ensemble input feeds a step, and the steps
make no cycle. What the step models take and give is checked as the ensemble loads and as it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelyard.common.names import is_valid_name, name_problem
from modelyard.process.documents import DocumentError
from modelyard.service.repository.model_config_schema import EnsembleSchedulingDoc


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    version: int  # -1: the newest served when a request starts
    inputs: tuple[tuple[str, str], ...]  # (the model's input, the ensemble tensor fed to it)
    outputs: tuple[tuple[str, str], ...]  # (the model's output, the ensemble tensor it makes)

    @property
    def pinned(self) -> str:
        """The version as a request names it ("" for the newest served)."""
        return "" if self.version < 0 else str(self.version)


@dataclass(frozen=True)
class EnsembleConfig:
    steps: tuple[EnsembleStep, ...]  # in an order that runs each step after those that feed it

    @property
    def models(self) -> frozenset[str]:
        return frozenset(step.model for step in self.steps)


def parse_ensemble(
    doc: EnsembleSchedulingDoc, inputs: Sequence[str], outputs: Sequence[str]
) -> EnsembleConfig:
    """The steps, checked as a DAG over the ensemble's `inputs` and `outputs` (tensor names)."""
    steps = []
    made: dict[str, int] = {}  # ensemble tensor -> the step that makes it
    for i, step in enumerate(doc.step):
        where = f"ensemble_scheduling.step[{i}]"
        if not is_valid_name(step.model_name):
            raise DocumentError(f"{where}.model_name", f"{step.model_name!r} {name_problem(step.model_name)}")
        if not step.input_map or not step.output_map:
            raise DocumentError(where, "give input_map and output_map (the step's tensors)")
        for model_output, tensor in step.output_map.items():
            if tensor in inputs:
                raise DocumentError(f"{where}.output_map.{model_output}", f"{tensor!r} is an ensemble input")
            if tensor in made:
                raise DocumentError(
                    f"{where}.output_map.{model_output}", f"{tensor!r} is made by step {made[tensor]} already"
                )
            made[tensor] = i
        steps.append(
            EnsembleStep(
                step.model_name,
                step.model_version,
                tuple(step.input_map.items()),
                tuple(step.output_map.items()),
            )
        )
    for i, parsed in enumerate(steps):
        for model_input, tensor in parsed.inputs:
            if tensor not in made and tensor not in inputs:
                raise DocumentError(
                    f"ensemble_scheduling.step[{i}].input_map.{model_input}",
                    f"{tensor!r} is neither an ensemble input nor made by a step",
                )
    for name in outputs:
        if name not in made:
            raise DocumentError("outputs", f"{name!r} is made by no step (output_map)")
    fed = {tensor for step in steps for _, tensor in step.inputs}
    for name in inputs:
        if name not in fed:
            raise DocumentError("inputs", f"{name!r} feeds no step (input_map)")
    return EnsembleConfig(_ordered(steps, made, set(inputs)))


def _ordered(steps: list[EnsembleStep], made: dict[str, int], given: set[str]) -> tuple[EnsembleStep, ...]:
    """The steps so that each comes after the steps that make its inputs; a cycle is refused."""
    ready, order, left = set(given), [], list(range(len(steps)))
    while left:
        runnable = [i for i in left if all(tensor in ready for _, tensor in steps[i].inputs)]
        if not runnable:
            raise DocumentError(
                "ensemble_scheduling.step",
                f"steps {left} wait for each other's outputs (a cycle): an ensemble is a DAG",
            )
        for i in runnable:
            order.append(steps[i])
            ready.update(tensor for _, tensor in steps[i].outputs)
        left = [i for i in left if i not in runnable]
    return tuple(order)
