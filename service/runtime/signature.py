"""A model version's input/output schema, and the checks every request's tensors pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from service.datatypes import name_of
from service.errors import InvalidInput


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe name, e.g. "FP32"
    shape: tuple[int, ...]  # -1 = any size

    def describe(self) -> str:
        return f"{self.datatype}{list(self.shape)}"


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int  # 0 = no batch dimension declared

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def check_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Raise InvalidInput naming the first tensor that does not fit the schema."""
        expected = {t.name: t for t in self.inputs}
        unknown = sorted(set(feeds) - set(expected))
        if unknown:
            raise InvalidInput(f"unknown input {unknown[0]!r}; the model's inputs are {sorted(expected)}")
        missing = sorted(set(expected) - set(feeds))
        if missing:
            raise InvalidInput(f"missing input {missing[0]!r}; the model's inputs are {sorted(expected)}")
        batch_sizes = set()
        for spec in self.inputs:
            array = feeds[spec.name]
            got = name_of(array.dtype)
            if got != spec.datatype:
                raise InvalidInput(f"input {spec.name!r}: expected datatype {spec.datatype}, got {got}")
            if len(array.shape) != len(spec.shape) or any(
                want not in (-1, have) for want, have in zip(spec.shape, array.shape, strict=True)
            ):
                raise InvalidInput(
                    f"input {spec.name!r}: expected shape {list(spec.shape)}, got {list(array.shape)}"
                )
            if self.max_batch_size:
                batch = array.shape[0]
                if batch > self.max_batch_size:
                    raise InvalidInput(
                        f"input {spec.name!r}: batch size {batch} exceeds max_batch_size "
                        f"{self.max_batch_size}"
                    )
                batch_sizes.add(batch)
        if len(batch_sizes) > 1:
            raise InvalidInput(f"inputs disagree on the batch size: {sorted(batch_sizes)}")

    def select_outputs(self, names: Sequence[str]) -> tuple[str, ...]:
        """The outputs to compute: the requested names in order, or all of them when none are named."""
        if not names:
            return self.output_names
        known = set(self.output_names)
        for name in names:
            if name not in known:
                raise InvalidInput(f"unknown output {name!r}; the model's outputs are {sorted(known)}")
        if len(set(names)) != len(names):
            raise InvalidInput("an output is requested twice")
        return tuple(names)
