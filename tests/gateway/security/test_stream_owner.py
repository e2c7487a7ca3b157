"""A resumed SSE stream is read only with the credential that started it (issue 33), and its id,
the capability to resume it, is never written to a log.

A real service on --auth-tokens-file with --auth-inference (two inference tokens, A and B) behind
a real gateway: a stream started with A is answered to an anonymous resume (header or query
parameter) and to B's exactly as a stream that does not exist is, never with its tokens; A's
resume continues it with none lost or repeated.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sse_client import SseEvent, events_only, read_events, token_ids
from tests.support import eventually, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN_A, TOKEN_B = "stream-owner-token-a", "stream-owner-token-b"
A = {"authorization": f"Bearer {TOKEN_A}"}
B = {"authorization": f"Bearer {TOKEN_B}"}
# A small stream buffer: a stream whose client left pauses within a few tokens.
CONFIG = "generation:\n  max_concurrent_sequences: 4\n  max_tokens: 256\n  stream_buffer: 2\n"
GENERATE = "/v1/models/lm/generate"
BODY = {"prompt": "class Parser:\n", "max_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("owner") / "models"
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / "lm" / "1")
    (root / "lm" / "config.yaml").write_text(CONFIG)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    tokens = repository.parent / "tokens"
    tokens.write_text(f"{TOKEN_A} inference\n{TOKEN_B} inference\n")
    async with serving(
        repository,
        auth_tokens_file=str(tokens),
        auth_inference=True,
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(service: Service) -> AsyncIterator[Gateway]:
    # The access line on, so that the test sees every line the gateway writes for a request.
    running = Gateway(
        GatewaySettings(
            listen="127.0.0.1:0",
            upstream=service.address,
            resume_window_s=60.0,
            resume_buffer_events=8,
            upstream_lookahead_bytes=1,
            access_log=True,
        )
    )
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


async def started_then_left(
    http: httpx.AsyncClient, credential: dict[str, str], tokens: int
) -> list[SseEvent]:
    """A stream started with `credential`, read for `tokens` token events, then the client leaves."""
    seen: list[SseEvent] = []
    async with http.stream("POST", GENERATE, json=BODY, headers=credential) as response:
        assert response.status_code == 200, await response.aread()
        async for event in read_events(response):
            if event.event == "token":
                seen.append(event)
            if len(seen) == tokens:
                break
    return seen


def same_as_unknown(refused: httpx.Response, unknown: httpx.Response, stream_id: str) -> None:
    """Answered exactly as a stream id that does not exist: status, reason, headers' reason, and
    the message but for the id it names."""
    assert refused.status_code == unknown.status_code == 404
    assert refused.headers["x-error-reason"] == unknown.headers["x-error-reason"] == "stream_not_found"
    assert refused.json()["error"]["message"].replace(stream_id, "ID") == unknown.json()["error"][
        "message"
    ].replace("nosuchstream0000", "ID")
    assert b"event: token" not in refused.content and b"data:" not in refused.content


async def test_a_stream_is_resumed_only_with_the_credential_that_started_it(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        whole = await http.post(GENERATE, json=BODY, headers=A)
        assert whole.status_code == 200
        want = token_ids(events_only([e async for e in read_events(whole)]))
        assert len(want) == 40

        first = await started_then_left(http, A, 3)
        last = first[-1].id
        stream_id = last.rpartition(":")[0]
        unknown = await http.get(GENERATE, headers={**A, "Last-Event-ID": "nosuchstream0000:2"})
        before = gateway.metrics.registry.get_sample_value(
            "modelyard_gateway_resumes_total", {"outcome": "resumed"}
        )

        for refused in (
            await http.get(GENERATE, headers={"Last-Event-ID": last}),  # anonymous, as EventSource
            await http.get(GENERATE, params={"last_event_id": last}),  # anonymous, the query form
            await http.post(GENERATE, headers={"Last-Event-ID": last}),  # anonymous POST
            await http.get(GENERATE, headers={**B, "Last-Event-ID": last}),  # another token
            await http.get(GENERATE, params={"last_event_id": last}, headers=B),
            await http.get(
                GENERATE, headers={"authorization": "Bearer " + TOKEN_A[:-1], "Last-Event-ID": last}
            ),
        ):
            same_as_unknown(refused, unknown, stream_id)
        assert (
            gateway.metrics.registry.get_sample_value(
                "modelyard_gateway_resumes_total", {"outcome": "resumed"}
            )
            == before
        )
        stream = gateway.registry.get(stream_id)
        assert stream is not None and not stream.finished and stream.readers == 0  # untouched by them

        # The owner resumes: the rest of the stream, from the event after the one named.
        async with http.stream("GET", GENERATE, headers={**A, "Last-Event-ID": last}) as response:
            assert response.status_code == 200
            rest = events_only([e async for e in read_events(response)])
        assert rest[0].id == f"{stream_id}:3"
        assert token_ids(first) + token_ids(rest) == want
        assert rest[-1].event == "done"

        # Finished and kept for a late reconnect: the owner is told it ended (204), others nothing.
        end = rest[-1].id
        assert (await http.get(GENERATE, headers={**A, "Last-Event-ID": end})).status_code == 204
        same_as_unknown(await http.get(GENERATE, headers={**B, "Last-Event-ID": end}), unknown, stream_id)
        same_as_unknown(await http.get(GENERATE, headers={"Last-Event-ID": end}), unknown, stream_id)


# The test's own HTTP client logs its requests' URLs and headers: not the servers' lines.
CLIENT_LOGGERS = ("httpx", "httpcore")


def _records_naming(records: list[logging.LogRecord], secret: str) -> list[str]:
    """The servers' records (gateway, service, uvicorn, gRPC) whose message or fields hold `secret`."""
    found = []
    for record in records:
        if record.name.startswith(CLIENT_LOGGERS):
            continue
        text = record.getMessage() + repr(record.__dict__)
        if secret in text:
            found.append(text)
    return found


async def test_stream_ids_stay_out_of_every_log_line(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """Started, resumed by the header and the query parameter, refused, evicted (its client's
    bound), expired: at DEBUG, with the access line on, no record names a stream id."""
    caplog.set_level(logging.DEBUG)
    gateway = Gateway(
        GatewaySettings(
            listen="127.0.0.1:0",
            upstream=service.address,
            resume_window_s=0.5,
            resume_buffer_events=8,
            upstream_lookahead_bytes=1,
            max_detached_per_client=1,
            access_log=True,
            log_format="json",
        )
    )
    await gateway.start()
    ids: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            first = await started_then_left(http, A, 2)
            ids.append(first[-1].id.rpartition(":")[0])
            # Resumed by the owner, with the id in the query string, then left again.
            async with http.stream("GET", GENERATE, params={"last_event_id": first[-1].id}, headers=A) as r:
                assert r.status_code == 200
                await anext(e async for e in read_events(r) if e.event == "token")
            assert (await http.get(GENERATE, headers={**B, "Last-Event-ID": first[-1].id})).status_code == 404
            # A second stream of the same client: the first is cancelled (one detached per client).
            second = await started_then_left(http, A, 1)
            ids.append(second[-1].id.rpartition(":")[0])
            await eventually(lambda: gateway.registry.get(ids[0]) is None, "the first stream evicted")
            # The second one expires with nobody resuming it.
            await eventually(lambda: gateway.registry.get(ids[1]) is None, "the second stream expired")
            assert (
                await http.get(GENERATE, headers={**A, "Last-Event-ID": second[-1].id})
            ).status_code == 404
    finally:
        await gateway.stop()
    evicted = gateway.metrics.registry.get_sample_value(
        "modelyard_gateway_detached_evictions_total", {"cause": "client"}
    )
    assert evicted == 1
    messages = [r.getMessage() for r in caplog.records]
    # The lines that could have named them were written: the access lines and the debug lines.
    assert any("GET /v1/models/lm/generate" in m for m in messages)
    assert any("cancelled (client)" in m for m in messages) and any("expired" in m for m in messages)
    for stream_id in ids:
        assert _records_naming(caplog.records, stream_id) == []


async def test_a_stream_started_without_a_credential_is_resumed_by_whoever_holds_its_id(
    tmp_path: Path, repository: Path
) -> None:
    """Without credentials the id is the capability (docs/edge.md): any client that has it
    resumes, including one that sends a token."""
    open_service = build_service(Settings(repository=repository, listen="127.0.0.1:0", metrics_listen=""))
    await open_service.start()
    gateway = Gateway(
        GatewaySettings(listen="127.0.0.1:0", upstream=open_service.address, upstream_lookahead_bytes=1)
    )
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            first = await started_then_left(http, {}, 2)
            headers: dict[str, Any] = {**B, "Last-Event-ID": first[-1].id}
            async with http.stream("GET", GENERATE, headers=headers) as response:
                assert response.status_code == 200
                rest = events_only([e async for e in read_events(response)])
            assert rest[-1].event == "done" and len(token_ids(first) + token_ids(rest)) == 40
    finally:
        await gateway.stop()
        await open_service.stop(grace_s=1.0)
