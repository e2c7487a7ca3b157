"""What the service tells an operator per version: a failed run is counted and traced with the
version that ran it; spans carry the tenant, Generate's time to first token and token counts; a
client's mistake is no span ERROR (a server fault is); made-up model names never become series.
Spans are read with the OpenTelemetry SDK's in-memory exporter from a real service in this
process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import generate_latest

from models import demo_models, value_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service import tracing
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.support import eventually, metric


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = (tracing._tracer, tracing._propagator, tracing._provider)
    assert tracing.configure(provider=provider)
    try:
        yield exporter
    finally:
        tracing._tracer, tracing._propagator, tracing._provider = saved


@pytest.fixture
async def service(tmp_path: Path, spans: InMemorySpanExporter) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    demo_models.write_model(root, "reshaped", 1, value_models.reshaped(), {})
    batching = {"max_batch_size": 8, "dynamic_batching": {}}
    demo_models.write_model(root, "batched", 1, demo_models.scaled_identity(4, 2.0), batching)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    running = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def server_spans(exporter: InMemorySpanExporter, method: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == f"modelyard.service/{method}"]


def reshape(shape: list[int]) -> pb.InferRequest:
    return pb.InferRequest(
        model_name="reshaped",
        inputs=[to_tensor("X", np.ones(4, np.float32)), to_tensor("SHAPE", np.array(shape, np.int64))],
    )


async def test_a_failed_run_counts_and_traces_with_its_version_and_is_no_server_error(
    service: Service, stub: Any, spans: InMemorySpanExporter
) -> None:
    await eventually(lambda: "reshaped" in service.metrics.known_models, "the model labelled")
    tenant = (("x-tenant-id", "acme"),)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Infer(reshape([3, 4]), metadata=tenant, timeout=10)  # 35 elements from 4
    # Refused inside the graph after the declared checks passed: model_rejected (issue 34).
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    registry = service.metrics.registry
    labels = {"method": "Infer", "model": "reshaped", "code": "FAILED_PRECONDITION"}
    # The client may have its answer a moment before the server's handler has recorded it.
    await eventually(lambda: bool(server_spans(spans, "Infer")), "the call recorded")
    assert metric(registry, "modelyard_requests_total", **labels, version="1") == 1
    assert metric(registry, "modelyard_requests_total", **labels, version="") is None
    (span,) = server_spans(spans, "Infer")
    attributes = dict(span.attributes or {})
    assert attributes["modelyard.version"] == "1"
    assert attributes["modelyard.tenant"] == "acme"
    assert attributes["modelyard.error_reason"] == "model_rejected"
    assert span.status.status_code is StatusCode.UNSET  # not a server fault by itself

    spans.clear()
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.Infer(pb.InferRequest(model_name="nosuch"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    await eventually(lambda: bool(server_spans(spans, "Infer")), "the call recorded")
    (span,) = server_spans(spans, "Infer")
    assert span.status.status_code is StatusCode.UNSET
    assert "modelyard.version" not in (span.attributes or {})  # no version was resolved


async def test_a_batched_call_traces_its_batch_as_a_step(
    service: Service, stub: Any, spans: InMemorySpanExporter
) -> None:
    """With tracing on, a batched request's wait and run in its batcher are a child span of its
    call (the data plane hands an untraced one to the batcher directly, with no step)."""
    x = np.ones((1, 4), np.float32)
    request = pb.InferRequest(model_name="batched", inputs=[to_tensor("INPUT0", x)])
    answer = await stub.Infer(request, timeout=10)
    assert answer.model_version == "1"
    await eventually(lambda: bool(server_spans(spans, "Infer")), "the call recorded")
    (call,) = server_spans(spans, "Infer")
    children = [
        s.name
        for s in spans.get_finished_spans()
        if s.parent is not None and s.parent.span_id == call.context.span_id
    ]
    assert children == ["batch"]


def test_a_server_fault_is_a_span_error_and_a_client_mistake_is_not() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    cases = [
        (grpc.StatusCode.INTERNAL, "model_failed", StatusCode.ERROR),
        (grpc.StatusCode.INTERNAL, "", StatusCode.ERROR),
        (grpc.StatusCode.UNKNOWN, "", StatusCode.ERROR),
        (grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", StatusCode.UNSET),
        (grpc.StatusCode.NOT_FOUND, "model_not_found", StatusCode.UNSET),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", StatusCode.UNSET),
        (grpc.StatusCode.UNAVAILABLE, "draining", StatusCode.UNSET),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", StatusCode.UNSET),
        (grpc.StatusCode.OK, "", StatusCode.UNSET),
    ]
    for code, reason, _ in cases:
        tracing.end(tracer.start_span(code.name), "1", code, reason)
    got = [(s.name, s.status.status_code) for s in exporter.get_finished_spans()]
    assert got == [(code.name, want) for code, _, want in cases]


async def test_a_generate_span_carries_its_time_to_first_token_and_token_counts(
    service: Service, stub: Any, spans: InMemorySpanExporter
) -> None:
    request = pb.GenerateRequest(model_name="codelm", prompt="def f(", max_tokens=5, temperature=0)
    events = [event async for event in stub.Generate(request, metadata=(("x-tenant-id", "acme"),))]
    generated = sum(len(e.token_ids) for e in events)
    assert generated == 5
    await eventually(lambda: bool(server_spans(spans, "Generate")), "the call recorded")
    (span,) = server_spans(spans, "Generate")
    attributes = dict(span.attributes or {})
    assert attributes["modelyard.version"] == "1"
    assert attributes["modelyard.tenant"] == "acme"
    assert attributes["gen_ai.usage.output_tokens"] == generated
    assert isinstance(attributes["gen_ai.usage.input_tokens"], int)
    assert attributes["gen_ai.usage.input_tokens"] > 0
    ttft = attributes["modelyard.generation.time_to_first_token_s"]
    assert isinstance(ttft, float)
    assert span.end_time is not None and span.start_time is not None
    assert 0 < ttft * 1e9 <= span.end_time - span.start_time
    assert span.status.status_code is StatusCode.UNSET


async def test_made_up_model_names_never_become_series(service: Service, stub: Any) -> None:
    await eventually(lambda: "scaler" in service.metrics.known_models, "the model labelled")

    def series() -> int:
        return sum(
            1
            for line in generate_latest(service.metrics.registry).decode().splitlines()
            if line.startswith("modelyard_requests_total")
        )

    for index in range(2):
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Infer(pb.InferRequest(model_name=f"madeup-{index}"), timeout=10)
    before = series()
    for index in range(2, 60):
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Infer(pb.InferRequest(model_name=f"madeup-{index}", model_version="7"), timeout=10)
    labels = {"method": "Infer", "model": "_unknown", "version": "", "code": "NOT_FOUND"}
    registry = service.metrics.registry
    await eventually(lambda: metric(registry, "modelyard_requests_total", **labels) == 60, "all counted")
    assert series() == before  # every made-up name is `_unknown`, with no version
    assert "madeup" not in generate_latest(registry).decode()
