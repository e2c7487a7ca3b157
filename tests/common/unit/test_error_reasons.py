"""The one table from domain errors to gRPC status codes and x-error-reason values."""

from __future__ import annotations

import asyncio
import inspect

import grpc

from modelyard.common import headers
from modelyard.common.reasons import SERVER_FAULTS, ErrorReason
from modelyard.service import errors
from modelyard.service.api import errors as api_errors
from modelyard.service.api.errors import DEADLINE_SLACK_S, deadline_passed, status_for
from modelyard.tensors import TensorError


def test_every_domain_error_has_its_own_row() -> None:
    # A new error class must be placed in the table, not fall through to `internal`.
    kinds = [k for _, k in inspect.getmembers(errors, inspect.isclass) if issubclass(k, errors.ServiceError)]
    assert len(kinds) > 10
    for kind in kinds:
        if kind is errors.ServiceError:
            continue
        code, reason = status_for(kind("x") if kind is not errors.ModelLoadError else kind("x", "load"))
        assert reason != ErrorReason.INTERNAL, kind
        assert code != grpc.StatusCode.OK


def test_the_rows_a_proxy_depends_on() -> None:
    assert status_for(errors.ModelNotFound("m")) == (grpc.StatusCode.NOT_FOUND, ErrorReason.MODEL_NOT_FOUND)
    assert status_for(errors.VersionNotFound("v")) == (
        grpc.StatusCode.NOT_FOUND,
        ErrorReason.VERSION_NOT_FOUND,
    )
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(errors.Overloaded("q")) == (exhausted, ErrorReason.QUEUE_FULL)
    assert status_for(errors.TooLarge("t")) == (exhausted, ErrorReason.TOO_LARGE)
    assert status_for(TensorError("t")) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT)
    assert status_for(errors.ModelRunError("r")) == (grpc.StatusCode.INTERNAL, ErrorReason.MODEL_FAILED)
    # Neither the client's plain mistake nor a server fault: another version may serve it.
    assert status_for(errors.ModelRejected("g")) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        ErrorReason.MODEL_REJECTED,
    )
    assert ErrorReason.MODEL_REJECTED not in SERVER_FAULTS
    assert status_for(asyncio.CancelledError()) == (grpc.StatusCode.CANCELLED, ErrorReason.CANCELLED)
    assert status_for(KeyError("bug")) == (grpc.StatusCode.INTERNAL, ErrorReason.INTERNAL)


class _Remaining:
    """A call context as far as deadline_passed reads one."""

    def __init__(self, remaining: float | None) -> None:
        self._remaining = remaining

    def time_remaining(self) -> float | None:
        return self._remaining


def test_a_cancel_a_hair_before_the_server_side_deadline_counts_as_the_deadline() -> None:
    # The client's deadline fires first (the server's runs from its receipt of the headers), so its
    # cancel reaches the handler with a few milliseconds still left on the server's clock.
    assert deadline_passed(_Remaining(0.01))  # type: ignore[arg-type]
    assert deadline_passed(_Remaining(-0.2))  # type: ignore[arg-type]
    assert not deadline_passed(_Remaining(DEADLINE_SLACK_S * 4))  # type: ignore[arg-type]
    assert not deadline_passed(_Remaining(None))  # type: ignore[arg-type]


def test_answer_metadata_names_the_worker_once_it_is_set() -> None:
    # The answer's metadata is built once per version: naming the worker later must not leave
    # the metadata built before it without x-served-by.
    saved = api_errors._served_by
    try:
        assert api_errors.answer_metadata("7") == ((headers.SERVED_VERSION, "7"),)
        api_errors.set_served_by("worker-3")
        assert api_errors.answer_metadata("7") == (
            (headers.SERVED_VERSION, "7"),
            (headers.SERVED_BY, "worker-3"),
        )
        assert api_errors.answer_metadata("7") is api_errors.answer_metadata("7")  # built once
    finally:
        api_errors._served_by = saved
        api_errors._answer_metadata.clear()
