"""Triton's sequence request parameters (sequence_id, sequence_start, sequence_end) as a Step.

tritonclient sends the id as int64_param (or string_param for a string id) and the flags as
bool_param; Triton's HTTP clients send JSON numbers or strings, which the gateway passes on the
same way (uint64_param for an id above the int64 range)."""

from __future__ import annotations

from collections.abc import Mapping

from modelyard.kserve.v2.grpc_service_pb2 import InferParameter
from modelyard.service.api.kserve.tensors import parameter_value
from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput
from modelyard.service.sequences.step import MAX_ID, MAX_ID_CHARS, Step

SEQUENCE_ID = "sequence_id"
SEQUENCE_START = "sequence_start"
SEQUENCE_END = "sequence_end"


def sequence_step(parameters: Mapping[str, InferParameter]) -> Step | None:
    """The request's step, or None when it names no sequence (no sequence_id, or 0 / "", which
    Triton reserves for requests outside any sequence)."""
    if SEQUENCE_ID not in parameters:
        return None
    value = parameter_value(parameters[SEQUENCE_ID])
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidInput(
            f"request parameter 'sequence_id' must be an integer or a string, got {quoted(value)}"
        )
    if isinstance(value, int):
        if value < 0 or value > MAX_ID:
            raise InvalidInput(f"request parameter 'sequence_id' must be in 0..{MAX_ID}, got {value}")
        if value == 0:
            return None
    else:
        if not value:
            return None
        if len(value) > MAX_ID_CHARS:
            raise InvalidInput(
                f"request parameter 'sequence_id' is a string of {len(value)} characters; at most "
                f"{MAX_ID_CHARS}"
            )
    return Step(value, _flag(parameters, SEQUENCE_START), _flag(parameters, SEQUENCE_END))


def _flag(parameters: Mapping[str, InferParameter], name: str) -> bool:
    if name not in parameters:
        return False
    value = parameter_value(parameters[name])
    if not isinstance(value, bool):
        raise InvalidInput(f"request parameter {quoted(name)} must be a bool, got {quoted(value)}")
    return value
