"""SSE generation through the gateway, against the real service on loopback (the sidecar forwards
the same API unchanged, so the gateway's upstream here is the service itself).

One service and one gateway for the module; each test uses its own copy of the demo model so the
per-model service metrics it reads are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sse_client import SseEvent, events_only, read_events, token_ids
from tests.support import start_service_process

pytestmark = pytest.mark.asyncio(loop_scope="module")

CODELM = demo_models.COMMITTED_ROOT / "codelm"
# One slot and a 2-token stream buffer: a reader that stops pauses the sequence quickly.
SMALL = "generation:\n  max_concurrent_sequences: 4\n  max_tokens: 256\n  stream_buffer: 2\n"
MODELS = ("codelm", "resumed", "dropped", "kept", "tight", "drained")
# One decode slot and one queue place: a third request is shed (RESOURCE_EXHAUSTED). A paused
# stream keeps its slot (no preemption), so a stream nobody reads holds it.
TIGHT = (
    "generation:\n  max_concurrent_sequences: 1\n  max_waiting: 1\n  max_tokens: 256\n  stream_buffer: 2\n"
    "  max_preempted: 0\n"
)


@pytest.fixture(scope="module")
def sse_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gateway") / "models"
    for name in MODELS:
        shutil.copytree(CODELM / "1", root / name / "1")
        config = {"codelm": (CODELM / "config.yaml").read_text(), "tight": TIGHT}.get(name, SMALL)
        (root / name / "config.yaml").write_text(config)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sse_service(sse_repository: Path) -> AsyncIterator[Service]:
    running = build_service(Settings(repository=sse_repository, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


async def start_gateway(upstream: str, **settings: object) -> Gateway:
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=upstream, **settings))  # type: ignore[arg-type]
    await gateway.start()
    return gateway


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(sse_service: Service) -> AsyncIterator[Gateway]:
    running = await start_gateway(sse_service.address, heartbeat_s=0.2, resume_window_s=60.0)
    try:
        yield running
    finally:
        await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        yield http


def sample(service: Service, name: str, model: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, {"model": model, "version": "1", **labels})
    return value or 0.0


async def eventually(check: Callable[[], bool], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def collect(response: httpx.Response) -> list[SseEvent]:
    return [e async for e in read_events(response)]


# --- the event stream ----------------------------------------------------------------------------


async def test_post_streams_numbered_tokens_then_done_with_usage(client, sse_service) -> None:
    body = {"prompt": "def __init__(self", "max_tokens": 200, "temperature": 0}
    async with client.stream("POST", "/v1/models/codelm/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["x-served-version"] == "1"
        stream_id = response.headers["x-stream-id"]
        seen: list[SseEvent] = []
        async for event in read_events(response):
            seen.append(event)
            if event.event == "token" and len(events_only(seen)) == 1:
                # Incremental: the first token is here while the sequence is still generating.
                assert sample(sse_service, "modelyard_generation_active_sequences", "codelm") == 1
    assert seen[0].event == "retry" and seen[0].data == 3000
    events = events_only(seen)
    assert [e.id for e in events] == [f"{stream_id}:{i}" for i in range(len(events))]
    *tokens, done = events
    assert {e.event for e in tokens} == {"token"} and done.event == "done"
    assert [e.data["index"] for e in tokens] == list(range(len(tokens)))
    assert all(e.data["model_version"] == "1" for e in tokens)
    assert done.data["finish_reason"] == "length"
    assert done.data["usage"]["completion_tokens"] == 200 == len(token_ids(tokens))
    assert done.data["usage"]["prompt_tokens"] > 0 and done.data["time_to_first_token_ms"] > 0
    assert tokens[0].at < done.at


async def test_get_for_event_source_takes_query_parameters(client) -> None:
    params = {"prompt": "import os\n", "max_tokens": "5", "temperature": "0", "stop": "zzz"}
    async with client.stream("GET", "/v1/models/codelm/generate", params=params) as response:
        assert response.status_code == 200
        events = events_only(await collect(response))
    assert {e.event for e in events[:-1]} == {"token"} and events[-1].event == "done"
    assert len(token_ids(events)) == 5  # several tokens may share an event when they piled up
    post = await client.post("/v1/models/codelm/generate", json={"prompt": "import os\n", "max_tokens": 5})
    assert token_ids(events_only([e async for e in read_events(post)])) == token_ids(events)


# --- resume --------------------------------------------------------------------------------------


async def test_resume_after_disconnect_yields_exactly_the_remaining_tokens(client, gateway) -> None:
    body = {"prompt": "class Parser:\n", "max_tokens": 60, "temperature": 0.9, "top_k": 40, "seed": 11}
    reference = events_only(await collect(await client.post("/v1/models/resumed/generate", json=body)))
    want = token_ids(reference)
    assert len(want) == 60

    first: list[SseEvent] = []
    async with client.stream("POST", "/v1/models/resumed/generate", json=body) as response:
        async for event in read_events(response):
            if event.event == "token":
                first.append(event)
            if len(first) == 5:
                break  # the client goes away mid-stream
    resumes = gateway.metrics.registry.get_sample_value(
        "modelyard_gateway_resumes_total", {"outcome": "resumed"}
    )
    # EventSource's reconnect: the same GET/POST with Last-Event-ID; the prompt is not needed.
    async with client.stream(
        "GET", "/v1/models/resumed/generate", headers={"Last-Event-ID": first[-1].id}
    ) as response:
        assert response.status_code == 200
        rest = events_only(await collect(response))
    assert rest[0].id.split(":")[1] == "5"
    assert token_ids(first) + token_ids(rest) == want
    assert rest[-1].event == "done" and rest[-1].data["usage"]["completion_tokens"] == 60
    after = gateway.metrics.registry.get_sample_value(
        "modelyard_gateway_resumes_total", {"outcome": "resumed"}
    )
    assert after == (resumes or 0) + 1

    # Reconnecting after done (as EventSource does ~3 s after the end) starts nothing: 204.
    again = await client.get("/v1/models/resumed/generate", headers={"Last-Event-ID": rest[-1].id})
    assert again.status_code == 204


async def test_resume_of_an_unknown_or_malformed_stream_is_a_clear_error(client) -> None:
    unknown = await client.get("/v1/models/codelm/generate", headers={"Last-Event-ID": "nosuchstream:3"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["reason"] == "stream_not_found"
    assert "unknown or expired" in unknown.json()["error"]["message"]
    malformed = await client.post("/v1/models/codelm/generate", headers={"Last-Event-ID": "seven"})
    assert malformed.status_code == 400


async def test_an_expired_stream_is_cancelled_upstream_and_cannot_be_resumed(sse_service) -> None:
    """Kept for resume: the stream keeps generating into its small buffer, pauses when it is full,
    and is cancelled upstream when nobody resumes within the window."""
    gateway = await start_gateway(
        sse_service.address, resume_window_s=0.5, resume_buffer_events=4, upstream_lookahead_bytes=1
    )
    try:
        before = sample(sse_service, "modelyard_generation_cancellations_total", "kept", cause="cancelled")
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
            http.stream(
                "POST", "/v1/models/kept/generate", json={"prompt": "x", "max_tokens": 256}
            ) as response,
        ):
            first = await anext(e async for e in read_events(response) if e.event == "token")
        await eventually(
            lambda: (
                sample(sse_service, "modelyard_generation_cancellations_total", "kept", cause="cancelled")
                == before + 1
            )
        )
        # The slot is released just after the cancellation is counted.
        await eventually(lambda: sample(sse_service, "modelyard_generation_active_sequences", "kept") == 0)
        assert sample(sse_service, "modelyard_generation_tokens_total", "kept") < 200
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            late = await http.get("/v1/models/kept/generate", headers={"Last-Event-ID": first.id})
        assert late.status_code == 404
    finally:
        await gateway.stop()


async def test_without_resume_a_disconnect_cancels_upstream_at_once(sse_service) -> None:
    gateway = await start_gateway(sse_service.address, resume_window_s=0, upstream_lookahead_bytes=1)
    try:
        before = sample(sse_service, "modelyard_generation_cancellations_total", "dropped", cause="cancelled")
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
            http.stream(
                "POST", "/v1/models/dropped/generate", json={"prompt": "x", "max_tokens": 256}
            ) as response,
        ):
            async for event in read_events(response):
                if event.event == "token":
                    break
        await eventually(
            lambda: (
                sample(sse_service, "modelyard_generation_cancellations_total", "dropped", cause="cancelled")
                == before + 1
            )
        )
        assert sample(sse_service, "modelyard_generation_tokens_total", "dropped") < 200
        assert gateway.metrics.registry.get_sample_value("modelyard_gateway_disconnects_total") == 1
        assert len(gateway.registry) == 0
    finally:
        await gateway.stop()


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "reason"),
    [
        ("/v1/models/nosuch/generate", {"json": {"prompt": "x"}}, 404, "model_not_found"),
        ("/v1/models/codelm/generate", {"json": {"prompt": "x", "temperature": -1}}, 400, "invalid_argument"),
        ("/v1/models/codelm/generate", {"content": b"{not json"}, 400, "invalid_argument"),
        ("/v1/models/codelm/generate", {"json": {"max_tokens": 3}}, 422, "invalid_argument"),
        (
            "/v1/models/codelm/generate",
            {"json": {"prompt": "x", "max_tokens": "many"}},
            422,
            "invalid_argument",
        ),
        ("/v1/models/codelm/generate", {"json": ["prompt"]}, 400, "invalid_argument"),
        ("/v1/models/codelm/generate", {"json": {"prompt": "x" * 2_000_000}}, 413, "too_large"),
    ],
)
async def test_bad_requests_get_their_status_and_a_json_error(client, path, kwargs, status, reason) -> None:
    response = await client.post(path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["reason"] == reason and error["message"]
    assert response.headers["x-error-reason"] == reason


async def test_a_failure_after_the_first_token_arrives_as_an_error_event(tmp_path) -> None:
    """The upstream dies mid-stream: the client gets `event: error` with the mapped status."""
    root = tmp_path / "models"
    shutil.copytree(CODELM / "1", root / "codelm" / "1")
    (root / "codelm" / "config.yaml").write_text(SMALL)
    upstream = start_service_process(root)
    gateway = await start_gateway(upstream.address, resume_window_s=0)
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
            http.stream(
                "POST", "/v1/models/codelm/generate", json={"prompt": "x", "max_tokens": 256}
            ) as response,
        ):
            events = read_events(response)
            first = await anext(e async for e in events if e.event == "token")
            upstream.stop(signal.SIGKILL)
            rest = [e async for e in events if e.event in ("token", "done", "error")]
        assert rest[-1].event == "error"
        assert rest[-1].data["status"] == 503 and rest[-1].data["code"] == "UNAVAILABLE"
        assert int(rest[-1].id.split(":")[1]) == int(first.id.split(":")[1]) + len(rest)
    finally:
        upstream.stop(signal.SIGKILL)
        await gateway.stop()


async def test_metrics_endpoint_counts_requests_and_streams(sse_service) -> None:
    # /metrics and /healthz on --metrics-listen; the public port serves neither /metrics.
    gateway = await start_gateway(sse_service.address, metrics_listen="127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            await client.get("/v1/models/codelm/generate", params={"prompt": "x", "max_tokens": "2"})
            assert (await client.get("/metrics")).status_code == 404
            async with httpx.AsyncClient(base_url=gateway.metrics_url, timeout=10) as metrics:
                text = (await metrics.get("/metrics")).text
                health = await metrics.get("/healthz")
        assert 'modelyard_gateway_requests_total{route="/v1/models/{model}/generate",status="200"}' in text
        assert "modelyard_gateway_time_to_first_byte_seconds_bucket" in text
        assert "modelyard_gateway_streams" in text
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    finally:
        await gateway.stop()


@contextlib.asynccontextmanager
async def holding_slot(service: Service, model: str) -> AsyncIterator[Any]:
    """A direct gRPC reader that takes the model's one slot and stops reading (its sequence pauses)."""
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(service.address, options=options) as channel:
        call = pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(model_name=model, prompt="x", max_tokens=256)
        )
        await call.read()
        try:
            yield call
        finally:
            call.cancel()


async def test_load_shed_is_429_with_retry_after_and_a_late_deadline_is_504(client, sse_service) -> None:
    async with holding_slot(sse_service, "tight") as holder:
        gateway = await start_gateway(sse_service.address, first_event_wait_s=0.2)
        try:
            async with (
                httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
                # Waits in the one queue place: its stream opens with heartbeats after 0.2 s.
                http.stream(
                    "POST", "/v1/models/tight/generate", json={"prompt": "y", "max_tokens": 2}
                ) as queued,
            ):
                assert queued.status_code == 200
                shed = await http.post("/v1/models/tight/generate", json={"prompt": "z"})
                assert shed.status_code == 429, shed.text
                assert (
                    shed.headers["retry-after"].isdigit() and shed.json()["error"]["reason"] == "queue_full"
                )
                holder.cancel()
                events = events_only([e async for e in read_events(queued)])
                assert events[-1].event == "done" and len(token_ids(events)) == 2
        finally:
            await gateway.stop()
    impatient = await start_gateway(sse_service.address, upstream_timeout_s=0.000001)
    try:
        async with httpx.AsyncClient(base_url=impatient.url) as http:
            late = await http.post("/v1/models/codelm/generate", json={"prompt": "x"})
        assert late.status_code == 504 and late.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    finally:
        await impatient.stop()


async def test_open_streams_over_the_limit_are_refused_with_429_finished_ones_not(sse_service) -> None:
    gateway = await start_gateway(
        sse_service.address, max_streams=1, upstream_lookahead_bytes=1, resume_buffer_events=4
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            # Short requests end and are kept for a late reconnect, but hold no place.
            for _ in range(5):
                short = await http.post("/v1/models/codelm/generate", json={"prompt": "x", "max_tokens": 1})
                assert short.status_code == 200
            last = events_only([e async for e in read_events(short)])[-1]
            assert (
                await http.get("/v1/models/codelm/generate", headers={"Last-Event-ID": last.id})
            ).status_code == 204
            async with http.stream(
                "POST", "/v1/models/kept/generate", json={"prompt": "x", "max_tokens": 256}
            ) as held:
                await anext(e async for e in read_events(held) if e.event == "token")
                second = await http.post("/v1/models/codelm/generate", json={"prompt": "x", "max_tokens": 2})
                assert second.status_code == 429 and "retry-after" in second.headers
    finally:
        await gateway.stop()


async def test_shutdown_ends_open_streams_with_an_error_event_and_cancels_upstream(sse_service) -> None:
    gateway = await start_gateway(sse_service.address, upstream_lookahead_bytes=1, resume_buffer_events=4)
    before = sample(sse_service, "modelyard_generation_cancellations_total", "drained", cause="cancelled")
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
        http.stream(
            "POST", "/v1/models/drained/generate", json={"prompt": "x", "max_tokens": 256}
        ) as response,
    ):
        events = read_events(response)
        await anext(e async for e in events if e.event == "token")
        stopping = asyncio.ensure_future(gateway.stop())
        rest = [e async for e in events if e.event in ("token", "done", "error")]
        await stopping
    assert (
        rest[-1].event == "error" and rest[-1].data["reason"] == "draining" and rest[-1].data["status"] == 503
    )
    await eventually(
        lambda: (
            sample(sse_service, "modelyard_generation_cancellations_total", "drained", cause="cancelled")
            == before + 1
        )
    )
