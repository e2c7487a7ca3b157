"""OpenTelemetry tracing: a server span per call, a client span per upstream attempt, W3C
`traceparent` passed on to the service (and the route's `baggage` on a sampled call). On when
an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; protocol from `OTEL_EXPORTER_OTLP_PROTOCOL`: grpc, the
default, or http/protobuf); off, it costs a few attribute reads per call. Health checks are not
traced (the proxy never sees them).

The SDK is imported only when tracing is on, so the hot path of a sidecar without it stays lean.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import grpc

from modelyard.common import headers
from modelyard.common.names import NAME_MAX, echo
from modelyard.common.reasons import is_server_fault
from modelyard.process import logs
from modelyard.process.tracing import otlp_provider

if TYPE_CHECKING:
    from modelyard.sidecar.layers.attempt import Attempt
    from modelyard.sidecar.layers.read import Metadata

log = logging.getLogger(__name__)
_ID_BLOCK = 24 * 256  # bytes of random ids drawn at once (server_span): 256 calls' worth
_NO_ID = bytes(8)  # 64 zero bits (a zero trace id or span id is invalid, W3C)

ROUTE_BAGGAGE_KEPT = 256  # encoded baggage headers kept, per (version, dye)
# Request headers that carry a trace context or baggage in (W3C).
_CONTEXT_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})
# The current call's server span when it is an unsampled call's traceparent (see Tracing), else
# None: what its log lines and a shadow span of it read instead of an attached OTel context.
_UNSAMPLED: ContextVar[str | None] = ContextVar("modelyard.sidecar.unsampled", default=None)


_TRACEPARENT = "traceparent"


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


def _ids_random(ids: Any) -> bool:
    """Whether an id generator is the SDK's RandomIdGenerator itself (random.getrandbits, with a
    redraw of a zero id), whose ids the sidecar may then draw directly."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    return type(ids) is RandomIdGenerator


def _is_sdk_tracer(tracer: Any) -> bool:
    """Whether the tracer is the SDK's Tracer, whose enabled check is its _TracerConfig's flag
    (which the provider may change), read directly then."""
    from opentelemetry.sdk.trace import Tracer

    return type(tracer) is Tracer and hasattr(tracer, "_tracer_config")


_DRAWING: weakref.WeakSet[Tracing] = weakref.WeakSet()  # those that cut ids from a block


def _forget_ids() -> None:
    """In a forked child: a block of ids drawn before the fork is the parent's (the random module
    reseeds at a fork for the same reason)."""
    for tracing in _DRAWING:
        tracing._at = _ID_BLOCK


os.register_at_fork(after_in_child=_forget_ids)


def _random_ids() -> bytes:
    """Random ids for _ID_BLOCK // 24 root calls, drawn at once: for each, 16 bytes of trace id
    and 8 of span id (os.urandom: the random bits that the SDK's RandomIdGenerator would draw from
    random.getrandbits, without two draws a call). A block with 8 zero bytes anywhere is drawn
    again (the SDK redraws a zero id)."""
    while True:
        block = os.urandom(_ID_BLOCK)
        if _NO_ID not in block:
            return block


class _Roots:
    """The sampling of root calls (no trace context came in), decided without an SDK span: the
    tracer's own steps for a root (a trace id from its id generator, its sampler asked with an
    empty parent context, the random-trace-id flag), minus the span objects of a call left out.
    A ParentBased(TraceIdRatioBased) sampler, the usual one, is read directly (`bound`: its root's
    rule on the trace id's low 64 bits). A root the sampler takes is left to the tracer, with its
    trace id preset, so the span is of the very trace id the decision was made on. (The SDK's own
    span metrics, kept only with an OTel meter provider, which the sidecar does not set, do not
    count a call left out.)"""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry.context import Context
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, TraceFlags

        self.empty = Context()
        self.server_kind = SpanKind.SERVER
        self.enabled: Callable[[], bool] = tracer._is_enabled
        self._tracer = tracer
        self.ids = tracer.id_generator = _preset_ids_type()(tracer.id_generator)
        self.random = _ids_random(self.ids.ids)
        flags = TraceFlags.RANDOM_TRACE_ID if self.ids.is_trace_id_random() else TraceFlags.DEFAULT
        # An unsampled root's traceparent, as the W3C propagator writes it: trace id, span id.
        self.traceparent = "00-%%032x-%%016x-%02x" % flags  # noqa: UP031
        sampler = tracer.sampler
        self._sampler = tracer.sampler = _preset_sampler_type()(sampler)
        if isinstance(sampler, ParentBased) and type(sampler).should_sample is ParentBased.should_sample:
            sampler = sampler._root  # what decides for a root
        ratio = isinstance(sampler, TraceIdRatioBased)
        # The bound of a TraceIdRatioBased root rule (sampling.py), else None: the sampler is asked.
        self.bound: int | None = (
            sampler.bound
            if ratio and type(sampler).should_sample is TraceIdRatioBased.should_sample
            else None
        )
        self.limit = TraceIdRatioBased.TRACE_ID_LIMIT

    def unsampled(self, name: str, attributes: Callable[[], dict[str, Any]]) -> str:
        """The traceparent of a root call the sampler leaves out, or "" when it takes it (the
        tracer's start_span then makes its span, of the same trace id; or the tracer is off).
        `attributes`: the span's, made only when the sampler is asked for its decision."""
        if not self.enabled():
            return ""  # the tracer's own answer (a non-recording span without context)
        if self.random:
            trace_id = random.getrandbits(128) or self.ids.ids.generate_trace_id()  # RandomIdGenerator's
        else:
            trace_id = self.ids.ids.generate_trace_id()
        bound = self.bound
        if bound is not None:
            if trace_id & self.limit >= bound:
                return self.traceparent % (trace_id, self.span_id())
        else:
            found = self._tracer.sampler.should_sample(
                self.empty, trace_id, name, self.server_kind, attributes(), ()
            )
            if (
                not found.decision.is_recording()
                and not found.decision.is_sampled()
                and not found.trace_state
            ):
                return self.traceparent % (trace_id, self.span_id())
            self._sampler.preset = (trace_id, found)  # the tracer's start_span is told, not asks
        self.ids.preset = trace_id
        return ""

    def span_id(self) -> int:
        if self.random:
            return random.getrandbits(64) or int(self.ids.ids.generate_span_id())
        return int(self.ids.ids.generate_span_id())


def _drops_unsampled_remote_parents(sampler: Any) -> bool:
    """Whether the sampler is a ParentBased one whose rule for a remote parent that is not sampled
    is the SDK's ALWAYS_OFF (its default): then such a call is left out without asking it."""
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler

    if type(sampler).should_sample is not ParentBased.should_sample or not isinstance(sampler, ParentBased):
        return False
    rule = sampler._remote_parent_not_sampled
    return type(rule) is StaticSampler and rule._decision is Decision.DROP


class Tracing:
    """The sidecar's spans. A call the sampler leaves out and that brought no tracestate or
    baggage (most calls) has no span object: its "span" is the traceparent its attempts carry (a
    str), made of a random trace id (or the caller's) and span id; the call's log lines and a
    shadow span of it find it in a context variable (no OTel context is attached), and its end is
    nothing. Every other call has the SDK's span, made and attached as the SDK does."""

    def __init__(self, provider: Any = None) -> None:
        self._provider = provider
        self.enabled = provider is not None
        if provider is not None:
            logs.join_traces(log_ids)  # JSON log lines carry the current call's ids
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
            self._route_baggage: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
            self._roots = roots = _Roots(self._tracer)
            self._server_kind = roots.server_kind
            self._client_kind = trace.SpanKind.CLIENT
            # The inline root path (server_span): the ratio rule, with the SDK's random ids and
            # its Tracer's enabled flag read directly. `_least_unsampled`: the rule's bound as
            # 8 big-endian bytes (a trace id's low 64 bits at or above it are left out).
            bound = roots.bound if roots.random and _is_sdk_tracer(self._tracer) else None
            self._least_unsampled = None if bound is None or bound > roots.limit else bound.to_bytes(8, "big")
            self._ids, self._at = b"", _ID_BLOCK
            _DRAWING.add(self)
            self._drops_unsampled_parents = _drops_unsampled_remote_parents(roots._sampler.sampler)
            self._parent_format = TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE

    def server_span(self, path: str, md: Metadata) -> CallSpan:
        """The call's server span (UNTRACED when tracing is off)."""
        if not self.enabled:
            return UNTRACED
        for key, _ in md:
            if key in _CONTEXT_HEADERS:
                break
        else:
            # Most calls: a root (no context came with it). Decided here, as the tracer would
            # (_Roots), without an SDK span for one that the sampler leaves out; inline for the
            # usual ratio rule: random ids, one compare, its traceparent written.
            least = self._least_unsampled
            if least is not None and self._tracer._tracer_config.is_enabled:
                at = self._at
                if at == _ID_BLOCK:
                    self._ids = _random_ids()
                    at = 0
                self._at = at + 24
                ids = self._ids[at : at + 24]  # the trace id's 16 bytes, the span id's 8
                if ids[8:16] >= least:  # the ratio rule, on the trace id's low 64 bits (big-endian)
                    traceparent = f"00-{ids.hex('-', -16)}-02"  # random trace id flag: set
                    _UNSAMPLED.set(traceparent)
                    return CallSpan(self, None, traceparent)
                # Taken: the tracer's span, on this very trace id.
                self._roots.ids.preset = int.from_bytes(ids[:16], "big")
            else:
                attributes = functools.partial(_server_attributes, path, dict(md))
                traceparent = self._roots.unsampled(path[1:], attributes)
                if traceparent:
                    _UNSAMPLED.set(traceparent)
                    return CallSpan(self, None, traceparent)
            return self._started(path, dict(md), self._roots.empty)
        found = dict(md)
        continued = self._unsampled_child(found)
        if continued is not None:
            _UNSAMPLED.set(continued)
            return CallSpan(self, None, continued, True)
        carrier = {k: v for k, v in found.items() if isinstance(v, str)}
        return self._started(path, found, self._propagator.extract(carrier))

    def _started(self, path: str, found: Mapping[str, str | bytes], parent: Any) -> CallSpan:
        """The SDK's server span of a call (`found`: its metadata), under `parent` (a context),
        current for the rest of the call's task so that its log lines carry its ids."""
        attributes = _server_attributes(path, found)
        span = self._tracer.start_span(
            path[1:], context=parent, kind=self._server_kind, attributes=attributes
        )
        self._context.attach(self._trace.set_span_in_context(span, parent))
        if _UNSAMPLED.get() is not None:
            _UNSAMPLED.set(None)  # this call's log lines read the OTel context's span
        return CallSpan(self, span)

    def _unsampled_child(self, found: Mapping[str, str | bytes]) -> str | None:
        """The traceparent of a call whose caller's traceparent says "not sampled", with no
        tracestate or baggage, when the sampler leaves such a call out (ParentBased's default):
        the caller's trace id, a new span id, the caller's random-trace-id flag, read as the W3C
        propagator reads them. None otherwise (the SDK's path decides)."""
        parent = found.get(_TRACEPARENT)
        if (
            type(parent) is not str
            or not self._drops_unsampled_parents
            or "tracestate" in found
            or "baggage" in found
            or len(parent) > 512  # the propagator's limit
        ):
            return None
        match = self._parent_format.match(parent)
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        sampled = int(flags, 16)
        if (
            sampled & 1
            or version == "ff"
            or (version == "00" and rest)
            or trace_id == "0" * 32
            or span_id == "0" * 16
            or not self._roots.enabled()
        ):
            return None
        ids = (trace_id, self._roots.span_id(), "02" if sampled & 2 else "00")
        return "00-%s-%016x-%s" % ids  # noqa: UP031

    def _traced_attempt(self, parent: Any, attempt: Attempt[Any], path: str) -> tuple[Metadata, Any]:
        trace = self._trace
        context = trace.set_span_in_context(parent)
        attributes: dict[str, Any] = {"net.peer.name": attempt.upstream.address, **_route_attributes(attempt)}
        if attempt.breaker is not None:
            attributes["modelyard.breaker.state"] = attempt.breaker.state.value
        kind = self._client_kind
        span = self._tracer.start_span(path[1:], context=context, kind=kind, attributes=attributes)
        try:
            if attempt.version and not self._baggage.get_all(context):
                # No baggage came with the call: the span's trace context, as the W3C propagator
                # writes it (a recording span's context is valid), and the route's own baggage.
                ids = span.get_span_context()
                carrier = {_TRACEPARENT: f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"}
                if ids.trace_state:
                    carrier["tracestate"] = ids.trace_state.to_header()
                carrier.update(self._baggage_of(attempt.version, attempt.dye))
                forward = tuple([kv for kv in attempt.forward if kv[0] not in carrier])
                return (*forward, *carrier.items()), span
            return self._outgoing(attempt, trace.set_span_in_context(span, context)), span
        except BaseException:
            span.end()
            raise

    @staticmethod
    def failed(client: Any, code: grpc.StatusCode, reason: str = "") -> None:
        """An attempt's client span (from `attempt`) failed with `code` (and the upstream's
        x-error-reason: a canary's `model_rejected` replayed on stable says so)."""
        from opentelemetry.trace import Status, StatusCode

        client.set_attribute("rpc.grpc.status_code", code.value[0])
        if reason:
            client.set_attribute("modelyard.error_reason", reason)
        client.set_status(Status(StatusCode.ERROR, code.name))

    def _outgoing(self, attempt: Attempt[Any], context: Any, route: bool = True) -> Metadata:
        """The attempt's request metadata: the forwarded headers, and `context`'s traceparent
        (and tracestate) and baggage, with the attempt's `model.version` and `model.dye` added
        (`route`: a sampled attempt's; _traced_attempt writes the usual case itself)."""
        carrier: dict[str, str] = {}
        baggage = self._baggage
        if route and attempt.version:
            context = baggage.set_baggage("model.version", attempt.version, context)
            context = baggage.set_baggage("model.dye", attempt.dye, context)
        self._propagator.inject(carrier, context)
        return tuple((k, v) for k, v in attempt.forward if k not in carrier) + tuple(carrier.items())

    def _baggage_of(self, version: str, dye: str) -> tuple[tuple[str, str], ...]:
        """The `baggage` header of only model.version and model.dye, as the propagator writes it."""
        found = self._route_baggage.get((version, dye))
        if found is None:
            baggage = self._baggage
            context = baggage.set_baggage("model.version", version, self._context.Context())
            written: dict[str, str] = {}
            self._baggage_propagator.inject(written, baggage.set_baggage("model.dye", dye, context))
            found = tuple(written.items())
            if len(self._route_baggage) < ROUTE_BAGGAGE_KEPT:  # a pinned version may be anything
                self._route_baggage[(version, dye)] = found
        return found

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
        unsampled = _UNSAMPLED.get()
        # A shadow of an unsampled call is its child as if its span were current (no OTel context
        # was attached for it): the sampler decides as for any child of an unsampled parent.
        parent = None if unsampled is None else self._trace.set_span_in_context(unsampled_span(unsampled))
        span = self._tracer.start_span(
            "modelyard.sidecar/shadow", context=parent, kind=SpanKind.INTERNAL, attributes=attributes
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


def log_ids() -> tuple[str, str] | None:
    """The current call's trace and span ids for a log line (modelyard.process.logs): an
    unsampled call's from its traceparent, else the current OTel span's; None outside a call.
    The call's context stays attached to its task after its span ends, so its access line
    carries them too."""
    unsampled = _UNSAMPLED.get()
    if unsampled is not None:
        return unsampled[3:35], unsampled[36:52]
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


class CallSpan:
    """A call's server span, one type whatever stands for it (Tracing.server_span):
    - none (`UNTRACED`: tracing off): its attempts carry the call's metadata as it is;
    - an unsampled call's `traceparent` (no SDK span: see Tracing), which its attempts carry;
      `continues`: the call continues its caller's trace, whose traceparent its attempts replace;
    - the SDK's `span`, recording or not.
    Every question about the call's spans is one of its methods, so that the proxy and the scope
    hold no type tests of their own and a change of tracing is a change of this module."""

    __slots__ = ("_continues", "_tracing", "span", "traceparent")

    def __init__(
        self, tracing: Tracing | None, span: Any = None, traceparent: str = "", continues: bool = False
    ) -> None:
        self._tracing = tracing
        self.span = span
        self.traceparent = traceparent
        self._continues = continues

    def attempt(self, attempt: Attempt[Any], path: str) -> tuple[Metadata, Any]:
        """One upstream attempt of the call: the request metadata to send (with the trace context,
        and the route's baggage on a sampled call) and the attempt's client span, or None when it
        has none (untraced, or not sampled). The caller ends a client span once the attempt is
        over (`Tracing.failed` first for a failure). A pair, not an object: most attempts have
        no span, and then nothing is made but the metadata."""
        tracing = self._tracing
        if tracing is None:
            return attempt.forward, None
        # An unsampled call's attempts carry its traceparent (not sampled: the service's
        # parent-based sampler leaves the call out too) and no route baggage: the service's span
        # reads model.version and model.dye from it only when it records, and the version and
        # dye travel as headers anyway (x-model-version, x-model-dye): one header fewer.
        traceparent = self.traceparent
        if traceparent:
            if not self._continues:
                # A root (`forward` holds no trace context): its traceparent, as the W3C
                # propagator writes it.
                return (*attempt.forward, (_TRACEPARENT, traceparent)), None
            # It continues its caller's trace, whose traceparent `forward` holds (and no
            # tracestate or baggage): replaced by the call's.
            forward = tuple([kv for kv in attempt.forward if kv[0] != _TRACEPARENT])
            return (*forward, (_TRACEPARENT, traceparent)), None
        span = self.span
        if not span.is_recording():
            # A call the sampler left out: a client span would record nothing either; its trace
            # context (not sampled) and the caller's baggage, as it came, go on.
            context = tracing._trace.set_span_in_context(span)
            return tracing._outgoing(attempt, context, route=False), None
        return tracing._traced_attempt(span, attempt, path)

    def refused(self, reason: str) -> None:
        """The sidecar answered the call itself, for `reason` (an unsampled call keeps nothing)."""
        if self.span is not None:
            self.span.set_attribute("modelyard.error_reason", reason)

    def end(self, attempt: Attempt[Any] | None, code: grpc.StatusCode, reason: str = "") -> None:
        """The call's server span ends: ERROR only for a server fault (OpenTelemetry's rule for
        server spans), never for a client's mistake or a load refusal."""
        span = self.span
        if span is None or not span.is_recording():
            return  # an unsampled call keeps nothing: its attributes, status and end are no-ops
        from opentelemetry.trace import Status, StatusCode

        # One set_attributes (one lock, one validation pass), in the order they were set apart.
        attributes: dict[str, Any] = {} if attempt is None else _route_attributes(attempt)
        attributes["rpc.grpc.status_code"] = code.value[0]
        if reason:
            attributes["modelyard.error_reason"] = reason
        span.set_attributes(attributes)
        if is_fault(code, reason):
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()

    def otel(self) -> Any:
        """The OTel span (None when tracing is off): an unsampled call's, non-recording, made
        from its traceparent only when asked."""
        return unsampled_span(self.traceparent) if self.traceparent else self.span


UNTRACED = CallSpan(None)  # every call's while tracing is off: one object, no span


def unsampled_span(traceparent: str) -> Any:
    """The OTel span (non-recording) that an unsampled call's traceparent stands for (see
    Tracing): for what needs a span object, made only when asked."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id, flags = (
        int(traceparent[3:35], 16),
        int(traceparent[36:52], 16),
        int(traceparent[53:55], 16),
    )
    return NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)))


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


def _server_attributes(path: str, carrier: Mapping[str, str | bytes]) -> dict[str, str]:
    attributes = dict(_method_attributes(path))  # a copy: the span keeps it
    tenant = carrier.get(headers.TENANT_ID)
    if isinstance(tenant, str) and tenant:  # as sent (capped): a trace is one call's, not a series
        attributes["modelyard.tenant"] = tenant if len(tenant) <= NAME_MAX else echo(tenant)
    return attributes


def _route_attributes(attempt: Attempt[Any]) -> dict[str, str]:
    attributes = {"modelyard.model": attempt.model}
    if attempt.version:
        attributes["modelyard.version"] = attempt.version
    if attempt.dye:
        attributes["modelyard.dye"] = attempt.dye
    if attempt.fallback:
        attributes["modelyard.fallback"] = attempt.fallback
    return attributes


def configure(service_name: str, environ: Mapping[str, str] | None = None) -> Tracing:
    """Tracing from the standard OTEL_* variables; off when no OTLP endpoint is set."""
    provider = otlp_provider(service_name, environ)
    if provider is None:
        return Tracing()
    return Tracing(provider)
