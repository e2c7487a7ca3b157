"""Tracing off without an endpoint; log records carry the current span's ids when it is on."""

from __future__ import annotations

import logging

from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider

from modelyard.sidecar.tracing import TraceIds, configure


def test_off_without_an_otlp_endpoint() -> None:
    assert not configure("x", {}).enabled
    assert not configure(
        "x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_SDK_DISABLED": "true"}
    ).enabled


def test_log_records_carry_the_current_trace_and_span_ids() -> None:
    span = TracerProvider().get_tracer("t").start_span("s")
    record = logging.LogRecord("n", logging.INFO, __file__, 1, "m", None, None)
    assert TraceIds().filter(record) and not hasattr(record, "trace_id")
    token = context.attach(trace.set_span_in_context(span))
    try:
        TraceIds().filter(record)
    finally:
        context.detach(token)
    ids = span.get_span_context()
    assert getattr(record, "trace_id", None) == format(ids.trace_id, "032x")
    assert getattr(record, "span_id", None) == format(ids.span_id, "016x")
