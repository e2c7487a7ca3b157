"""OTLP tracing set-up for the processes that trace (service, sidecar): the standard OTEL_*
variables decide. The OpenTelemetry SDK (in those processes' extras, not the base install) is
imported only when tracing is on."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
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
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", default_name)})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: OTLP %s to %s", protocol, endpoint)
    return provider
