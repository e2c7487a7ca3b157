"""OpenTelemetry tracing: a server span per call, a client span per upstream attempt, W3C
`traceparent` and `baggage` passed on to the service. On when an OTLP endpoint is configured
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; protocol from
`OTEL_EXPORTER_OTLP_PROTOCOL`: grpc, the default, or http/protobuf); off, it costs a few
attribute reads per call. Health checks are not traced (the proxy never sees them).

The SDK is imported only when tracing is on, so the hot path of a sidecar without it stays lean.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from modelyard.common import headers
from modelyard.common.names import NAME_MAX, echo
from modelyard.common.reasons import is_server_fault
from modelyard.process.tracing import otlp_provider

if TYPE_CHECKING:
    from modelyard.sidecar.plan import Metadata, Plan

log = logging.getLogger(__name__)

ROUTE_BAGGAGE_KEPT = 256  # encoded baggage headers kept, per (version, dye)
# Request headers that carry a trace context or baggage in (W3C).
_CONTEXT_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})


class Attempt:
    """One upstream attempt: the metadata to send (with the trace context when tracing). Untraced,
    it is its own `with` block (no generator per call)."""

    __slots__ = ("metadata", "span")

    def __init__(self, metadata: Metadata, span: Any = None) -> None:
        self.metadata = metadata
        self.span = span

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def failed(self, code: grpc.StatusCode) -> None:
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            self.span.set_status(Status(StatusCode.ERROR, code.name))


_TRACEPARENT = "traceparent"


@functools.cache
def _unsampled_type() -> Any:
    """The class of Unsampled spans (made once the SDK is in: an untraced sidecar imports none)."""
    from opentelemetry.trace import NonRecordingSpan

    class Unsampled(NonRecordingSpan):
        """The server span of a call the sampler left out and that brought no trace context or
        baggage (nor a tracestate from the sampler): it records nothing, and its traceparent is
        the one trace header its attempts carry for it."""

        def traceparent(self) -> str:
            # The W3C trace-context propagator's format.
            c = self.get_span_context()
            return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"

    return Unsampled


class Tracing:
    def __init__(self, provider: Any = None) -> None:
        self._provider = provider
        self.enabled = provider is not None
        if provider is not None:
            # Imported once here, not per call (the SDK stays out of an untraced sidecar).
            from opentelemetry import baggage, context, trace
            from opentelemetry.baggage.propagation import W3CBaggagePropagator
            from opentelemetry.propagators.composite import CompositePropagator
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._tracer = provider.get_tracer("modelyard.sidecar")
            self._trace_context = TraceContextTextMapPropagator()
            self._baggage_propagator = W3CBaggagePropagator()
            self._propagator = CompositePropagator([self._trace_context, self._baggage_propagator])
            self._baggage, self._context, self._trace = baggage, context, trace
            self._route_baggage: dict[tuple[str, str], dict[str, str]] = {}
            self._unsampled = _unsampled_type()

    def server_span(self, path: str, md: Metadata) -> Any:
        if not self.enabled:
            return None
        from opentelemetry.trace import SpanKind

        carrier = {k: v for k, v in md if isinstance(v, str)}
        parent = self._propagator.extract(carrier)
        context, trace = self._context, self._trace

        service, _, method = path[1:].rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        tenant = carrier.get(headers.TENANT_ID)
        if tenant:  # as sent (capped): a trace is one call's, not a series
            attributes["modelyard.tenant"] = tenant if len(tenant) <= NAME_MAX else echo(tenant)
        span = self._tracer.start_span(path[1:], context=parent, kind=SpanKind.SERVER, attributes=attributes)
        if not span.is_recording() and _CONTEXT_HEADERS.isdisjoint(carrier):
            # Most calls: the sampler left it out and it came with no context of its own. Its
            # attempts' trace headers are then its traceparent and the route's baggage only,
            # written without the propagators (about 3 us a call less).
            found = span.get_span_context()
            if not found.trace_state:
                span = self._unsampled(found)
        # Current for the rest of this call's task, so that its log lines carry the ids.
        context.attach(trace.set_span_in_context(span, parent))
        return span

    def attempt(self, parent: Any, plan: Plan[Any], path: str) -> AbstractContextManager[Attempt]:
        if parent is None:
            return Attempt(plan.forward)
        if type(parent) is self._unsampled:
            # As the propagators write them (and `forward` holds neither: the call brought none).
            sent: Metadata = ((_TRACEPARENT, parent.traceparent()),)
            if plan.version:
                sent = (*sent, *self._baggage_of(plan.version, plan.dye).items())
            return Attempt(plan.forward + sent)
        if not parent.is_recording():
            # A call the sampler left out: a client span would record nothing either; the trace
            # context (not sampled) and the baggage still go on, so the service's view is the same.
            return Attempt(self._outgoing(plan, self._trace.set_span_in_context(parent)))
        return self._traced_attempt(parent, plan, path)

    @contextmanager
    def _traced_attempt(self, parent: Any, plan: Plan[Any], path: str) -> Iterator[Attempt]:
        from opentelemetry.trace import SpanKind

        trace = self._trace
        context = trace.set_span_in_context(parent)
        attributes: dict[str, Any] = {"net.peer.name": plan.upstream.address, **_route_attributes(plan)}
        if plan.breaker is not None:
            attributes["modelyard.breaker.state"] = plan.breaker.state.value
        span = self._tracer.start_span(path[1:], context=context, kind=SpanKind.CLIENT, attributes=attributes)
        metadata = self._outgoing(plan, trace.set_span_in_context(span, context))
        try:
            yield Attempt(metadata, span)
        finally:
            span.end()

    def _outgoing(self, plan: Plan[Any], context: Any) -> Metadata:
        """The attempt's request metadata: the forwarded headers, and `context`'s traceparent
        (and tracestate) and baggage, with the attempt's `model.version` and `model.dye` added."""
        carrier: dict[str, str] = {}
        baggage = self._baggage
        if plan.version and not baggage.get_all(context):
            # No baggage came with the call: the header is the route's own, encoded once.
            self._trace_context.inject(carrier, context)
            carrier.update(self._baggage_of(plan.version, plan.dye))
        else:
            if plan.version:
                context = baggage.set_baggage("model.version", plan.version, context)
                context = baggage.set_baggage("model.dye", plan.dye, context)
            self._propagator.inject(carrier, context)
        return tuple((k, v) for k, v in plan.forward if k not in carrier) + tuple(carrier.items())

    def _baggage_of(self, version: str, dye: str) -> dict[str, str]:
        """The `baggage` header of only model.version and model.dye, as the propagator writes it."""
        found = self._route_baggage.get((version, dye))
        if found is None:
            baggage = self._baggage
            context = baggage.set_baggage("model.version", version, self._context.Context())
            found = {}
            self._baggage_propagator.inject(found, baggage.set_baggage("model.dye", dye, context))
            if len(self._route_baggage) < ROUTE_BAGGAGE_KEPT:  # a pinned version may be anything
                self._route_baggage[(version, dye)] = found
        return found

    def refused(self, span: Any, reason: str) -> None:
        if span is not None:
            span.set_attribute("modelyard.error_reason", reason)

    def end(self, span: Any, plan: Plan[Any] | None, code: grpc.StatusCode, reason: str = "") -> None:
        """The call's server span ends: ERROR only for a server fault (OpenTelemetry's rule for
        server spans), never for a client's mistake or a load refusal."""
        if span is None or not span.is_recording():
            return  # an unsampled span keeps nothing: its attributes, status and end are no-ops
        from opentelemetry.trace import Status, StatusCode

        if plan is not None:
            span.set_attributes(_route_attributes(plan))
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if reason:
            span.set_attribute("modelyard.error_reason", reason)
        if is_fault(code, reason):
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()

    @contextmanager
    def shadow(self, model: str, stable: str, canary: str, method: str) -> Iterator[Any]:
        """A span over one shadow comparison, in the trace of the call that was mirrored (the
        mirror's task runs in that call's context): the versions compared as attributes, the
        result as an event (`compared`). None when tracing is off."""
        if not self.enabled:
            yield None
            return
        from opentelemetry.trace import SpanKind

        attributes = {
            "modelyard.model": model,
            "modelyard.shadow.stable_version": stable,
            "modelyard.shadow.canary_version": canary,
            "rpc.method": method.rpartition("/")[2],
        }
        span = self._tracer.start_span(
            "modelyard.sidecar/shadow", kind=SpanKind.INTERNAL, attributes=attributes
        )
        try:
            yield span
        finally:
            span.end()

    async def close(self) -> None:
        if self._provider is not None:
            # Off the loop: the exporter's thread may be sending to a receiver on this very loop.
            await asyncio.to_thread(self._provider.shutdown)

    async def flush(self) -> None:
        if self._provider is not None:
            await asyncio.to_thread(self._provider.force_flush)


class TraceIds(logging.Filter):
    """Puts the current span's trace and span ids on log records (JSON logs show them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


# Codes that are a server fault when no x-error-reason says otherwise.
_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNAVAILABLE,
    }
)


def is_fault(code: grpc.StatusCode, reason: str) -> bool:
    """Whether the sidecar's answer is a server fault (the upstream's or its own): its
    x-error-reason decides (modelyard.common.reasons); without one, UNKNOWN, INTERNAL, DATA_LOSS
    and UNAVAILABLE (no upstream reached) are."""
    if code == grpc.StatusCode.OK:
        return False
    return is_server_fault(reason) if reason else code in _FAULT_CODES


def _route_attributes(plan: Plan[Any]) -> dict[str, str]:
    attributes = {"modelyard.model": plan.model}
    if plan.version:
        attributes["modelyard.version"] = plan.version
    if plan.dye:
        attributes["modelyard.dye"] = plan.dye
    if plan.fallback:
        attributes["modelyard.fallback"] = plan.fallback
    return attributes


def configure(service_name: str, environ: Mapping[str, str] | None = None) -> Tracing:
    """Tracing from the standard OTEL_* variables; off when no OTLP endpoint is set."""
    provider = otlp_provider(service_name, environ)
    if provider is None:
        return Tracing()
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIds())
    return Tracing(provider)
