"""The service's part of a trace: a server span per call (receive to answer), continuing the
caller's W3C `traceparent` (the sidecar's client span) and reading its `baggage` (model version
and dye), with child spans for its steps (`run`: the model's run; `batch`: waiting in a dynamic
batcher's queue and the batch's run; for Generate, `prefill`: waiting for a decode slot and the
prompt's pass, up to the first token, then `stream`: the rest of the tokens). The span carries
the version that served the call as soon as it is resolved (a failed run's span too), the
caller's tenant, and for Generate its time to first token and token counts. Its status is ERROR
only for a server fault (OpenTelemetry's rule for server spans; `modelyard.common.reasons`): a
client's mistake or a load refusal is not an error of the service.

On when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), off otherwise; off, a call pays a global read and a context
variable (the resolved version, for the metrics too). The OpenTelemetry SDK is imported only when
tracing is on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar, TypeVarTuple

import grpc

from modelyard.common import headers
from modelyard.common.names import NAME_MAX, echo
from modelyard.common.reasons import is_server_fault
from modelyard.process import logs
from modelyard.process.request_metadata import invocation_metadata
from modelyard.process.tracing import otlp_provider

log = logging.getLogger(__name__)
T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_tracer: Any = None
_propagator: Any = None
_provider: Any = None
# The call's server span, for the spans of its steps (same task: the handler's).
_current: ContextVar[Any] = ContextVar("modelyard_service_span", default=None)
# The same span for the call's log lines: kept after the span ends (the access line is written
# once the call has ended), replaced by the next call's (a KServe stream runs several in a task).
_logged: ContextVar[Any] = ContextVar("modelyard_service_logged_span", default=None)
_trace: Any = None  # opentelemetry.trace, once tracing is on
# The version that serves the current call, once resolved (DataPlane.open, the generation
# plane's lease): its metrics and span name it even when the call then fails.
_version: ContextVar[str] = ContextVar("modelyard_service_version", default="")
_OFF = contextlib.nullcontext()
# Whether calls may get spans (configure): read where a step is traced, so that with tracing off
# a request pays one attribute read (DataPlane._run_here). Only ever turned on: `traced` and
# `step` still look for the call's span.
enabled = False
# Codes that are a server fault when no x-error-reason says otherwise.
_FAULT_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS})


def configure(environ: Mapping[str, str] | None = None, provider: Any = None) -> bool:
    """Turn tracing on from the OTEL_* variables (or with `provider`, a TracerProvider: tests
    give one with an in-memory exporter); returns whether it is on."""
    global _tracer, _propagator, _provider, _trace, enabled
    if provider is None:
        provider = otlp_provider("modelyard-service", environ)
    if provider is None:
        return False
    from opentelemetry import trace
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider = provider
    _tracer = _provider.get_tracer("modelyard.service")
    _trace = trace
    enabled = True
    _propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    logs.join_traces(log_ids)
    return True


def log_ids() -> tuple[str, str] | None:
    """The trace and span ids for a log line (modelyard.process.logs): the current step's span
    (a model run's, where it is current), else the call's server span; None outside a call."""
    ids = _trace.get_current_span().get_span_context() if _trace is not None else None
    if ids is None or not ids.is_valid:
        span = _logged.get()
        if span is None:
            return None
        ids = span.get_span_context()
    return format(ids.trace_id, "032x"), format(ids.span_id, "016x")


def shutdown() -> None:
    """Send what is buffered (blocking: call it from a thread when the receiver may be local)."""
    if _provider is not None:
        _provider.shutdown()


def start(context: grpc.aio.ServicerContext[Any, Any], method: str, model: str) -> Any:
    """The call's server span, or None when tracing is off."""
    _version.set("")  # a new call (a KServe stream runs several in one task)
    if _tracer is None:
        return None
    from opentelemetry import baggage
    from opentelemetry.trace import SpanKind

    carrier = {k: v for k, v in invocation_metadata(context) if isinstance(v, str)}
    parent = _propagator.extract(carrier)
    # A name that breaks the rule is refused later in the call; the span quotes it capped.
    shown = model if len(model) <= NAME_MAX else echo(model)
    attributes = {"rpc.system": "grpc", "rpc.method": method, "modelyard.model": shown}
    tenant = carrier.get(headers.TENANT_ID)
    if tenant:
        attributes["modelyard.tenant"] = tenant if len(tenant) <= NAME_MAX else echo(tenant)
    for key in ("model.version", "model.dye"):
        value = baggage.get_baggage(key, parent)
        if value is not None:
            attributes[f"modelyard.baggage.{key}"] = str(value)
    span = _tracer.start_span(
        f"modelyard.service/{method}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    )
    _current.set(span)
    _logged.set(span)
    return span


def resolved(version: str) -> None:
    """The version that serves the current call is known: on its span now, and the version its
    metrics and span end with, whether it then answers or fails (`resolved_version`)."""
    _version.set(version)
    if enabled:  # else no call has a span: no look for one
        span = _current.get()
        if span is not None:
            span.set_attribute("modelyard.version", version)


def resolved_version() -> str:
    return _version.get()


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


def traced(name: str, run: Callable[[*Ts], T], *args: *Ts) -> T:
    """`run(*args)` as the step `name`: inside its child span when the call has one, else called
    as it is (no context manager entered and left on every request when tracing is off)."""
    if _current.get() is None:
        return run(*args)
    with step(name):
        return run(*args)


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

    def note(self, attributes: Mapping[str, str | int | float]) -> None:
        """Attributes of the call's span (Generate: time to first token, token counts)."""
        if self._parent is not None:
            self._parent.set_attributes(attributes)

    def end(self) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None


_NO_STEPS = Steps(None, "")


def steps(first: str) -> Steps:
    """Child spans of the call's span for the phases of a stream, starting with `first`."""
    parent = _current.get()
    return _NO_STEPS if parent is None else Steps(parent, first)


def is_fault(code: grpc.StatusCode, reason: str) -> bool:
    """Whether an answer is the server's fault: its x-error-reason decides; without one, UNKNOWN,
    INTERNAL and DATA_LOSS are."""
    if code == grpc.StatusCode.OK:
        return False
    return is_server_fault(reason) if reason else code in _FAULT_CODES


def end(span: Any, version: str, code: grpc.StatusCode, reason: str = "") -> None:
    if span is None:
        return
    _current.set(None)
    from opentelemetry.trace import Status, StatusCode

    if version:
        span.set_attribute("modelyard.version", version)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if reason:
        span.set_attribute("modelyard.error_reason", reason)
    if is_fault(code, reason):
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()
