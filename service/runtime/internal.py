"""Graph inputs and outputs the service fills or keeps itself, apart from the signature clients see:
a stateful model's control inputs and implicit state (config `sequence_batching`), a repeat
model's index input (`decoupled.repeat`). Each is checked against the graph as the version loads,
so a version whose graph does not take what its config says fails to load, naming the tensor.

A repeat model's split inputs take one element a run (the graph's first dimension, 1 or any);
clients send a vector of them, so the signature gives them any size there (-1).
"""

from __future__ import annotations

from pathlib import Path

from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.signature import TensorSpec


def split_signature(
    inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], config: ModelConfig, model_file: Path
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's (inputs, outputs) as clients see them, and the internal inputs the service
    feeds (in the graph's order). Unchanged for a model with neither section."""
    internal_names = config.internal_inputs
    if not internal_names and config.decoupled is None and config.sequence_batching is None:
        return inputs, outputs, ()
    by_name = {spec.name: spec for spec in inputs}
    for name in internal_names:
        if name not in by_name:
            raise ModelLoadError(
                f"{model_file}: the config's control/state/index input {name!r} is not an input of the graph "
                f"(its inputs: {sorted(by_name)})",
                "schema",
            )
    _check_sequence_inputs(by_name, config, model_file)
    hidden = set(config.hidden_outputs)
    graph_outputs = {spec.name for spec in outputs}
    for name in config.sequence_batching.state_outputs if config.sequence_batching else ():
        if name not in graph_outputs:
            raise ModelLoadError(
                f"{model_file}: the config's state output {name!r} is not an output of the graph "
                f"(its outputs: {sorted(graph_outputs)})",
                "schema",
            )
    repeat = config.decoupled.repeat if config.decoupled is not None else None
    split = set(repeat.inputs) if repeat is not None else set()
    client: list[TensorSpec] = []
    internal: list[TensorSpec] = []
    for spec in inputs:
        if spec.name in internal_names:
            internal.append(spec)
        elif spec.name in split:
            if not spec.shape or spec.shape[0] not in (-1, 1):
                raise ModelLoadError(
                    f"{model_file}: decoupled.repeat input {spec.name!r} is {spec.describe()} in the graph; "
                    "each run takes one element of it: its first dimension must be 1 (or any)",
                    "schema",
                )
            client.append(TensorSpec(spec.name, spec.datatype, (-1, *spec.shape[1:])))
        else:
            client.append(spec)
    if repeat is not None:
        _check_repeat(
            by_name, repeat.inputs, repeat.index_input, repeat.delay_input, repeat.hold_input, model_file
        )
    return tuple(client), tuple(spec for spec in outputs if spec.name not in hidden), tuple(internal)


def _check_sequence_inputs(by_name: dict[str, TensorSpec], config: ModelConfig, model_file: Path) -> None:
    batching = config.sequence_batching
    if batching is None:
        return
    # As Triton's: a control tensor holds one value per batch row ([batch, 1]; [1] without a
    # batch dimension).
    control_shape = (-1, 1) if config.max_batch_size else (1,)
    for control in batching.controls:
        spec = by_name[control.name]
        fits = len(spec.shape) == len(control_shape) and all(
            have in (-1, want) for have, want in zip(spec.shape, control_shape, strict=True)
        )
        if spec.datatype != control.datatype or not fits:
            raise ModelLoadError(
                f"{model_file}: the {control.kind} control {control.name!r} is {spec.describe()} in the "
                f"graph; the config says {control.datatype}{list(control_shape)}",
                "schema",
            )
    for state in batching.states:
        spec = by_name[state.input_name]
        fits = len(spec.shape) == len(state.shape) and all(
            have in (-1, want) for have, want in zip(spec.shape, state.shape, strict=True)
        )
        if spec.datatype != state.datatype or not fits:
            raise ModelLoadError(
                f"{model_file}: the state input {state.input_name!r} is {spec.describe()} in the graph; the "
                f"config says {state.datatype}{list(state.shape)}",
                "schema",
            )


def _check_repeat(
    by_name: dict[str, TensorSpec],
    inputs: tuple[str, ...],
    index: str,
    delay: str,
    hold: str,
    model_file: Path,
) -> None:
    for name in (*inputs, hold):
        if name and name not in by_name:
            raise ModelLoadError(
                f"{model_file}: decoupled.repeat names input {name!r}, which the graph does not have "
                f"(its inputs: {sorted(by_name)})",
                "schema",
            )
    for name, role in ((index, "index_input"), (delay, "delay_input"), (hold, "hold_input")):
        if name and by_name[name].datatype != "UINT32":
            raise ModelLoadError(
                f"{model_file}: decoupled.repeat.{role} {name!r} is {by_name[name].describe()}; it must "
                "be UINT32",
                "schema",
            )
    if index and by_name[index].shape not in ((1,), (-1,)):
        raise ModelLoadError(
            f"{model_file}: decoupled.repeat.index_input {index!r} is {by_name[index].describe()}; it takes "
            "the run's index as UINT32[1]",
            "schema",
        )
