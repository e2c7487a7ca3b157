"""The service's part of a trace: a server span per call (receive to answer), continuing the
caller's W3C `traceparent` (the sidecar's client span) and reading its `baggage` (model version
and dye), with child spans for its steps (`run`: the model's run; `batch`: waiting in a dynamic
batcher's queue and the batch's run; for Generate, `prefill`: waiting for a decode slot and the
prompt's pass, up to the first token, then `stream`: the rest of the tokens).

On when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), off otherwise; off, a call pays one global read. The
OpenTelemetry SDK is imported only when tracing is on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import grpc

from modelyard.common.names import NAME_MAX, echo
from modelyard.process.tracing import otlp_provider

log = logging.getLogger(__name__)

_tracer: Any = None
_propagator: Any = None
_provider: Any = None
# The call's server span, for the spans of its steps (same task: the handler's).
_current: ContextVar[Any] = ContextVar("modelyard_service_span", default=None)
_OFF = contextlib.nullcontext()


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on from the OTEL_* variables; returns whether it is on."""
    global _tracer, _propagator, _provider
    provider = otlp_provider("modelyard-service", environ)
    if provider is None:
        return False
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider = provider
    _tracer = _provider.get_tracer("modelyard.service")
    _propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIds())
    return True


class TraceIds(logging.Filter):
    """Puts the current call's trace and span ids on log records (JSON logs show them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = _current.get()
        if span is not None:
            ids = span.get_span_context()
            record.trace_id = format(ids.trace_id, "032x")
            record.span_id = format(ids.span_id, "016x")
        return True


def shutdown() -> None:
    """Send what is buffered (blocking: call it from a thread when the receiver may be local)."""
    if _provider is not None:
        _provider.shutdown()


def start(context: grpc.aio.ServicerContext[Any, Any], method: str, model: str) -> Any:
    """The call's server span, or None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import baggage
    from opentelemetry.trace import SpanKind

    carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
    parent = _propagator.extract(carrier)
    # A name that breaks the rule is refused later in the call; the span quotes it capped.
    shown = model if len(model) <= NAME_MAX else echo(model)
    attributes = {"rpc.system": "grpc", "rpc.method": method, "modelyard.model": shown}
    for key in ("model.version", "model.dye"):
        value = baggage.get_baggage(key, parent)
        if value is not None:
            attributes[f"modelyard.baggage.{key}"] = str(value)
    span = _tracer.start_span(
        f"modelyard.service/{method}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    )
    _current.set(span)
    return span


def step(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the call's span around one step (a model run; a batch's queue and run)."""
    parent = _current.get()
    if parent is None:
        return _OFF
    from opentelemetry import trace

    span: contextlib.AbstractContextManager[Any] = _tracer.start_as_current_span(
        name, context=trace.set_span_in_context(parent)
    )
    return span


class Steps:
    """Consecutive child spans across a stream's yields (no context is attached, so they may span
    an async generator's suspensions): `next` ends one step and begins the following one."""

    __slots__ = ("_parent", "_span")

    def __init__(self, parent: Any, first: str) -> None:
        self._parent = parent
        self._span: Any = None
        if parent is not None:
            self.next(first)

    def next(self, name: str) -> None:
        if self._parent is None:
            return
        from opentelemetry import trace

        self.end()
        self._span = _tracer.start_span(name, context=trace.set_span_in_context(self._parent))

    def end(self) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None


_NO_STEPS = Steps(None, "")


def steps(first: str) -> Steps:
    """Child spans of the call's span for the phases of a stream, starting with `first`."""
    parent = _current.get()
    return _NO_STEPS if parent is None else Steps(parent, first)


def end(span: Any, version: str, code: grpc.StatusCode) -> None:
    if span is None:
        return
    _current.set(None)
    from opentelemetry.trace import Status, StatusCode

    if version:
        span.set_attribute("modelyard.version", version)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()
