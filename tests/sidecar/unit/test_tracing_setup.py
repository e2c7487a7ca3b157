"""Tracing off without an endpoint; log records carry the current span's ids when it is on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

from modelyard.sidecar.layers.attempt import Attempt
from modelyard.sidecar.layers.read import Metadata
from modelyard.sidecar.tracing import CallSpan, Tracing, configure, log_ids

PATH = "/inference.GRPCInferenceService/ModelInfer"


def test_off_without_an_otlp_endpoint() -> None:
    assert not configure("x", {}).enabled
    assert not configure(
        "x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_SDK_DISABLED": "true"}
    ).enabled


def test_log_records_carry_the_current_trace_and_span_ids() -> None:
    span = TracerProvider().get_tracer("t").start_span("s")
    assert log_ids() is None
    token = context.attach(trace.set_span_in_context(span))
    try:
        found = log_ids()
    finally:
        context.detach(token)
    ids = span.get_span_context()
    assert found == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))


@dataclass(frozen=True)
class _Up:
    address: str


def _plan(version: str = "2", dye: str = "canary") -> Attempt[Any]:
    return Attempt("m", version, dye, "", "1", _Up("a"), None, None, (("x-user-id", "u"),), None, "m", ())


def _traced(sampler: Any) -> tuple[Tracing, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Tracing(provider), exported


def _attempted(tracing: Tracing, span: CallSpan, plan: Attempt[Any]) -> Metadata:
    """One attempt of the call (its client span, if it has one, ended): the metadata it sends."""
    metadata, client = span.attempt(plan, PATH)
    if client is not None:
        client.end()
    return metadata


PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"  # a caller's unsampled trace


def test_an_unsampled_call_passes_its_trace_context_on_without_the_route_baggage() -> None:
    """No span is recorded (no client span is made), yet the service gets the trace context that
    its parent-based sampler agrees with: the caller's trace id, not sampled. No route baggage: the
    service's span reads it only when it records (version and dye travel as headers)."""
    tracing, exported = _traced(ParentBased(ALWAYS_ON))
    span = tracing.server_span(PATH, (("traceparent", PARENT),))
    md = {k: v for k, v in _attempted(tracing, span, _plan()) if isinstance(v, str)}
    span.end(_plan(), grpc.StatusCode.OK)
    assert not span.otel().is_recording() and exported.get_finished_spans() == ()
    assert md["x-user-id"] == "u"
    version, trace_id, parent_id, flags = md["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "00")
    assert parent_id == format(span.otel().get_span_context().span_id, "016x")  # no client span
    assert "baggage" not in md


def test_a_sampled_attempt_adds_the_route_baggage_and_every_attempt_keeps_the_callers() -> None:
    sampled, exported = _traced(ALWAYS_ON)
    unsampled, _ = _traced(ALWAYS_OFF)
    sent: list[str | bytes | None] = []
    for tracing, caller in (
        (sampled, None),
        (unsampled, None),
        (sampled, "team=a"),
        (unsampled, "team=a"),  # the SDK's path (baggage came): an unsampled span
    ):
        token = context.attach(context.Context())  # each call in a context of its own
        try:
            span = tracing.server_span(PATH, (("baggage", caller),) if caller else ())
            sent.append(dict(_attempted(tracing, span, _plan("1", "stable"))).get("baggage"))
            span.end(_plan("1", "stable"), grpc.StatusCode.OK)
        finally:
            context.detach(token)
    assert sent[0] == "model.version=1,model.dye=stable" and sent[1] is None
    assert sent[2] == "team=a,model.version=1,model.dye=stable"  # the caller's kept, then ours
    assert sent[3] == "team=a"  # the caller's, as it came
    assert len(exported.get_finished_spans()) == 4  # two calls, each a server and a client span


@pytest.mark.parametrize(
    "caller",
    [
        (),  # a root
        (
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ("tracestate", "a=1,b=2"),
        ),
    ],
)
def test_a_sampled_attempt_sends_what_the_propagators_write(caller: Metadata) -> None:
    """The client span's traceparent (and the caller's tracestate) as the W3C propagator writes
    them, then the route's baggage, after the forwarded headers."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracing, _ = _traced(ALWAYS_ON)
    token = context.attach(context.Context())
    try:
        span = tracing.server_span(PATH, caller)
        metadata, client = span.attempt(_plan(), PATH)
        written: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(written, trace.set_span_in_context(client))
        client.end()
        span.end(_plan(), grpc.StatusCode.OK)
    finally:
        context.detach(token)
    assert ("tracestate" in written) == bool(caller)
    assert metadata == (
        ("x-user-id", "u"),
        *written.items(),
        ("baggage", "model.version=2,model.dye=canary"),
    )


def test_an_unsampled_root_call_sends_what_the_propagators_write() -> None:
    """A call that brought no trace context and that the sampler left out (most calls): its
    attempts carry its traceparent exactly as the W3C propagator writes it (the sidecar writes
    it itself on this path) and no baggage, and its log lines its ids."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracing, exported = _traced(ParentBased(ALWAYS_OFF))
    for plan in (_plan(), _plan("", "")):
        token = context.attach(context.Context())
        try:
            span = tracing.server_span(PATH, (("x-user-id", "u"),))
            found = log_ids()  # its log lines carry its ids
            metadata = _attempted(tracing, span, plan)
            md = dict(metadata)
            span.end(plan, grpc.StatusCode.OK)
        finally:
            context.detach(token)
        written: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(written, trace.set_span_in_context(span.otel()))
        ids = span.otel().get_span_context()
        assert not span.otel().is_recording() and ids.is_valid
        assert found == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
        assert md["traceparent"] == written["traceparent"]
        assert "baggage" not in md and "tracestate" not in md
        assert list(md)[:1] == ["x-user-id"] and len(metadata) == len(md)
    assert exported.get_finished_spans() == ()


def _root_calls(tracing: Tracing, calls: int) -> list[Any]:
    spans = []
    for _ in range(calls):
        token = context.attach(context.Context())
        try:
            span = tracing.server_span(PATH, (("x-user-id", "u"),))
            span.end(_plan(), grpc.StatusCode.OK)
        finally:
            context.detach(token)
        spans.append(span.otel())
    return spans


def test_a_root_call_is_sampled_on_the_trace_id_it_is_sent_with() -> None:
    """The sidecar decides a root call's sampling itself (no SDK span for one left out): a call
    the ratio sampler takes is recorded under the very trace id the decision was made on, and the
    share taken is the ratio (a second, fresh trace id at the tracer would make it ratio^2)."""
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio, TraceIdRatioBased

    tracing, exported = _traced(ParentBasedTraceIdRatio(0.5))
    spans = _root_calls(tracing, 400)
    bound = TraceIdRatioBased.get_bound_for_rate(0.5)
    recorded = [s for s in spans if s.get_span_context().trace_flags.sampled]  # ended: not recording
    assert 140 <= len(recorded) <= 260, len(recorded)
    for span in spans:
        taken = span.get_span_context().trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < bound
        assert taken == span.get_span_context().trace_flags.sampled
    assert {s.context.trace_id for s in exported.get_finished_spans()} == {
        s.get_span_context().trace_id for s in recorded
    }


def test_another_sampler_is_asked_about_each_root_call_once() -> None:
    """A sampler other than the ratio rule is asked (once per call, as the tracer would) with the
    call's attributes; what it takes is recorded under the trace id it was asked about."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    asked: list[tuple[int, dict[str, Any]]] = []

    class EveryThird(Sampler):
        def should_sample(
            self, parent_context: Any, trace_id: int, *args: Any, **kwargs: Any
        ) -> SamplingResult:
            attributes = kwargs.get("attributes", args[2] if len(args) > 2 else None)
            asked.append((trace_id, dict(attributes or {})))
            take = len(asked) % 3 == 0
            return SamplingResult(Decision.RECORD_AND_SAMPLE if take else Decision.DROP, attributes)

        def get_description(self) -> str:
            return "every third"

    tracing, exported = _traced(EveryThird())
    spans = _root_calls(tracing, 9)
    assert len(asked) == 9 and all(a["rpc.method"] == "ModelInfer" for _, a in asked)
    assert [s.get_span_context().trace_id for s in spans] == [trace_id for trace_id, _ in asked]
    assert [s.get_span_context().trace_flags.sampled for s in spans] == [n % 3 == 2 for n in range(9)]
    assert len(exported.get_finished_spans()) == 3


def _no_sdk_span(tracing: Tracing, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the SDK spans the tracer starts from here on (it should start none)."""
    started: list[str] = []
    tracer = tracing._tracer
    start = tracer.start_span

    def counted(name: str, *args: Any, **kwargs: Any) -> Any:
        started.append(name)
        return start(name, *args, **kwargs)

    monkeypatch.setattr(tracer, "start_span", counted)
    return started


@pytest.mark.parametrize("flags", ["00", "02"])
def test_an_unsampled_callers_trace_is_continued_without_an_sdk_span(
    flags: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose caller's traceparent says "not sampled" (the gateway's, say), with
    ParentBased's rule for it (ALWAYS_OFF): no SDK span is made, and the attempt sends the
    caller's trace id under a new span id, with the caller's random-trace-id flag, in place of
    the caller's traceparent (which the forwarded metadata holds)."""
    tracing, exported = _traced(ParentBased(ALWAYS_ON))
    started = _no_sdk_span(tracing, monkeypatch)
    caller = f"{PARENT[:-2]}{flags}"
    md = (("x-user-id", "u"), ("traceparent", caller))
    span = tracing.server_span(PATH, md)
    plan: Attempt[Any] = Attempt("m", "2", "canary", "", "1", _Up("a"), None, None, md, None, "m", ())
    sent = [v for k, v in _attempted(tracing, span, plan) if k == "traceparent"]
    span.end(plan, grpc.StatusCode.OK)
    assert started == [] and exported.get_finished_spans() == ()
    assert len(sent) == 1 and sent[0] != caller
    version, trace_id, span_id, sent_flags = str(sent[0]).split("-")
    assert (version, trace_id, sent_flags) == ("00", PARENT.split("-")[1], flags)
    ids = span.otel().get_span_context()
    assert span_id == format(ids.span_id, "016x") and ids.trace_flags == int(flags, 16)
    sampled = tracing.server_span(PATH, (("traceparent", f"{PARENT[:-2]}01"),))  # the SDK's path
    assert started == ["inference.GRPCInferenceService/ModelInfer"] and sampled.otel().is_recording()
    sampled.end(plan, grpc.StatusCode.OK)
    (recorded,) = exported.get_finished_spans()
    assert recorded.parent is not None and recorded.parent.span_id == int(PARENT.split("-")[2], 16)


@pytest.mark.parametrize(
    "header",
    [
        PARENT,
        PARENT.upper(),  # upper-case hex: not W3C
        "ff" + PARENT[2:],  # version ff: invalid
        "00-" + "0" * 32 + PARENT[35:],  # zero trace id
        PARENT[:36] + "0" * 16 + "-00",  # zero span id
        PARENT + "-more",  # version 00 with more fields
        "01" + PARENT[2:] + "-more",  # a later version may have more
        " " + PARENT,  # leading blanks are allowed
        PARENT[:-3],  # cut short
    ],
)
def test_an_unsampled_callers_traceparent_is_read_as_the_propagator_reads_it(header: str) -> None:
    """A traceparent the W3C propagator accepts is continued (without an SDK span); one it refuses
    makes the call a root (here left out too: a new trace id, by the SDK's path)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracing, _ = _traced(ParentBased(ALWAYS_OFF))
    span = tracing.server_span(PATH, (("traceparent", header),))
    parent = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": header}))
    accepted = parent.get_span_context().is_valid
    assert bool(span.traceparent) is accepted  # no SDK span: only its traceparent
    ids = span.otel().get_span_context()
    assert (ids.trace_id == parent.get_span_context().trace_id) is accepted
    assert ids.span_id != parent.get_span_context().span_id


def test_an_unsampled_calls_log_lines_and_shadow_span_are_of_its_trace() -> None:
    """No OTel context is attached for an unsampled call: its log lines read its ids and a shadow
    span of it is its child all the same (recorded here: a sampler that takes such children); a
    sampled call after it in the same context is not mistaken for it."""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    tracing, exported = _traced(ParentBased(TraceIdRatioBased(0.0), local_parent_not_sampled=ALWAYS_ON))
    token = context.attach(context.Context())
    try:
        span = tracing.server_span(PATH, (("x-user-id", "u"),))
        ids = span.otel().get_span_context()
        assert log_ids() == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
        with tracing.shadow("m", "1", "2", PATH):
            pass
        span.end(_plan(), grpc.StatusCode.OK)
        (shadow,) = exported.get_finished_spans()
        assert shadow.name == "modelyard.sidecar/shadow" and shadow.parent is not None
        assert (shadow.context.trace_id, shadow.parent.span_id) == (ids.trace_id, ids.span_id)
        sampled = tracing.server_span(PATH, (("traceparent", f"{PARENT[:-2]}01"),))
        ids = sampled.otel().get_span_context()
        assert log_ids() == (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
    finally:
        context.detach(token)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_the_ratio_rules_ends_take_no_root_or_every_root(rate: float) -> None:
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    tracing, exported = _traced(ParentBasedTraceIdRatio(rate))
    spans = _root_calls(tracing, 300)  # more than one block of ids
    assert [s.get_span_context().trace_flags.sampled for s in spans] == [rate == 1.0] * 300
    assert len({s.get_span_context().trace_id for s in spans}) == 300
    assert len(exported.get_finished_spans()) == (300 if rate else 0)


def test_a_forked_child_does_not_send_its_parents_trace_ids() -> None:
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    tracing, _ = _traced(ParentBasedTraceIdRatio(0.0))
    assert tracing.server_span(PATH, ()).traceparent  # a block of ids is drawn
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(write, tracing.server_span(PATH, ()).traceparent.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    theirs = os.read(read, 100).decode()
    os.close(read)
    assert status == 0 and theirs.startswith("00-")
    assert str(tracing.server_span(PATH, ()))[3:35] != theirs[3:35]
