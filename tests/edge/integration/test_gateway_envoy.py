"""End to end through a real Envoy (config rendered by envoy/python/render.py, ephemeral ports, own
--base-id): gRPC-Web to the sidecar cluster, SSE to the gateway, CORS, operator canary weights.

The gateway and Envoy's sidecar cluster call a real sidecar in front of the service where the sidecar
package is installed, and the service itself otherwise (the sidecar forwards the same API unchanged).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.envoy_support import (
    EnvoyProcess,
    grpc_web_frame,
    grpc_web_parse,
    grpc_web_text_decode,
    start_envoy,
)
from tests.sidecar_support import start_sidecar_process
from tests.sse_client import events_only, read_events, token_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

CODELM = demo_models.COMMITTED_ROOT / "codelm"
# A paused stream keeps its slot here (no preemption): a reader that stops holds the one slot.
ONE_SLOT = (
    "generation:\n  max_concurrent_sequences: 1\n  max_tokens: 256\n  stream_buffer: 2\n  max_preempted: 0\n"
)
GENERATE = "/modelyard.inference.v1.InferenceService/Generate"
LIST_MODELS = "/modelyard.inference.v1.ModelService/ListModels"
ORIGIN = "http://localhost:8080"


@pytest.fixture(scope="module")
def e2e_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e") / "models"
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    shutil.copytree(CODELM / "1", root / "slot" / "1")
    (root / "slot" / "config.yaml").write_text(ONE_SLOT)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(e2e_repository: Path) -> AsyncIterator[Service]:
    running = build_service(Settings(repository=e2e_repository, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def upstream(service: Service) -> Iterator[str]:
    """The sidecar in front of the service, as the stack runs it."""
    sidecar = start_sidecar_process("--upstream", service.address, "--admin-listen", "")
    try:
        yield sidecar.address
    finally:
        sidecar.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(upstream: str) -> AsyncIterator[Gateway]:
    settings = GatewaySettings(
        listen="127.0.0.1:0", upstream=upstream, heartbeat_s=1.0, first_event_wait_s=0.3
    )
    running = Gateway(settings)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture(scope="module")
def envoy(
    gateway: Gateway, upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvoyProcess]:
    process = start_envoy(
        tmp_path_factory.mktemp("envoy"), gateway.address, upstream, model_canary_weights={"codelm": 25}
    )
    try:
        yield process
    finally:
        process.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def http(envoy: EnvoyProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=envoy.url, timeout=60) as client:
        yield client


async def direct_tokens(service: Service, request: pb.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        return [t async for r in stub.Generate(request) for t in r.token_ids]


# --- gRPC-Web ------------------------------------------------------------------------------------


async def test_grpc_web_unary_binary(http) -> None:
    response = await http.post(
        LIST_MODELS,
        content=grpc_web_frame(model_pb.ListModelsRequest().SerializeToString()),
        headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1", "origin": ORIGIN},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/grpc-web")
    assert response.headers["access-control-allow-origin"] == ORIGIN
    messages, trailers = grpc_web_parse(response.content)
    assert trailers["grpc-status"] == "0"
    listed = model_pb.ListModelsResponse.FromString(messages[0])
    assert sorted(m.name for m in listed.models) == ["codelm", "slot"]


@pytest.mark.parametrize("text", [False, True], ids=["binary", "text"])
async def test_grpc_web_server_streaming_arrives_message_by_message(http, service, text) -> None:
    request = pb.GenerateRequest(model_name="codelm", prompt="def main():", max_tokens=24)
    frame = grpc_web_frame(request.SerializeToString())
    kind = "application/grpc-web-text" if text else "application/grpc-web+proto"
    messages: list[bytes] = []
    trailers: dict[str, str] = {}
    async with http.stream(
        "POST",
        GENERATE,
        content=base64.b64encode(frame) if text else frame,
        headers={"content-type": kind, "accept": kind, "x-grpc-web": "1"},
    ) as response:
        assert response.status_code == 200
        body = b""
        async for chunk in response.aiter_bytes():
            body += chunk
        raw = grpc_web_text_decode(body.decode()) if text else body
        messages, trailers = grpc_web_parse(raw)
    assert trailers["grpc-status"] == "0"
    responses = [pb.GenerateResponse.FromString(m) for m in messages]
    assert len(responses) > 1
    assert [r.sequence_number for r in responses] == list(range(len(responses)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for r in responses for t in r.token_ids] == await direct_tokens(service, request)


async def test_native_grpc_through_envoy(envoy, service) -> None:
    """h2c from a gRPC client: Envoy's listener speaks HTTP/2 too and routes application/grpc."""
    request = pb.GenerateRequest(model_name="codelm", prompt="for i in", max_tokens=12)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{envoy.port}") as channel:
        via_envoy = [
            t async for r in pb_grpc.InferenceServiceStub(channel).Generate(request) for t in r.token_ids
        ]
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await pb_grpc.InferenceServiceStub(channel).Infer(pb.InferRequest(model_name="nosuch"))
    assert via_envoy == await direct_tokens(service, request)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_grpc_web_error_comes_with_its_status(http) -> None:
    request = pb.GenerateRequest(model_name="nosuch", prompt="x")
    response = await http.post(
        GENERATE,
        content=grpc_web_frame(request.SerializeToString()),
        headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"},
    )
    status = response.headers.get("grpc-status") or grpc_web_parse(response.content)[1].get("grpc-status")
    assert status == str(grpc.StatusCode.NOT_FOUND.value[0])


async def test_cors_preflight_for_grpc_web_and_sse(http) -> None:
    preflight = await http.options(
        LIST_MODELS,
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-grpc-web,x-user-agent",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "x-grpc-web" in preflight.headers["access-control-allow-headers"]
    stranger = await http.options(
        LIST_MODELS, headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in stranger.headers
    sse = await http.get(
        "/v1/models/codelm/generate", params={"prompt": "x", "max_tokens": "2"}, headers={"origin": ORIGIN}
    )
    exposed = sse.headers["access-control-expose-headers"]
    assert "x-served-version" in exposed and "x-model-dye" in exposed


async def test_cors_preflight_allows_what_the_edge_forwards_and_the_openai_js_client_sends(http) -> None:
    # The headers openai-node sends from a browser, and x-priority (forwarded by the gateway).
    asked = (
        "authorization,content-type,accept,x-priority,x-stainless-arch,x-stainless-lang,x-stainless-os,"
        "x-stainless-package-version,x-stainless-runtime,x-stainless-runtime-version,"
        "x-stainless-retry-count,x-stainless-timeout"
    )
    preflight = await http.options(
        "/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": asked,
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = set(preflight.headers["access-control-allow-headers"].split(","))
    assert set(asked.split(",")) <= allowed


async def test_the_public_edge_serves_neither_the_gateways_metrics_nor_its_health(http) -> None:
    for path in ("/metrics", "/healthz", "/metrics/x"):
        answer = await http.get(path)
        assert answer.status_code == 404, path
        assert answer.headers["x-error-reason"] == "unsupported" and "error" in answer.json()
    assert (await http.get("/metricsx")).status_code == 404  # the gateway's own 404: forwarded
    assert (await http.get("/v2/health/live")).status_code == 200  # the APIs still are


async def test_triton_generate_stream_through_envoy(http) -> None:
    body = {"text_input": "def f(", "parameters": {"max_tokens": 4, "temperature": 0}}
    async with http.stream("POST", "/v2/models/codelm/generate_stream", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        pieces = [e async for e in read_events(response)]
    assert pieces and all("text_output" in (e.data if isinstance(e.data, dict) else {}) for e in pieces)


# --- SSE through Envoy --------------------------------------------------------------------------


async def test_sse_through_envoy_matches_the_gateway_directly(http, gateway) -> None:
    body = {"prompt": "import sys\n", "max_tokens": 30, "temperature": 0}
    async with http.stream("POST", "/v1/models/codelm/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        via_envoy = events_only([e async for e in read_events(response)])
    async with httpx.AsyncClient(base_url=gateway.url) as direct:
        response = await direct.post("/v1/models/codelm/generate", json=body)
        direct_events = events_only([e async for e in read_events(response)])
    assert token_ids(via_envoy) == token_ids(direct_events) and via_envoy[-1].event == "done"


async def test_a_long_sse_stream_through_envoy_is_neither_buffered_nor_cut(http, service) -> None:
    """Longer than Envoy's default 15 s route timeout (the rendered route has 0s): the one slot of
    model `slot` is held by a direct gRPC reader that does not read, so the SSE request waits in the
    queue; the gateway opens the stream and heartbeats, each heartbeat reaching the client as it is
    sent, until the slot frees after 20 s and the tokens follow."""
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(service.address, options=options) as channel:
        holder = pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(model_name="slot", prompt="x", max_tokens=256)
        )
        await holder.read()  # holds the slot; its sequence pauses once gRPC's window is full
        started = time.monotonic()
        heartbeats: list[float] = []
        released = False
        async with http.stream(
            "GET", "/v1/models/slot/generate", params={"prompt": "y", "max_tokens": "8"}
        ) as r:
            assert r.status_code == 200
            seen = []
            async for event in read_events(r):
                seen.append(event)
                if event.event == "comment" and event.data == "keep-alive":
                    heartbeats.append(time.monotonic() - started)
                    if heartbeats[-1] > 20.5 and not released:
                        holder.cancel()
                        released = True
        duration = time.monotonic() - started
    events = events_only(seen)
    assert released and duration > 20.5
    assert {e.event for e in events[:-1]} == {"token"} and events[-1].event == "done"
    assert len(token_ids(events)) == 8
    # Unbuffered: heartbeats arrive about a second apart from the start, not in a burst at the end.
    assert heartbeats[0] < 5 and len(heartbeats) >= 15
    assert all(b - a < 5 for a, b in itertools.pairwise(heartbeats))


async def test_openai_client_through_envoy(envoy) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="codelm", messages=[{"role": "user", "content": "sort a list"}], max_tokens=6, stream=True
        )
        chunks = [c async for c in stream]
        whole = await client.completions.create(model="codelm", prompt="import", max_tokens=5, temperature=0)
    assert whole.usage is not None and whole.usage.completion_tokens == 5 and whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 1


# --- the operator's canary weight reaches the sidecar -------------------------------------------


@pytest.mark.parametrize("client_weights", [False, True])
async def test_rendered_canary_weight_reaches_the_sidecar(tmp_path, client_weights: bool) -> None:
    """A recording gRPC server stands where the sidecar listens: what arrives is what Envoy (for
    gRPC-Web) and the gateway behind Envoy (for SSE) sent. The weight is rendered for codelm only.
    The header policy: a client's x-canary-weight and x-model-dye are removed at the edge, and the
    operator's weight set; with client_canary_weights, a client's weight passes where no operator
    weight is rendered (x-model-dye is removed either way)."""
    seen: list[tuple[str, dict[str, str]]] = []

    def metadata(context: grpc.aio.ServicerContext[bytes, bytes]) -> dict[str, str]:
        return {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}

    async def list_models(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        seen.append(("grpc-web", metadata(context)))
        return model_pb.ListModelsResponse().SerializeToString()

    async def generate(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        seen.append(("sse", metadata(context)))
        done = pb.GenerateResponse(
            model_version="1", text="x", token_ids=[1], finish_reason=pb.FINISH_REASON_LENGTH
        )
        yield done.SerializeToString()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "modelyard.inference.v1.ModelService",
                {"ListModels": grpc.unary_unary_rpc_method_handler(list_models)},
            ),
            grpc.method_handlers_generic_handler(
                "modelyard.inference.v1.InferenceService",
                {"Generate": grpc.unary_stream_rpc_method_handler(generate)},
            ),
        ]
    )
    recorder = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=recorder))
    await gateway.start()
    envoy = await asyncio.to_thread(
        start_envoy,
        tmp_path,
        gateway.address,
        recorder,
        model_canary_weights={"codelm": 25},
        client_canary_weights=client_weights,
    )
    try:
        async with httpx.AsyncClient(base_url=envoy.url) as client:
            for name in ("codelm", "other"):
                response = await client.post(
                    LIST_MODELS,
                    content=grpc_web_frame(b""),
                    headers={
                        "content-type": "application/grpc-web+proto",
                        "x-grpc-web": "1",
                        "x-model-name": name,
                        "x-canary-weight": "99",
                        "x-model-dye": "canary",
                    },
                )
                assert grpc_web_parse(response.content)[1]["grpc-status"] == "0"
                sse = await client.post(
                    f"/v1/models/{name}/generate", json={"prompt": "x"}, headers={"x-canary-weight": "99"}
                )
                assert events_only([e async for e in read_events(sse)])[-1].event == "done"
    finally:
        envoy.stop()
        await gateway.stop()
        await server.stop(None)
    weights = [(kind, m.get("x-canary-weight")) for kind, m in seen]
    # The operator's weight replaces the client's for codelm; for other models the client's is
    # dropped, unless the render lets clients' weights through.
    other = "99" if client_weights else None
    assert weights == [("grpc-web", "25"), ("sse", "25"), ("grpc-web", other), ("sse", other)]
    assert [m.get("x-model-dye") for kind, m in seen if kind == "grpc-web"] == [None, None]
