"""The tensors a sequence batcher feeds beside a step's own inputs: the control inputs (START, END,
READY, CORRID), each state's first value, and a batch row that holds no step.

As Triton's: a control tensor holds one value per batch row, shape [rows, 1] for a model with a
batch dimension and [1] without one; the flags are the control's false/true values in its
datatype; CORRID is the sequence's id (BYTES for a string id, as ONNX Runtime takes strings).
A state with no initial_state starts as zeros, each variable dimension 1 (Triton leaves it
uninitialised; zeros make the first step deterministic)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from modelyard.service.errors import InvalidInput
from modelyard.service.repository.model_config import ControlInput, StateConfig
from modelyard.tensors import NUMPY_BY_NAME


def control_tensor(control: ControlInput, values: Sequence[bool | int | str], batched: bool) -> np.ndarray:
    """The control's tensor for a batch whose rows carry `values` (flags for start, end and ready;
    ids for corrid, 0 for a row without a step)."""
    shape = (len(values), 1) if batched else (1,)
    if control.kind == "corrid":
        if control.datatype == "BYTES":
            # ONNX Runtime takes strings as str objects (runtime/strings.py).
            # A row without a step carries id 0, as Triton's null requests do ("0" as a string).
            return np.array([str(v) for v in values], dtype=object).reshape(shape)
        dtype = NUMPY_BY_NAME[control.datatype]
        return np.array(values, dtype=dtype).reshape(shape)
    false, true = control.false_true
    dtype = NUMPY_BY_NAME[control.datatype]
    return np.array([true if v else false for v in values], dtype=dtype).reshape(shape)


def check_corrid(control: ControlInput, sequence_id: int | str, model: str) -> None:
    """A sequence id the model's CORRID control can carry: an integer id fits the control's integer
    type (a string id only a BYTES control)."""
    if control.datatype == "BYTES":
        return
    if isinstance(sequence_id, str):
        raise InvalidInput(
            f"model '{model}' takes the sequence id as {control.datatype} (its CORRID control "
            f"{control.name!r}): a string sequence_id cannot be given to it"
        )
    dtype = NUMPY_BY_NAME[control.datatype]
    bits = dtype.itemsize * 8
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if dtype.kind == "i" else (0, (1 << bits) - 1)
    if not low <= sequence_id <= high:
        raise InvalidInput(
            f"model '{model}' takes the sequence id as {control.datatype} (its CORRID control "
            f"{control.name!r}): sequence_id {sequence_id} does not fit it"
        )


def initial_state(state: StateConfig, batched: bool) -> np.ndarray:
    """A state's value before a sequence's first step (one batch row where the model batches)."""
    dtype = NUMPY_BY_NAME[state.datatype]
    if state.initial_shape is None:
        shape = tuple(1 if d == -1 else d for d in state.shape)
        if batched:
            shape = (1, *shape[1:])
        return _zeros(shape, state.datatype)
    if state.initial_data is None:  # zero_data (or a file not read: parse_config alone)
        return _zeros(state.initial_shape, state.datatype)
    return (
        np.frombuffer(state.initial_data, dtype=dtype.newbyteorder("<"))
        .astype(dtype)
        .reshape(state.initial_shape)
    )


def null_row(like: np.ndarray) -> np.ndarray:
    """A batch row with no step (READY false): zeros shaped as `like`'s rows."""
    if like.dtype == object:
        return np.full((1, *like.shape[1:]), b"", dtype=object)
    return np.zeros((1, *like.shape[1:]), dtype=like.dtype)


def _zeros(shape: tuple[int, ...], datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.full(shape, "", dtype=object)
    return np.zeros(shape, dtype=NUMPY_BY_NAME[datatype])
