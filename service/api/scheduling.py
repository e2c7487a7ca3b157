"""A call's priority, queue timeout and deadline, read from either API into one Scheduling."""

from __future__ import annotations

from collections.abc import Mapping

from modelyard.kserve.v2.grpc_service_pb2 import InferParameter
from modelyard.service.api.errors import Context
from modelyard.service.api.kserve.tensors import parameter_value
from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling

# Triton's request parameters (tritonclient sends priority as uint64, timeout as int64, in us).
PRIORITY = "priority"
TIMEOUT = "timeout"
_scheduling = tuple.__new__


def scheduling(context: Context, priority: int = 0, timeout_us: int = 0, shadow: bool = False) -> Scheduling:
    """Our API: the request's fields, the call's gRPC deadline, and whether it is a shadow."""
    return _of(priority, timeout_us, context.time_remaining(), shadow)


def _of(priority: int, timeout_us: int, time_remaining_s: float | None, shadow: bool = False) -> Scheduling:
    # A request that asks nothing (no priority, timeout or deadline) shares the default: a frozen
    # dataclass costs a few microseconds to make, on every request.
    if not priority and not timeout_us and time_remaining_s is None and not shadow:
        return DEFAULT_SCHEDULING
    # Made as the tuple it is: a NamedTuple's own __new__ is Python.
    return _scheduling(Scheduling, (priority, timeout_us, time_remaining_s, shadow))


def kserve_priority(parameters: Mapping[str, InferParameter]) -> int:
    """KServe V2: Triton's `priority` request parameter; 0 when absent."""
    return _count(parameters, PRIORITY, "a priority level") if parameters else 0


def kserve_scheduling(
    context: Context, parameters: Mapping[str, InferParameter], priority: int, shadow: bool = False
) -> Scheduling:
    """KServe V2: the priority (kserve_priority, or the x-priority header), Triton's `timeout`
    request parameter (microseconds), and whether it is a shadow."""
    if not parameters:  # most requests
        return _of(priority, 0, context.time_remaining(), shadow)
    return scheduling(context, priority, _count(parameters, TIMEOUT, "microseconds"), shadow)


def _count(parameters: Mapping[str, InferParameter], name: str, unit: str) -> int:
    if name not in parameters:
        return 0
    value = parameter_value(parameters[name])
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(
            f"request parameter {quoted(name)} must be a non-negative integer ({unit}), got {quoted(value)}"
        )
    return value
