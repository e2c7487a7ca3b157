"""A model version's input/output schema, and the checks every request's tensors pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from modelyard.common.names import echo
from modelyard.service.errors import InvalidInput
from modelyard.service.runtime.strings import check_strings
from modelyard.tensors import NUMPY_BY_NAME, name_of


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

    @cached_property
    def output_names(self) -> tuple[str, ...]:  # cached: every request that names no output reads it
        return tuple(t.name for t in self.outputs)

    @cached_property
    def string_inputs(self) -> frozenset[str]:
        return frozenset(t.name for t in self.inputs if t.datatype == "BYTES")

    @cached_property
    def has_bf16(self) -> bool:
        return any(t.datatype == "BF16" for t in self.inputs + self.outputs)

    @cached_property
    def string_outputs(self) -> bool:
        return any(t.datatype == "BYTES" for t in self.outputs)

    @cached_property
    def _input_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.inputs)

    @cached_property
    def _input_checks(
        self,
    ) -> tuple[tuple[TensorSpec, np.dtype[np.generic], tuple[tuple[int, int], ...]], ...]:
        """Per input: its spec, numpy dtype and fixed (index, size) dimensions, computed once: the
        checks run on every request."""
        return tuple(
            (spec, NUMPY_BY_NAME[spec.datatype], tuple((i, d) for i, d in enumerate(spec.shape) if d != -1))
            for spec in self.inputs
        )

    def check_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Raise InvalidInput naming the first tensor that does not fit the schema."""
        if feeds.keys() != self._input_names:
            expected = sorted(self._input_names)
            unknown = sorted(set(feeds) - self._input_names)
            if unknown:
                raise InvalidInput(f"unknown input {echo(unknown[0])}; the model's inputs are {expected}")
            missing = sorted(self._input_names - set(feeds))
            raise InvalidInput(f"missing input {missing[0]!r}; the model's inputs are {expected}")
        batch = -1
        for spec, dtype, fixed in self._input_checks:
            array = feeds[spec.name]
            if array.dtype != dtype:
                raise InvalidInput(
                    f"input {spec.name!r}: expected datatype {spec.datatype}, got {name_of(array.dtype)}"
                )
            shape = array.shape
            if len(shape) != len(spec.shape) or any(shape[i] != size for i, size in fixed):
                raise InvalidInput(
                    f"input {spec.name!r}: expected shape {list(spec.shape)}, got {list(shape)}"
                )
            if self.max_batch_size:
                if shape[0] > self.max_batch_size:
                    raise InvalidInput(
                        f"input {spec.name!r}: batch size {shape[0]} exceeds max_batch_size "
                        f"{self.max_batch_size}"
                    )
                if batch not in (-1, shape[0]):
                    raise InvalidInput(f"inputs disagree on the batch size: {sorted({batch, shape[0]})}")
                batch = shape[0]
            if spec.datatype == "BYTES":
                check_strings(spec.name, array)

    def select_outputs(self, names: Sequence[str]) -> tuple[str, ...]:
        """The outputs to compute: the requested names in order, or all of them when none are named."""
        if not names:
            return self.output_names
        known = set(self.output_names)
        for name in names:
            if name not in known:
                raise InvalidInput(f"unknown output {echo(name)}; the model's outputs are {sorted(known)}")
        if len(set(names)) != len(names):
            raise InvalidInput("an output is requested twice")
        return tuple(names)
