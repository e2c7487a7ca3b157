"""What the sidecar tells an operator per version, through a real sidecar in front of a real
service (this process) serving scaler v1 (stable, x2) and v2 (the canary, with a bug on inputs of
16 and over): requests, latency and attempts by model, version and dye; a canary fault that
stable answered counts against the canary; made-up pins and tenants never become series; spans
carry the tenant, a client's mistake is no server-span ERROR, and shadow comparisons are spans
naming both versions. Spans are read with the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings as ServiceSettings
from modelyard.sidecar.server import Sidecar
from modelyard.sidecar.tracing import Tracing
from modelyard.tensors import to_tensor
from tests.sidecar.integration.test_breakers import fails_on_large_values
from tests.sidecar_support import admin_async, infer, known_versions, running_sidecar
from tests.support import eventually, metric

SCALER = {"max_batch_size": 64, "version_policy": {"latest": 2}}
CANARY = ("x-canary-weight", "100")


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), SCALER)
    demo_models.write_model(root, "scaler", 2, fails_on_large_values(), SCALER)
    running = build_service(ServiceSettings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


ROUTES = {
    "models": {"scaler": {"canary_weight": 0}},
    "tenants": {"acme": {"rate": 1000, "burst": 1000}},
    # A breaker that stays closed here: every canary call is tried (and fails) first.
    "breaker": {
        "window_s": 600,
        "min_calls": 1000,
        "error_rate": 0.99,
        "canary_error_rate": 0.99,
        "consecutive_faults": 1000,
    },
}


def write_routes(path: Path, doc: dict[str, object]) -> None:
    path.with_suffix(".tmp").write_text(yaml.safe_dump(doc))
    path.with_suffix(".tmp").replace(path)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "routes.yaml"
    write_routes(path, ROUTES)
    return path


@pytest.fixture
async def sidecar(service: Service, config: Path, spans: InMemorySpanExporter) -> AsyncIterator[Sidecar]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    async with running_sidecar([service.address], config=config, tracing=Tracing(provider)) as running:
        await known_versions(running, "scaler", {"1", "2"})
        yield running


async def scrape(sidecar: Sidecar) -> str:
    return str(await admin_async(sidecar, "/metrics"))


def server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


async def test_a_canary_fault_answered_by_stable_counts_against_the_canary(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        fallbacks = []
        for _ in range(5):
            answer = await infer(channel, value=100.0, metadata=[CANARY])
            assert (answer.version, answer.dye) == ("1", "stable")  # the client never saw the fault
            fallbacks.append(answer.fallback)
        healthy = await infer(channel, value=1.0, metadata=[CANARY])
        assert (healthy.version, healthy.dye) == ("2", "canary")
    faults = fallbacks.count("canary-fault")
    assert faults >= 1
    latency = {"method": "Infer", "model": "scaler", "version": "1", "dye": "stable"}
    # A client may have its answer a moment before the sidecar has closed the call's scope.
    registry = sidecar.metrics.registry
    canary = {"model": "scaler", "version": "2", "dye": "canary"}
    await eventually(
        lambda: (
            metric(registry, "modelyard_sidecar_request_seconds_count", **latency) == 5
            and metric(registry, "modelyard_sidecar_attempts_total", **canary, code="OK", fault="false") == 1
        ),
        "every call recorded",
    )
    text = await scrape(sidecar)
    assert metric(text, "modelyard_sidecar_attempts_total", **canary, code="INTERNAL", fault="true") == faults
    assert metric(text, "modelyard_sidecar_attempts_total", **canary, code="OK", fault="false") == 1
    answered = {"method": "Infer", "model": "scaler", "code": "OK"}  # what the client got
    assert (
        metric(
            text,
            "modelyard_sidecar_requests_total",
            **answered,
            version="1",
            dye="stable",
            fallback="canary-fault",
        )
        == faults
    )
    assert (
        metric(text, "modelyard_sidecar_requests_total", **answered, version="2", dye="canary", fallback="")
        == 1
    )
    assert metric(text, "modelyard_sidecar_request_seconds_count", **latency) == 5


async def test_made_up_pins_and_tenants_never_become_series(sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:

        async def made_up(index: int) -> None:
            tenant = ("x-tenant-id", f"tenant-{index}")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(channel, version=str(900 + index), metadata=[tenant])
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND

        await made_up(0)
        before = [line for line in (await scrape(sidecar)).splitlines() if not line.startswith("#")]
        for index in range(1, 60):
            await made_up(index)
        pinned = {"method": "Infer", "model": "scaler", "version": "_other", "code": "NOT_FOUND"}
        registry = sidecar.metrics.registry
        await eventually(
            lambda: (
                metric(registry, "modelyard_sidecar_requests_total", **pinned, dye="pinned", fallback="")
                == 60
            ),
            "every call recorded",
        )
        after = [line for line in (await scrape(sidecar)).splitlines() if not line.startswith("#")]
    assert len(after) == len(before)
    text = "\n".join(after)
    assert "tenant-" not in text and 'version="93' not in text
    assert metric(text, "modelyard_sidecar_requests_total", **pinned, dye="pinned", fallback="") == 60


async def test_spans_carry_the_tenant_and_only_server_faults_are_errors(
    sidecar: Sidecar, spans: InMemorySpanExporter
) -> None:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        await infer(channel, value=100.0, metadata=[CANARY, ("x-tenant-id", "acme")])
        await eventually(lambda: bool(server_spans(spans)), "the call's span ended")
        (span,) = server_spans(spans)
        attributes = dict(span.attributes or {})
        assert attributes["modelyard.tenant"] == "acme"
        assert (attributes["modelyard.version"], attributes["modelyard.fallback"]) == ("1", "canary-fault")
        assert span.status.status_code is StatusCode.UNSET  # stable answered the client
        failed = [s for s in spans.get_finished_spans() if s.kind is SpanKind.CLIENT]
        assert [s.status.status_code for s in failed] == [StatusCode.ERROR, StatusCode.UNSET]

        spans.clear()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await infer(channel, "nosuch")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        await eventually(lambda: bool(server_spans(spans)), "the call's span ended")
        (span,) = server_spans(spans)
        assert span.status.status_code is StatusCode.UNSET  # the client's mistake
        assert dict(span.attributes or {})["modelyard.error_reason"] == "model_not_found"


async def test_a_shadow_comparison_is_a_span_naming_both_versions(
    sidecar: Sidecar, config: Path, spans: InMemorySpanExporter
) -> None:
    write_routes(config, {**ROUTES, "shadow": {"share": 100, "max_in_flight": 4}})
    await eventually(lambda: sidecar.routes.table.shadow.share == 100, "the shadow policy")
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        answer = await infer(channel, value=1.0)
        assert (answer.version, answer.dye) == ("1", "stable")

    def shadow_spans() -> list[ReadableSpan]:
        return [s for s in spans.get_finished_spans() if s.name == "modelyard.sidecar/shadow"]

    await eventually(lambda: bool(shadow_spans() and server_spans(spans)), "the shadow comparison")
    (shadow,) = shadow_spans()
    (call,) = server_spans(spans)
    assert shadow.context is not None and call.context is not None
    assert shadow.context.trace_id == call.context.trace_id  # in the mirrored call's trace
    attributes = dict(shadow.attributes or {})
    assert attributes["modelyard.shadow.stable_version"] == "1"
    assert attributes["modelyard.shadow.canary_version"] == "2"
    (event,) = shadow.events
    assert event.name == "compared"
    found = dict(event.attributes or {})
    assert found["rows"] == 1
    assert found["rows_agreeing"] in (0, 1)


async def test_a_stream_whose_canary_fails_before_its_first_message_counts_once_each(
    sidecar: Sidecar,
) -> None:
    """The canary's stream ends with its error before any message: stable answers it, the
    canary's attempt is a fault, and the call the client got is stable's OK."""
    x = np.full((2, 16), 100.0, np.float32)
    request = pb.InferStreamRequest(model_name="scaler", inputs=[to_tensor("INPUT0", x)], chunk_size=1)
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        call = stub.InferStream(request, metadata=[CANARY], timeout=30)
        chunks = [chunk async for chunk in call]
        assert [c.model_version for c in chunks] == ["1", "1"]
        assert dict(await call.initial_metadata()).get("x-dye-fallback") == "canary-fault"
    registry = sidecar.metrics.registry
    answered = {"method": "InferStream", "model": "scaler", "version": "1", "dye": "stable"}
    await eventually(
        lambda: metric(registry, "modelyard_sidecar_request_seconds_count", **answered) == 1,
        "the call recorded",
    )
    canary = {"model": "scaler", "version": "2", "dye": "canary", "code": "INTERNAL", "fault": "true"}
    assert metric(registry, "modelyard_sidecar_attempts_total", **canary) == 1
    ok = {**answered, "code": "OK", "fallback": "canary-fault"}
    assert metric(registry, "modelyard_sidecar_requests_total", **ok) == 1
    stable = {"model": "scaler", "version": "1", "dye": "stable", "code": "OK", "fault": "false"}
    assert metric(registry, "modelyard_sidecar_attempts_total", **stable) == 1
