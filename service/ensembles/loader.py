"""An ensemble version as it loads (the runtime's loader calls this for `platform: ensemble`).

Its signature is its config's inputs and outputs (it has no graph). Its steps are checked against
the models that serve them now: each step maps every input of its model and only outputs its model
has, and the datatypes agree along every tensor (ensemble input -> step -> step -> ensemble
output); a mismatch fails the load. A step whose model does not serve yet is not checked: the
version loads, its status says so, and requests answer UNAVAILABLE naming the step until that
model serves (then each request checks its tensors as it runs). A step may not run the ensemble
itself; nested ensembles (a step that is an ensemble) run as any model.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, cast

from modelyard.service.dataplane import DataPlane
from modelyard.service.ensembles.steps import EnsembleSteps, Plan
from modelyard.service.errors import ModelLoadError, ServiceError
from modelyard.service.repository.labels import load_labels
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.runtime.session import ModelRunner
from modelyard.service.runtime.signature import Signature, TensorSpec

PLATFORM = "ensemble"


class EnsembleLoader:
    def __init__(self, dataplane: DataPlane) -> None:
        self._dataplane = dataplane

    async def load(
        self, name: str, number: int, model_file: Path, config: ModelConfig, print_: tuple[object, ...]
    ) -> ServedVersion:
        ensemble = config.ensemble
        if ensemble is None:
            raise ModelLoadError(f"model {name}: platform ensemble without ensemble_scheduling", "config")
        if name in ensemble.models:
            raise ModelLoadError(f"model {name}: a step of the ensemble runs the ensemble itself", "config")
        signature = Signature(
            tuple(TensorSpec(t.name, t.datatype, t.shape) for t in config.inputs),
            tuple(TensorSpec(t.name, t.datatype, t.shape) for t in config.outputs),
            config.max_batch_size,
        )
        waiting = self._check_steps(name, config, signature)
        labels = await asyncio.get_running_loop().run_in_executor(
            None, load_labels, model_file.parent.parent, config
        )
        runner = ModelRunner(
            cast(Any, None),  # no session: nothing reads one of a version that is not a decoder
            signature,
            PLATFORM,
            warmup_run_s=math.inf,
            value_driven="an ensemble: its steps run as requests of their own",
            load_note="; ".join(waiting),
        )
        served = ServedVersion(name, number, [runner], config, print_)
        served.instances = EnsembleSteps(
            runner, Plan(f"ensemble {name} version {number}", ensemble.steps, self._dataplane)
        )
        served.labels = labels
        return served

    def _check_steps(self, name: str, config: ModelConfig, signature: Signature) -> list[str]:
        """Check the steps whose models serve now (ModelLoadError on a mismatch); the notes of
        those whose models do not."""
        assert config.ensemble is not None
        types = {spec.name: spec.datatype for spec in signature.inputs}  # ensemble tensor -> datatype
        waiting = []
        for index, step in enumerate(config.ensemble.steps):
            where = f"model {name}: ensemble_scheduling step {index} (model {step.model!r})"
            try:
                served = self._dataplane.manager.resolve(step.model, step.pinned)
            except ServiceError as exc:
                waiting.append(f"step {index}: {exc}; its requests answer UNAVAILABLE until it serves")
                continue
            step_signature = served.runner.signature
            inputs = {spec.name: spec.datatype for spec in step_signature.inputs}
            outputs = {spec.name: spec.datatype for spec in step_signature.outputs}
            mapped = {model_input for model_input, _ in step.inputs}
            if mapped != set(inputs):
                raise ModelLoadError(
                    f"{where}: input_map names {sorted(mapped)}, the model's inputs are {sorted(inputs)}",
                    "schema",
                )
            for model_input, tensor in step.inputs:
                if tensor in types and types[tensor] != inputs[model_input]:
                    raise ModelLoadError(
                        f"{where}: input {model_input!r} is {inputs[model_input]}, the tensor {tensor!r} fed "
                        f"to it is {types[tensor]}",
                        "schema",
                    )
            for model_output, tensor in step.outputs:
                if model_output not in outputs:
                    raise ModelLoadError(
                        f"{where}: output_map names {model_output!r}, the model's outputs are "
                        f"{sorted(outputs)}",
                        "schema",
                    )
                types[tensor] = outputs[model_output]
        for spec in signature.outputs:
            if spec.name in types and types[spec.name] != spec.datatype:
                raise ModelLoadError(
                    f"model {name}: output {spec.name!r} is {spec.datatype}, its step makes "
                    f"{types[spec.name]}",
                    "schema",
                )
        return waiting
