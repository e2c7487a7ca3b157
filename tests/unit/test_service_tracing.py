"""The service's tracing: off without an endpoint (calls pay nothing), log records carry the
current call's ids."""

from __future__ import annotations

import logging

import grpc
from opentelemetry.sdk.trace import TracerProvider

from modelyard.service import tracing


def test_off_without_an_endpoint_and_the_hooks_do_nothing() -> None:
    assert not tracing.configure({})
    assert tracing.start(None, "Infer", "m") is None
    with tracing.step("run"):
        pass
    tracing.steps("prefill").next("stream")
    tracing.end(None, "1", grpc.StatusCode.OK)


def test_log_records_carry_the_calls_ids() -> None:
    span = TracerProvider().get_tracer("t").start_span("call")
    record = logging.LogRecord("n", logging.INFO, __file__, 1, "m", None, None)
    token = tracing._current.set(span)
    try:
        tracing.TraceIds().filter(record)
    finally:
        tracing._current.reset(token)
    assert getattr(record, "trace_id", None) == format(span.get_span_context().trace_id, "032x")
    assert getattr(record, "span_id", None) == format(span.get_span_context().span_id, "016x")
