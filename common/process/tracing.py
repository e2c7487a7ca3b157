"""OTLP tracing set-up for the processes that trace (service, sidecar): the standard OTEL_*
variables decide. The OpenTelemetry SDK (in those processes' extras, not the base install) is
imported only when tracing is on."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


def otlp_provider(default_name: str, environ: Mapping[str, str] | None = None) -> Any | None:
    """A TracerProvider that exports over OTLP (gRPC, or HTTP/protobuf as
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says) when an OTLP endpoint is configured and the SDK is
    not disabled; None otherwise. The exporter reads its endpoint and options from the same
    variables; the resource's service.name is OTEL_SERVICE_NAME, else `default_name`."""
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exporter: Any
    if protocol == "grpc":
        exporter = _grpc_exporter_type()()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", default_name)})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: OTLP %s to %s", protocol, endpoint)
    return provider


@functools.cache
def _grpc_exporter_type() -> Any:
    """The OTLP/gRPC span exporter, whose request is built by `encode_spans` below (the same
    message) when the SDK's exporter still builds it in `_translate_data`; else the SDK's own."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    if "_translate_data" not in OTLPSpanExporter.__dict__:
        return OTLPSpanExporter
    try:  # the SDK's internal encoders that encode_spans reuses (the SDK is not pinned above)
        encode_spans([])
    except ImportError:
        return OTLPSpanExporter

    class Exporter(OTLPSpanExporter):
        def _translate_data(self, data: Sequence[Any]) -> Any:
            return encode_spans(data)

    return Exporter


def encode_spans(spans: Sequence[Any]) -> Any:
    """The ExportTraceServiceRequest of `spans`, field for field the one the SDK's encoder
    (opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans) makes, built in place:
    the SDK's builds each message from keyword arguments, which copies every nested message into
    its parent again (an attribute's value is copied five times), and hashes a span's resource
    (a JSON dump of its attributes) per span: about three times the CPU of building the request in
    place (docs/benchmarks.md, "Costs the code is shaped by"). Spans are grouped by resource, then
    instrumentation scope, in order of first appearance, as the SDK's are; an attribute value
    other than str, bool, int or float, an event and a link are encoded by the SDK's own code."""
    from opentelemetry.exporter.otlp.proto.common._internal import (
        _encode_instrumentation_scope,
        _encode_key_value,
        _encode_resource,
    )
    from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import (
        _SPAN_KIND_MAP,
        _encode_events,
        _encode_links,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    groups: dict[Any, dict[Any, list[Any]]] = {}
    resource = scope = last = None
    for span in spans:
        # Grouped as the SDK groups them (by equality), looked up only when the pair changes.
        if last is None or span.resource is not resource or (span.instrumentation_scope or None) is not scope:
            resource, scope = span.resource, span.instrumentation_scope or None
            last = groups.setdefault(resource, {}).setdefault(scope, [])
        last.append(span)
    request = ExportTraceServiceRequest()
    for resource, scopes in groups.items():
        resource_spans = request.resource_spans.add()
        resource_spans.resource.SetInParent()  # present even when empty, as the SDK's
        resource_spans.resource.CopyFrom(_encode_resource(resource))
        for scope, members in scopes.items():
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.SetInParent()
            scope_spans.scope.CopyFrom(_encode_instrumentation_scope(scope))
            for span in members:
                _encode_span(scope_spans.spans.add(), span, _SPAN_KIND_MAP, _encode_key_value)
                events, links = span.events, span.links
                if events:
                    scope_spans.spans[-1].events.extend(_encode_events(events) or ())
                if links:
                    scope_spans.spans[-1].links.extend(_encode_links(links))
            if scope is not None and scope.schema_url:
                scope_spans.schema_url = scope.schema_url
        if resource.schema_url:
            resource_spans.schema_url = resource.schema_url
    return request


_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # trace.proto's SpanFlags
# AnyValue's field for an attribute value of exactly this type (bool is not int here).
_VALUE_FIELDS = {str: "string_value", bool: "bool_value", int: "int_value", float: "double_value"}


def _encode_span(out: Any, span: Any, kinds: Mapping[Any, int], encode_key_value: Any) -> None:
    context = span.get_span_context()
    out.trace_id = context.trace_id.to_bytes(16, "big")
    out.span_id = context.span_id.to_bytes(8, "big")
    if context.trace_state:
        out.trace_state = ",".join([f"{key}={value}" for key, value in context.trace_state.items()])
    parent = span.parent
    if parent:
        out.parent_span_id = parent.span_id.to_bytes(8, "big")
    out.name = span.name
    out.kind = kinds[span.kind]
    if span.start_time is not None:
        out.start_time_unix_nano = span.start_time
    if span.end_time is not None:
        out.end_time_unix_nano = span.end_time
    attributes = span.attributes
    if attributes:
        encoded = out.attributes
        for key, value in attributes.items():
            field = _VALUE_FIELDS.get(type(value))
            if field is not None:
                item = encoded.add()
                try:
                    item.key = key
                    setattr(item.value, field, value)
                    continue
                except Exception:  # e.g. an int beyond 64 bits: the SDK's code logs and skips it
                    del encoded[-1]
            try:
                encoded.append(encode_key_value(key, value))
            except Exception as error:  # the SDK's encoder leaves the attribute out so
                log.exception("Failed to encode key %s: %s", key, error)
    status = span.status
    if status is not None:
        out.status.SetInParent()
        if status.status_code.value:
            out.status.code = status.status_code.value
        if status.description:
            out.status.message = status.description
    if span.dropped_attributes:
        out.dropped_attributes_count = span.dropped_attributes
    if span.dropped_events:
        out.dropped_events_count = span.dropped_events
    if span.dropped_links:
        out.dropped_links_count = span.dropped_links
    out.flags = _HAS_IS_REMOTE | _IS_REMOTE if parent and parent.is_remote else _HAS_IS_REMOTE
