"""The OTLP exporter's request, built in place (modelyard.process.tracing.encode_spans), is the
SDK encoder's, byte for byte, for every shape of span the processes export and a few more."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from modelyard.process.tracing import _grpc_exporter_type, encode_spans, otlp_provider


def _provider(name: str, spans: InMemorySpanExporter, schema: str | None = None) -> TracerProvider:
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}, schema_url=schema),
        span_limits=SpanLimits(max_span_attributes=6),
    )
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider


def _spans() -> tuple[ReadableSpan, ...]:
    spans = InMemorySpanExporter()
    sidecar = _provider("modelyard-sidecar", spans).get_tracer("modelyard.sidecar")
    # The sidecar's call: a server span and an attempt's client span under it.
    server = sidecar.start_span(
        "inference.GRPCInferenceService/ModelInfer",
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.method": "ModelInfer", "modelyard.tenant": "bench"},
    )
    client = sidecar.start_span(
        "inference.GRPCInferenceService/ModelInfer",
        context=trace.set_span_in_context(server),
        kind=SpanKind.CLIENT,
        attributes={"net.peer.name": "127.0.0.1:1", "modelyard.version": "2", "modelyard.dye": ""},
    )
    client.set_attribute("rpc.grpc.status_code", 14)
    client.set_status(Status(StatusCode.ERROR, "UNAVAILABLE"))
    client.end()
    server.set_attributes({"rpc.grpc.status_code": 0, "modelyard.version": "2"})
    server.end()
    # A shadow comparison: an event; a remote parent with a trace state; links.
    state = TraceState([("k", "v")])
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    shadow = sidecar.start_span(
        "modelyard.sidecar/shadow",
        context=trace.set_span_in_context(NonRecordingSpan(remote)),
        kind=SpanKind.INTERNAL,
        links=[Link(remote, {"why": "shadow"}), Link(SpanContext(1, 2, is_remote=False))],
    )
    shadow.add_event("compared", {"modelyard.shadow.result": "equal", "n": 3})
    shadow.set_status(Status(StatusCode.OK))
    shadow.end()
    # Values the fast path leaves to the SDK's code: a list, bytes-like tuple, a float, a bool,
    # an int past 64 bits (the SDK's encoder logs and leaves it out), and one attribute too many.
    odd = sidecar.start_span("odd", kind=SpanKind.PRODUCER)
    odd.set_attributes({"f": 0.5, "b": True, "l": ["a", "b"], "t": (1, 2), "big": 2**70, "neg": -(2**63)})
    odd.set_attribute("dropped", "x")
    odd.end()
    # Another tracer (scope with a version and schema) and another provider (resource and schema).
    scoped = TracerProvider(resource=sidecar.resource)  # type: ignore[attr-defined]
    scoped.add_span_processor(SimpleSpanProcessor(spans))
    schema = "https://opentelemetry.io/schemas/1.21.0"
    scoped.get_tracer("other", "1.2", schema_url=schema).start_span("s").end()
    service = _provider("modelyard-service", spans, schema=schema)
    service.get_tracer("modelyard.service").start_span("run", kind=SpanKind.CONSUMER).end()
    sidecar.start_span("again").end()  # the first resource and scope again, after the others
    return spans.get_finished_spans()


def test_the_request_is_the_sdk_encoders_byte_for_byte() -> None:
    spans = _spans()
    assert len(spans) == 7
    ours = encode_spans(spans)
    theirs = sdk_encode_spans(spans)
    assert ours == theirs
    assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
    assert [len(r.scope_spans) for r in ours.resource_spans] == [2, 1]  # grouped as the SDK's
    assert encode_spans(()).SerializeToString() == sdk_encode_spans(()).SerializeToString() == b""


def test_the_grpc_exporter_builds_its_request_so() -> None:
    provider = otlp_provider("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    try:
        exporter = provider._active_span_processor._span_processors[0]._batch_processor._exporter
        assert type(exporter) is _grpc_exporter_type()
        spans = _spans()
        assert exporter._translate_data(spans) == sdk_encode_spans(spans)
    finally:
        provider.shutdown()
