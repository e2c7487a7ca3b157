"""Abandoned and paused streams cannot hold capacity others need (issue 33).

Two levels, each with a real service (and a real gateway) on loopback:
- the service: a paused sequence (its reader not reading, so gRPC flow control stops its stream)
  gives up its decode slot when others wait for one, keeps its cache in host memory, and
  rejoins when its reader reads again, emitting exactly what it would have uninterrupted; the
  preempted ones kept are bounded (the oldest dropped, its stream ABORTED, reader_stalled);
- the gateway: one client keeps at most --max-detached-per-client streams for resume, and at
  --max-streams a new stream cancels the oldest detached one instead of being refused.

Every model here has stall_timeout_ms 0: nothing but preemption or the gateway's eviction frees a
slot held by a stream nobody reads, so a test that gets a slot proves the one that gave it up.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
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
from modelyard.service.server import Service
from tests.sse_client import events_only, read_events, token_ids
from tests.support import eventually, metric, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")


def config(slots: int, preempted: int, waiting: int = 8) -> str:
    return (
        f"generation:\n  max_concurrent_sequences: {slots}\n  max_waiting: {waiting}\n  max_tokens: 256\n"
        f"  stream_buffer: 2\n  stall_timeout_ms: 0\n  max_preempted: {preempted}\n"
    )


MODELS = {
    "crowded": config(2, 16),  # more paused streams than slots
    "exact": config(1, 4),  # a preempted stream's output against an uninterrupted one's
    "bounded": config(1, 1),  # one preempted sequence kept at most
    "edge": config(2, 16),  # through the gateway: max_streams
    "tenants": config(2, 16),  # through the gateway: per-client bound
}
# The smallest HTTP/2 window gRPC allows: a client that stops reading stalls its stream at once.
SLOW = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
PROMPTS = ["def __init__(self", "import os\n", "    for i in range(", "class Parser:\n", "x = "]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 7}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("abandoned") / "models"
    for name, text in MODELS.items():
        shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / name / "1")
        (root / name / "config.yaml").write_text(text)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    async with serving(repository) as running:
        yield running


def count(service: Service, name: str, model: str, **labels: str) -> float:
    return metric(service.metrics.registry, name, model=model, version="1", **labels) or 0.0


def request(model: str, prompt: str, max_tokens: int = 256, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(model_name=model, prompt=prompt, max_tokens=max_tokens, **fields)


class Readers:
    """Generate streams each on a channel of its own with the smallest window: a stream read once
    and then left alone pauses its sequence within a few tokens."""

    def __init__(self, address: str, stack: contextlib.AsyncExitStack) -> None:
        self.address = address
        self.stack = stack

    async def paused(self, req: pb.GenerateRequest) -> Any:
        """A stream whose first message has come (so it got a slot), then not read."""
        channel = await self.stack.enter_async_context(grpc.aio.insecure_channel(self.address, options=SLOW))
        # A deadline: a stream that never gets a slot fails the test rather than hanging it.
        call = pb_grpc.InferenceServiceStub(channel).Generate(req, timeout=60)
        self.stack.callback(call.cancel)
        first: Any = await call.read()
        assert first.sequence_number == 0
        return call, first


async def rest(call: Any) -> list[pb.GenerateResponse]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(message)
    return out


def ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def whole(service: Service, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        # A deadline, so that a slot never given up fails the test rather than hanging it.
        return [r async for r in pb_grpc.InferenceServiceStub(channel).Generate(req, timeout=60)]


# --- the service: preemption -------------------------------------------------------------------


async def test_more_paused_streams_than_slots_leave_room_for_another_client(service: Service) -> None:
    async with contextlib.AsyncExitStack() as stack:
        readers = Readers(service.address, stack)
        # Twice the slots: the third and fourth get their first token only because the first two,
        # paused for their readers, gave their slots up.
        held = [await readers.paused(request("crowded", PROMPTS[i])) for i in range(4)]
        assert count(service, "modelyard_generation_preemptions_total", "crowded") >= 2
        answer = await whole(service, request("crowded", "import", max_tokens=6))
        assert answer[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(ids(answer)) == 6
        assert count(service, "modelyard_generation_preemptions_total", "crowded") >= 3
        preempted = count(service, "modelyard_generation_preempted_sequences", "crowded")
        assert 2 <= preempted <= 4
        for call, _ in held:
            call.cancel()
    # Cancelled while preempted: nothing is kept (no slot, no cache, no preempted entry).
    await eventually(lambda: count(service, "modelyard_generation_preempted_sequences", "crowded") == 0)
    await eventually(lambda: count(service, "modelyard_generation_active_sequences", "crowded") == 0)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_preempted_sequence_resumed_emits_what_it_would_have_uninterrupted(
    service: Service, sampling: dict[str, Any]
) -> None:
    req = request("exact", PROMPTS[3], max_tokens=60, **sampling)
    want = ids(await whole(service, req))
    assert len(want) == 60
    before = count(service, "modelyard_generation_preemptions_total", "exact")
    async with contextlib.AsyncExitStack() as stack:
        call, first = await Readers(service.address, stack).paused(req)
        # The one slot is the paused stream's: this one gets it only by preemption, and runs to
        # its end while the paused one waits with its cache in host memory.
        other = await whole(service, request("exact", PROMPTS[1], max_tokens=40, **sampling))
        assert other[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED and ids(other)
        assert count(service, "modelyard_generation_preemptions_total", "exact") == before + 1
        # Its reader reads again: it rejoins with its cache and goes on exactly where it was.
        responses = [first, *await rest(call)]
    assert ids(responses) == want
    assert [r.sequence_number for r in responses] == list(range(len(responses)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 60
    assert count(service, "modelyard_generation_preempted_sequences", "exact") == 0


async def test_past_max_preempted_the_oldest_is_dropped_with_a_reason_and_no_one_else_fails(
    service: Service,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        readers = Readers(service.address, stack)
        oldest, _ = await readers.paused(request("bounded", PROMPTS[0]))
        # The second takes the one slot from the first (one preempted: the bound).
        second, second_first = await readers.paused(request("bounded", PROMPTS[1], max_tokens=50))
        # A third takes it from the second: two preempted, one too many; the oldest goes.
        answer = await whole(service, request("bounded", PROMPTS[2], max_tokens=5))
        assert answer[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(ids(answer)) == 5
        assert count(service, "modelyard_generation_cancellations_total", "bounded", cause="preempted") == 1
        assert count(service, "modelyard_generation_preempted_sequences", "bounded") <= 1
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rest(oldest)
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "generation.max_preempted" in (caught.value.details() or "")
        trailers: Any = caught.value.trailing_metadata() or ()
        assert [v for k, v in trailers if k == "x-error-reason"] == ["reader_stalled"]
        # The second, preempted but within the bound, rejoins and ends as it would have.
        responses = [second_first, *await rest(second)]
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(ids(responses)) == 50
    await eventually(lambda: count(service, "modelyard_generation_active_sequences", "bounded") == 0)
    assert count(service, "modelyard_generation_preempted_sequences", "bounded") == 0


# --- the gateway: detached streams give way ---------------------------------------------------


async def start_gateway(service: Service, **settings: Any) -> Gateway:
    gateway = Gateway(
        GatewaySettings(
            listen="127.0.0.1:0",
            upstream=service.address,
            resume_window_s=60.0,
            resume_buffer_events=4,
            upstream_lookahead_bytes=1,
            **settings,
        )
    )
    await gateway.start()
    return gateway


async def abandoned(http: httpx.AsyncClient, model: str, tenant: str) -> str:
    """A generation started, read to its first token, and its connection dropped -> its last id."""
    body = {"prompt": "def main(", "max_tokens": 256}
    async with http.stream(
        "POST", f"/v1/models/{model}/generate", json=body, headers={"x-tenant-id": tenant}
    ) as response:
        assert response.status_code == 200, await response.aread()
        first = await anext(e async for e in read_events(response) if e.event == "token")
    return str(first.id)


async def detached(gateway: Gateway) -> None:
    """Every SSE connection has closed, so each stream left has been detached (the response lets
    go of its stream as it notices the disconnect, in the same step)."""

    def closed() -> bool:
        return gateway.metrics.registry.get_sample_value("modelyard_gateway_stream_connections") == 0

    await eventually(closed, "the SSE connections closed")


def evicted(gateway: Gateway, cause: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "modelyard_gateway_detached_evictions_total", {"cause": cause}
    )
    return value or 0.0


async def test_abandoned_streams_beyond_max_streams_give_way_to_a_live_client(service: Service) -> None:
    """More abandoned streams than decode slots (2) and than the gateway's max streams (3): each
    new stream cancels the oldest abandoned one; another client is served at once, never 429."""
    gateway = await start_gateway(service, max_streams=3, max_detached_per_client=8)
    cancelled = count(service, "modelyard_generation_cancellations_total", "edge", cause="cancelled")
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            left = []
            for i in range(5):
                left.append(await abandoned(http, "edge", "abuser"))
                await detached(gateway)
                assert gateway.registry.detached == min(i + 1, 3)
            assert evicted(gateway, "full") == 2 and gateway.registry.open == 3
            body = {"prompt": "import", "max_tokens": 5}
            async with http.stream(
                "POST", "/v1/models/edge/generate", json=body, headers={"x-tenant-id": "victim"}
            ) as response:
                assert response.status_code == 200
                events = events_only([e async for e in read_events(response)])
            assert events[0].event == "token" and events[-1].event == "done" and len(token_ids(events)) == 5
            assert evicted(gateway, "full") == 3
            # The evicted streams are gone: their resume is answered as an expired stream's.
            for last in left[:3]:
                late = await http.get("/v1/models/edge/generate", headers={"Last-Event-ID": last})
                assert late.status_code == 404 and late.json()["error"]["reason"] == "stream_not_found"
            # The newest are still held, and resume.
            async with http.stream(
                "GET", "/v1/models/edge/generate", headers={"Last-Event-ID": left[-1]}
            ) as r:
                assert r.status_code == 200
                assert await anext(e async for e in read_events(r) if e.event == "token")
        # Each eviction cancelled its upstream call: the service freed those sequences.
        await eventually(
            lambda: (
                count(service, "modelyard_generation_cancellations_total", "edge", cause="cancelled")
                >= cancelled + 3
            ),
            "the evicted streams cancelled upstream",
        )
    finally:
        await gateway.stop()
    await eventually(lambda: count(service, "modelyard_generation_active_sequences", "edge") == 0)


async def test_one_client_keeps_at_most_its_bound_of_abandoned_streams(service: Service) -> None:
    gateway = await start_gateway(service, max_streams=64, max_detached_per_client=2)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            calm = await abandoned(http, "tenants", "calm")
            await detached(gateway)
            mine = []
            for i in range(4):
                mine.append(await abandoned(http, "tenants", "abuser"))
                await detached(gateway)
                assert gateway.registry.detached == 1 + min(i + 1, 2)
            abuser = gateway.registry.caller("", "abuser", "127.0.0.1")
            assert gateway.registry.detached_by(abuser) == 2 and evicted(gateway, "client") == 2
            for last in mine[:2]:
                late = await http.get("/v1/models/tenants/generate", headers={"Last-Event-ID": last})
                assert late.status_code == 404 and late.json()["error"]["reason"] == "stream_not_found"
            # Another client's abandoned stream is untouched: it resumes to its end.
            async with http.stream(
                "GET", "/v1/models/tenants/generate", headers={"Last-Event-ID": calm}
            ) as r:
                assert r.status_code == 200
                events = events_only([e async for e in read_events(r)])
            assert events[0].id == calm.rpartition(":")[0] + ":1" and events[-1].event == "done"
    finally:
        await gateway.stop()
    await eventually(lambda: count(service, "modelyard_generation_active_sequences", "tenants") == 0)
