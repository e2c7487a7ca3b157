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
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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
    """One upstream attempt: the metadata to send (with the trace context when tracing) and its
    client span, if sampled. `end` it once the attempt is over (the proxy does so in `finally`:
    no `with` block, nor a generator, per call); a `with` block does the same."""

    __slots__ = ("metadata", "span")

    def __init__(self, metadata: Metadata, span: Any = None) -> None:
        self.metadata = metadata
        self.span = span

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end()

    def end(self) -> None:
        if self.span is not None:
            self.span.end()

    def failed(self, code: grpc.StatusCode) -> None:
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            self.span.set_status(Status(StatusCode.ERROR, code.name))


_TRACEPARENT = "traceparent"


@functools.cache
def _unsampled_type() -> Any:
    """The class of Unsampled spans (made once the SDK is in: an untraced sidecar imports none)."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    class Unsampled(NonRecordingSpan):
        """The server span of a call the sampler left out and that brought no trace context or
        baggage (nor a tracestate from the sampler): it records nothing, and its traceparent is
        the one trace header its attempts carry for it. Its SpanContext is made only when asked
        for (a log line, a shadow span): most such calls never need one."""

        __slots__ = ("_flags", "_made", "_span_id", "_trace_id", "_traceparent")

        def __init__(self, trace_id: int, span_id: int, flags: int) -> None:
            super().__init__(None)  # type: ignore[arg-type]  # made on demand (get_span_context)
            self._trace_id, self._span_id, self._flags = trace_id, span_id, flags
            self._traceparent = ""
            self._made: Any = None

        def get_span_context(self) -> Any:
            made = self._made
            if made is None:
                flags = TraceFlags(self._flags)
                made = self._made = self._context = SpanContext(
                    self._trace_id, self._span_id, is_remote=False, trace_flags=flags
                )
            return made

        def traceparent(self) -> str:
            # The W3C trace-context propagator's format, written once per call.
            if not self._traceparent:
                ids = (self._trace_id, self._span_id, self._flags)
                self._traceparent = "00-%032x-%016x-%02x" % ids  # noqa: UP031 (the fastest here)
            return self._traceparent

    return Unsampled


@functools.cache
def _preset_sampler_type() -> Any:
    from opentelemetry.sdk.trace.sampling import Sampler

    class PresetSampler(Sampler):
        """The tracer's sampler, that gives the decision the sidecar already asked it for about a
        trace id (`preset`) once, instead of asking again: a sampler is asked once per call."""

        def __init__(self, sampler: Sampler) -> None:
            self.sampler = sampler
            self.preset: tuple[int, Any] | None = None

        def should_sample(self, parent_context: Any, trace_id: int, *args: Any, **kwargs: Any) -> Any:
            preset, self.preset = self.preset, None
            if preset is not None and preset[0] == trace_id:
                return preset[1]
            return self.sampler.should_sample(parent_context, trace_id, *args, **kwargs)

        def get_description(self) -> str:
            return str(self.sampler.get_description())

    return PresetSampler


@functools.cache
def _preset_ids_type() -> Any:
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class PresetIds(IdGenerator):
        """The tracer's id generator, that hands out a trace id chosen before the span is started
        (`preset`) once: a root call that the sidecar's own sampling check found sampled gets the
        span of the very trace id that was sampled."""

        def __init__(self, ids: IdGenerator) -> None:
            self.ids = ids
            self.preset = 0

        def generate_span_id(self) -> int:
            return self.ids.generate_span_id()

        def generate_trace_id(self) -> int:
            preset, self.preset = self.preset, 0
            return preset or self.ids.generate_trace_id()

        def is_trace_id_random(self) -> bool:
            return bool(self.ids.is_trace_id_random())

    return PresetIds


class _Roots:
    """The sampling of root calls (no trace context came in), decided without an SDK span: the
    tracer's own steps for a root (a trace id from its id generator, its sampler asked with an
    empty parent context, the random-trace-id flag), minus the span objects of a call left out.
    A ParentBased(TraceIdRatioBased) sampler, the usual one, is read directly (its root's rule on
    the trace id's low 64 bits). A root the sampler takes is left to the tracer, with its trace id
    preset, so the span is of the very trace id the decision was made on. (The SDK's own span
    metrics, kept only with an OTel meter provider, which the sidecar does not set, do not count
    a root left out.)"""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry.context import Context
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, TraceFlags

        self.empty = Context()
        self.server_kind = SpanKind.SERVER
        self._tracer = tracer
        self._ids = tracer.id_generator = _preset_ids_type()(tracer.id_generator)
        self._random = type(self._ids.ids) is RandomIdGenerator  # random.getrandbits, called directly
        self._flags = TraceFlags.RANDOM_TRACE_ID if self._ids.is_trace_id_random() else TraceFlags.DEFAULT
        sampler = tracer.sampler
        self._sampler = tracer.sampler = _preset_sampler_type()(sampler)
        if isinstance(sampler, ParentBased) and type(sampler).should_sample is ParentBased.should_sample:
            sampler = sampler._root  # what decides for a root
        ratio = isinstance(sampler, TraceIdRatioBased)
        # The bound of a TraceIdRatioBased root rule (sampling.py), else None: the sampler is asked.
        self._bound: int | None = (
            sampler.bound
            if ratio and type(sampler).should_sample is TraceIdRatioBased.should_sample
            else None
        )
        self._limit = TraceIdRatioBased.TRACE_ID_LIMIT

    def unsampled(self, name: str, attributes: Callable[[], dict[str, Any]], make: Any) -> Any:
        """The span of a root call the sampler leaves out (`make`: the Unsampled class), or None
        when it takes it (the tracer's start_span then makes its span, of the same trace id).
        `attributes`: the span's, made only when the sampler is asked for its decision."""
        tracer = self._tracer
        if not tracer._is_enabled():
            return None  # the tracer's own answer (a non-recording span without context)
        if self._random:
            trace_id = random.getrandbits(128) or self._ids.ids.generate_trace_id()  # RandomIdGenerator's
        else:
            trace_id = self._ids.ids.generate_trace_id()
        bound = self._bound
        if bound is not None:
            if trace_id & self._limit >= bound:
                return make(trace_id, self._span_id(), self._flags)
        else:
            found = tracer.sampler.should_sample(
                self.empty, trace_id, name, self.server_kind, attributes(), ()
            )
            if (
                not found.decision.is_recording()
                and not found.decision.is_sampled()
                and not found.trace_state
            ):
                return make(trace_id, self._span_id(), self._flags)
            self._sampler.preset = (trace_id, found)  # the tracer's start_span is told, not asks
        self._ids.preset = trace_id
        return None

    def _span_id(self) -> int:
        if self._random:
            return random.getrandbits(64) or int(self._ids.ids.generate_span_id())
        return int(self._ids.ids.generate_span_id())


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
            self._roots = _Roots(self._tracer)
            self._server_kind = self._roots.server_kind

    def server_span(self, path: str, md: Metadata) -> Any:
        if not self.enabled:
            return None
        carrier = {k: v for k, v in md if isinstance(v, str)}
        context, trace = self._context, self._trace
        if _CONTEXT_HEADERS.isdisjoint(carrier):
            # Most calls: a root (no context came with it), that the sampler leaves out. Decided
            # here, as the tracer would (_Roots), without making an SDK span: its attempts' trace
            # headers are its traceparent and the route's baggage only, written without the
            # propagators. A root the sampler takes is started by the tracer on that trace id.
            parent = self._roots.empty
            span = self._roots.unsampled(path[1:], lambda: _server_attributes(path, carrier), self._unsampled)
            if span is not None:
                # Current for the rest of this call's task, so that its log lines carry the ids.
                context.attach(trace.set_span_in_context(span, parent))
                return span
        else:
            parent = self._propagator.extract(carrier)
        attributes = _server_attributes(path, carrier)
        span = self._tracer.start_span(
            path[1:], context=parent, kind=self._server_kind, attributes=attributes
        )
        context.attach(trace.set_span_in_context(span, parent))
        return span

    def attempt(self, parent: Any, plan: Plan[Any], path: str) -> Attempt:
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

    def _traced_attempt(self, parent: Any, plan: Plan[Any], path: str) -> Attempt:
        from opentelemetry.trace import SpanKind

        trace = self._trace
        context = trace.set_span_in_context(parent)
        attributes: dict[str, Any] = {"net.peer.name": plan.upstream.address, **_route_attributes(plan)}
        if plan.breaker is not None:
            attributes["modelyard.breaker.state"] = plan.breaker.state.value
        span = self._tracer.start_span(path[1:], context=context, kind=SpanKind.CLIENT, attributes=attributes)
        try:
            return Attempt(self._outgoing(plan, trace.set_span_in_context(span, context)), span)
        except BaseException:
            span.end()
            raise

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


@functools.lru_cache(maxsize=256)
def _method_attributes(path: str) -> dict[str, str]:
    """A server span's attributes that its method decides (a path of the method table: bounded)."""
    service, _, method = path[1:].rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _server_attributes(path: str, carrier: Mapping[str, str]) -> dict[str, str]:
    attributes = dict(_method_attributes(path))  # a copy: the span keeps it
    tenant = carrier.get(headers.TENANT_ID)
    if tenant:  # as sent (capped): a trace is one call's, not a series
        attributes["modelyard.tenant"] = tenant if len(tenant) <= NAME_MAX else echo(tenant)
    return attributes


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
