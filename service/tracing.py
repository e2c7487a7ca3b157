"""The service's part of a trace: a server span per call (receive to answer), continuing the
caller's W3C `traceparent` (the sidecar's client span) and reading its `baggage` (model version
and dye). On when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), off otherwise; off, a call pays one global read.

The OpenTelemetry SDK is imported only when tracing is on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import grpc

log = logging.getLogger(__name__)

_tracer: Any = None
_propagator: Any = None
_provider: Any = None


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on from the OTEL_* variables; returns whether it is on."""
    global _tracer, _propagator, _provider
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    name = env.get("OTEL_SERVICE_NAME", "modelyard-service")
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("modelyard.service")
    _propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    log.info("tracing on: OTLP %s to %s", protocol, endpoint)
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
    attributes = {"rpc.system": "grpc", "rpc.method": method, "modelyard.model": model}
    for key in ("model.version", "model.dye"):
        value = baggage.get_baggage(key, parent)
        if value is not None:
            attributes[f"modelyard.baggage.{key}"] = str(value)
    return _tracer.start_span(
        f"modelyard.service/{method}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    )


def end(span: Any, version: str, code: grpc.StatusCode) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    if version:
        span.set_attribute("modelyard.version", version)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()
