"""Slow and idle connections at the HTTP listeners: a connection that never sends a request, a
request whose headers never end, a body that trickles for ever, an endless fast body and oversized
headers are each answered (408/413/431) and closed by the gateway within its timeout, while a
long SSE stream, quieter than none of them, is not cut.

Raw TCP clients on loopback against a real gateway in this process (small timeouts set through its
settings), then the same against a real Envoy in front of it (tests/envoy_support.py, config from
envoy/python/render.py); each test waits for the socket's EOF under a bounded deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio

from modelyard.envoy import render
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings
from modelyard.inference.v1 import inference_service_pb2 as pb
from tests.envoy_support import start_envoy
from tests.sse_client import events_only, read_events
from tests.support import eventually, metric

IDLE_S, HEADER_S, BODY_S = 0.4, 0.6, 0.8  # distinct, so each close shows which deadline fired
STALL_S = 0.5
MARGIN_S = 3.0  # how much later than its deadline a close may come on a busy machine
TOKENS, TOKEN_GAP_S = 4, 0.5  # the slow stream: 2 s, longer than every timeout above


async def slow_generate(request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
    """A sidecar whose tokens come TOKEN_GAP_S apart (the pacing is the point of this fake)."""
    await context.send_initial_metadata((("x-served-version", "1"),))
    if request.prompt == "flood":  # big tokens, as fast as they are read
        for i in range(2000):
            yield pb.GenerateResponse(sequence_number=i, model_version="1", text="t" * 32768, token_ids=[i])
        return
    for i in range(TOKENS):
        yield pb.GenerateResponse(sequence_number=i, model_version="1", text="t", token_ids=[i])
        await asyncio.sleep(TOKEN_GAP_S)
    yield pb.GenerateResponse(
        sequence_number=TOKENS, model_version="1", finish_reason=pb.FINISH_REASON_LENGTH
    )


@pytest_asyncio.fixture
async def gateway() -> AsyncIterator[Gateway]:
    handler = grpc.method_handlers_generic_handler(
        "modelyard.inference.v1.InferenceService",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                slow_generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    settings = Settings(
        listen="127.0.0.1:0",
        upstream=f"127.0.0.1:{port}",
        idle_timeout_s=IDLE_S,
        header_timeout_s=HEADER_S,
        body_timeout_s=BODY_S,
        max_header_bytes=8 * 1024,
        max_body_bytes=64 * 1024,
        heartbeat_s=0.2,
        first_event_wait_s=0.1,
        write_stall_timeout_s=STALL_S,
        resume_window_s=0,  # a client that is let go ends its stream at once
        resume_buffer_events=16,
    )
    running = Gateway(settings)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()
        await server.stop(None)


@contextlib.asynccontextmanager
async def connection(gateway: Gateway) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = gateway.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def until_eof(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it has not closed within `within_s`."""
    data = b""
    async with asyncio.timeout(within_s):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk
    return data


async def closed_within(reader: asyncio.StreamReader, answer: bytearray, within_s: float) -> bool:
    """Reads what is there within `within_s` into `answer`; True once the server has closed."""
    try:
        chunk = await asyncio.wait_for(reader.read(65536), within_s)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    answer += chunk
    return not chunk


async def test_an_idle_connection_is_closed_after_the_idle_timeout(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, _):
        started = time.monotonic()
        assert await until_eof(reader, IDLE_S + MARGIN_S) == b""  # nothing was asked: nothing answered
        assert time.monotonic() - started >= IDLE_S * 0.9


async def test_a_kept_alive_connection_is_closed_after_the_idle_timeout(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        await until_eof(reader, IDLE_S + MARGIN_S)
        assert time.monotonic() - started >= IDLE_S * 0.9


async def test_a_held_half_request_gets_408_after_the_header_timeout(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, writer):
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-more: ")  # the headers never end
        answer = await until_eof(reader, HEADER_S + MARGIN_S)
        assert time.monotonic() - started >= HEADER_S * 0.9
    assert answer.startswith(b"HTTP/1.1 408") and b"x-error-reason: deadline" in answer


async def test_headers_that_keep_coming_are_cut_by_the_header_deadline_not_extended(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, writer):
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        answer = bytearray()
        with contextlib.suppress(ConnectionError):
            for i in range(10_000):  # one short header line per 50 ms, for as long as it is read
                writer.write(b"x-%d: y\r\n" % i)
                if await closed_within(reader, answer, 0.05):
                    break
        assert time.monotonic() - started < HEADER_S + MARGIN_S
    assert answer.startswith(b"HTTP/1.1 408")


async def test_oversized_headers_get_431(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000 + b"\r\n\r\n")
        answer = await until_eof(reader, MARGIN_S)
    assert answer.startswith(b"HTTP/1.1 431") and b"x-error-reason: too_large" in answer


async def test_a_trickling_chunked_body_gets_408_after_the_body_timeout(gateway: Gateway) -> None:
    async with connection(gateway) as (reader, writer):
        writer.write(
            b"POST /v1/models/m/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n1\r\n{\r\n"
        )
        started = time.monotonic()
        answer = bytearray()
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):  # a byte per 50 ms: the body never ends
                writer.write(b"1\r\n \r\n")
                if await closed_within(reader, answer, 0.05):
                    break
        elapsed = time.monotonic() - started
    assert BODY_S * 0.9 <= elapsed < BODY_S + MARGIN_S
    assert answer.startswith(b"HTTP/1.1 408") and b"x-error-reason: deadline" in answer


@pytest.mark.parametrize("path", [b"POST /v1/models/m/generate", b"GET /healthz"])
async def test_an_endless_fast_body_is_answered_then_the_connection_closed(
    gateway: Gateway, path: bytes
) -> None:
    """Past max_body_bytes (413), or on a route that never reads it (200): either way the answer
    comes first and the connection is closed after it, whatever the client keeps sending."""
    async with connection(gateway) as (reader, writer):
        writer.write(path + b" HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"4000\r\n" + b"a" * 0x4000 + b"\r\n"

        async def endless() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(chunk)
                    await writer.drain()

        sending = asyncio.ensure_future(endless())
        try:
            answer = await until_eof(reader, BODY_S + MARGIN_S)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
    assert answer.startswith(b"HTTP/1.1 413" if path.startswith(b"POST") else b"HTTP/1.1 200"), answer[:200]


async def test_a_client_that_stops_reading_is_let_go(gateway: Gateway) -> None:
    """It reads nothing of a stream that fills every buffer: after STALL_S with the write buffer
    full the connection is dropped, its stream detached and (no resume here) cancelled upstream."""
    async with connection(gateway) as (_, writer):
        writer.write(b"GET /v1/models/m/generate?prompt=flood HTTP/1.1\r\nhost: x\r\n\r\n")
        await eventually(
            lambda: metric(gateway.metrics.registry, "modelyard_gateway_disconnects_total") == 1,
            "the stalled reader let go",
            within_s=STALL_S + 2 * MARGIN_S,
        )
        await eventually(lambda: len(gateway.registry) == 0, "its stream forgotten")


async def test_a_stream_longer_than_every_timeout_is_not_cut(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        started = time.monotonic()
        response = await http.post("/v1/models/m/generate", json={"prompt": "x"})
        events = events_only([e async for e in read_events(response)])
    assert time.monotonic() - started > max(IDLE_S, HEADER_S, BODY_S)
    assert [e.event for e in events] == ["token"] * TOKENS + ["done"]


# --- Envoy in front ----------------------------------------------------------------------------


def test_envoy_timeouts_fit_the_gateway_behind_it() -> None:
    """Rendered defaults: stream_idle_timeout far above the gateway's heartbeat interval (streams
    survive), Envoy's header bound under the gateway's, pooled connections closed by Envoy before
    the gateway's idle timeout would close them under a request."""
    defaults = Settings()
    for settings in (render.RenderSettings(), render.KUBERNETES):
        assert settings.stream_idle_timeout_s >= 4 * defaults.heartbeat_s
        assert settings.max_request_headers_kb * 1024 < defaults.max_header_bytes
        assert settings.upstream_idle_timeout_s < defaults.idle_timeout_s
        manager = render.config(settings)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][
            0
        ]
        typed = manager["typed_config"]
        assert typed["request_headers_timeout"] == "10s" and typed["request_timeout"] == "120s"
        assert typed["common_http_protocol_options"] == {"idle_timeout": "60s"}


async def test_envoy_closes_slow_and_idle_connections_but_not_streams(gateway: Gateway, tmp_path) -> None:
    sidecar = gateway.settings.upstream
    envoy = start_envoy(
        tmp_path,
        gateway.address,
        sidecar,
        idle_timeout_s=IDLE_S,
        request_headers_timeout_s=HEADER_S,
        request_timeout_s=BODY_S,
        stream_idle_timeout_s=BODY_S * 2,  # over the gateway's 0.2 s heartbeats and token gaps
    )
    try:
        host, port = "127.0.0.1", envoy.port
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        assert await until_eof(reader, IDLE_S + MARGIN_S) == b""
        assert time.monotonic() - started >= IDLE_S * 0.9
        writer.close()

        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-more: ")
        answer = await until_eof(reader, HEADER_S + MARGIN_S)
        assert time.monotonic() - started >= HEADER_S * 0.9 and answer.startswith(b"HTTP/1.1 408")
        writer.close()

        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/models/m/generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        started = time.monotonic()
        body = bytearray()
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):  # a byte per 50 ms
                writer.write(b"1\r\n \r\n")
                if await closed_within(reader, body, 0.05):
                    break
        assert BODY_S * 0.9 <= time.monotonic() - started < BODY_S + MARGIN_S
        assert body.startswith(b"HTTP/1.1 408"), body[:200]
        writer.close()

        # The request_timeout (BODY_S) and stream_idle_timeout stop nothing once the stream answers.
        async with httpx.AsyncClient(base_url=envoy.url, timeout=30) as http:
            started = time.monotonic()
            response = await http.post("/v1/models/m/generate", json={"prompt": "x"})
            events = events_only([e async for e in read_events(response)])
        assert time.monotonic() - started > BODY_S * 2
        assert [e.event for e in events] == ["token"] * TOKENS + ["done"]
    finally:
        envoy.stop()
