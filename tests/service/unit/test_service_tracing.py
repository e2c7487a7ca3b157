"""The service's tracing: off without an endpoint (calls pay nothing), log records carry the
current call's ids."""

from __future__ import annotations

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


def test_log_lines_carry_the_calls_ids_after_its_span_ended() -> None:
    span = TracerProvider().get_tracer("t").start_span("call")
    assert tracing.log_ids() is None
    token = tracing._logged.set(span)
    try:
        span.end()  # the access line is written once the call ended
        found = tracing.log_ids()
    finally:
        tracing._logged.reset(token)
    ids = span.get_span_context()
    assert found == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
