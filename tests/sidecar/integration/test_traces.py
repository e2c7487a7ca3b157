"""One trace across client, sidecar and service: spans exported over OTLP/gRPC to a receiver in
this process (a real endpoint, from the opentelemetry-proto service definitions), with the
parent/child links and the routing attributes."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.sidecar.tracing import Tracing, configure
from tests.sidecar_support import infer, known_versions, running_sidecar
from tests.support import eventually

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
GENERATE_TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4737"
UNSAMPLED_TRACE_ID = "6bf92f3577b34da6a3ce929d0e0e4738"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            name = next(
                a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"
            )
            for scope in resource_spans.scope_spans:
                self.spans.extend((name, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm", root / "codelm")
    return root


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    server = grpc.aio.server()
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def attributes(span: Any) -> dict[str, Any]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


async def test_one_trace_from_client_through_sidecar_to_service(
    receiver, repository: Path, service_process, monkeypatch
) -> None:
    collected, endpoint = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{endpoint}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    upstream = service_process(repository)  # inherits the OTEL_* environment
    tracing = configure("modelyard-sidecar")
    assert tracing.enabled
    async with running_sidecar([upstream.address], tracing=tracing) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            # First, a call whose caller left it out: no span of its trace anywhere (the sidecar
            # makes none, and the service follows the unsampled traceparent it is sent).
            unsampled = [("traceparent", f"00-{UNSAMPLED_TRACE_ID}-{CLIENT_SPAN}-00")]
            assert (await infer(channel, user="u", metadata=unsampled)).version
            parent = [("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"), ("x-canary-weight", "100")]
            answer = await infer(channel, user="u", metadata=parent)
            assert (answer.version, answer.dye) == ("2", "canary")
            stub = pb_grpc.InferenceServiceStub(channel)
            request = pb.GenerateRequest(model_name="codelm", prompt="def f(", max_tokens=4)
            traceparent = [("traceparent", f"00-{GENERATE_TRACE_ID}-{CLIENT_SPAN}-01")]
            assert len([e async for e in stub.Generate(request, metadata=traceparent)]) >= 1
        await tracing.flush()

        def ours(trace_id: str = TRACE_ID) -> list[tuple[str, Any]]:
            return [(n, s) for n, s in collected.spans if s.trace_id.hex() == trace_id]

        await eventually(lambda: len(ours()) == 4, "sidecar server + client, service server + step")
        await eventually(lambda: len(ours(GENERATE_TRACE_ID)) == 5, "Generate: + prefill and stream")
        assert ours(UNSAMPLED_TRACE_ID) == []  # each process exports its spans in order
    spans = ours()
    (server,) = [s for n, s in spans if n == "modelyard-sidecar" and s.kind == s.SPAN_KIND_SERVER]
    (client,) = [s for n, s in spans if n == "modelyard-sidecar" and s.kind == s.SPAN_KIND_CLIENT]
    (service,) = [s for n, s in spans if n == "modelyard-service" and s.kind == s.SPAN_KIND_SERVER]
    (step,) = [s for n, s in spans if n == "modelyard-service" and s.kind != s.SPAN_KIND_SERVER]
    assert server.parent_span_id.hex() == CLIENT_SPAN  # continues the caller's trace
    assert client.parent_span_id == server.span_id
    assert service.parent_span_id == client.span_id
    assert step.parent_span_id == service.span_id and step.name in {"run", "batch"}
    assert service.start_time_unix_nano <= step.start_time_unix_nano <= step.end_time_unix_nano
    assert server.name == "modelyard.inference.v1.InferenceService/Infer"
    routed = attributes(server)
    assert routed["modelyard.model"] == "scaler"
    assert routed["modelyard.version"] == "2" and routed["modelyard.dye"] == "canary"
    assert attributes(client)["modelyard.breaker.state"] == "closed"
    served = attributes(service)
    assert served["modelyard.version"] == "2"
    assert served["modelyard.baggage.model.dye"] == "canary"  # baggage travelled with the call
    assert served["modelyard.baggage.model.version"] == "2"

    generation = {(s.name, s.kind): s for _, s in ours(GENERATE_TRACE_ID)}
    client_span = generation["modelyard.inference.v1.InferenceService/Generate", client.SPAN_KIND_CLIENT]
    service_span = generation["modelyard.service/Generate", client.SPAN_KIND_SERVER]
    prefill, stream = (
        generation["prefill", client.SPAN_KIND_INTERNAL],
        generation["stream", client.SPAN_KIND_INTERNAL],
    )
    assert service_span.parent_span_id == client_span.span_id
    assert prefill.parent_span_id == stream.parent_span_id == service_span.span_id
    assert prefill.end_time_unix_nano <= stream.start_time_unix_nano <= stream.end_time_unix_nano


class RecordingUpstream(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """KServe's ModelInfer alone, answering the request's bytes and keeping each call's metadata."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method != "/inference.GRPCInferenceService/ModelInfer":
            return None

        async def infer(request: bytes, context: Any) -> bytes:
            self.seen.append(dict(context.invocation_metadata() or ()))
            return request

        return grpc.unary_unary_rpc_method_handler(infer)


async def test_an_unsampled_root_call_sends_its_traceparent_upstream() -> None:
    """A call that brought no trace context and that the sampler left out (most calls, with a
    ratio sampler): its attempt carries its traceparent, unsampled, and no baggage (the proxy
    writes it itself on this path, as Tracing.attempt would); an untraced sidecar sends none."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from modelyard.kserve.v2 import grpc_service_pb2 as kserve

    recorder = RecordingUpstream()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((recorder,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    request = kserve.ModelInferRequest(model_name="m").SerializeToString()
    try:
        for tracing in (Tracing(TracerProvider(sampler=ParentBased(ALWAYS_OFF))), Tracing()):
            async with (
                running_sidecar([f"127.0.0.1:{port}"], tracing=tracing) as sidecar,
                grpc.aio.insecure_channel(sidecar.address) as channel,
            ):
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", None, None)
                assert await infer(request, metadata=(("x-user-id", "u"),), timeout=10) == request
    finally:
        await server.stop(0)
    traced, untraced = recorder.seen
    version, trace_id, span_id, flags = traced["traceparent"].split("-")
    assert (version, len(trace_id), len(span_id)) == ("00", 32, 16)
    assert not int(flags, 16) & 1  # not sampled
    assert int(trace_id, 16) and "baggage" not in traced and traced["x-user-id"] == "u"
    assert "traceparent" not in untraced and untraced["x-user-id"] == "u"
