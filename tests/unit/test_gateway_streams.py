"""The gateway's stream buffer, SSE writer and error table, without a network."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gateway import errors
from gateway.metrics import GatewayMetrics
from gateway.sse import HEARTBEAT, SSEResponse
from gateway.streams import DONE, TOKEN, Evicted, Registry, Stream, parse_id


class Connection:
    """An ASGI connection: records what the response sends, reports a disconnect on request."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.gone = asyncio.Event()

    async def send(self, message: Any) -> None:
        self.sent.append(message)
        self.changed.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def wait_for(self, chunk: bytes) -> None:
        while not any(chunk in m.get("body", b"") for m in self.sent):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)


def registry(window_s: float = 10.0, bound: int = 4) -> Registry:
    return Registry(window_s, bound, 16, GatewayMetrics())


async def test_quiet_stream_gets_heartbeats_then_events_and_ends_after_done() -> None:
    streams = registry()
    stream = Stream("s1", "m", 8)
    streams._streams["s1"] = stream
    stream.readers = 1
    connection = Connection()
    response = SSEResponse(stream, 0, streams, streams.metrics, 0.05, 1500, {})
    task = asyncio.create_task(response({"type": "http"}, connection.receive, connection.send))
    await connection.wait_for(HEARTBEAT)
    assert connection.sent[0]["status"] == 200
    assert connection.sent[1]["body"].startswith(b"retry: 1500\n")
    await stream._append(TOKEN, {"text": "a"})
    await stream._append(DONE, {"finish_reason": "length"})
    await asyncio.wait_for(task, 10)
    body = b"".join(m.get("body", b"") for m in connection.sent[1:])
    assert b'id: s1:0\nevent: token\ndata: {"text":"a"}\n\n' in body
    assert body.endswith(b'id: s1:1\nevent: done\ndata: {"finish_reason":"length"}\n\n')
    assert connection.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert stream.readers == 0 and stream.expiry is not None  # kept for a late reconnect


async def test_buffer_pauses_when_full_of_unread_events_and_evicts_only_read_ones() -> None:
    stream = Stream("s", "m", 2)
    await stream._append(TOKEN, {"i": 0})
    await stream._append(TOKEN, {"i": 1})
    third = asyncio.create_task(stream._append(TOKEN, {"i": 2}))
    await asyncio.sleep(0)
    assert not third.done()  # nothing read yet: the producer waits instead of dropping
    stream.delivered(0)
    await asyncio.wait_for(third, 5)
    assert [e.seq for e in stream.since(1)] == [1, 2]
    with pytest.raises(Evicted):
        stream.since(0)


def test_event_ids_round_trip_and_bad_ones_are_refused() -> None:
    assert parse_id("ab-c_d:12") == ("ab-c_d", 12)
    for bad in ("", "12", "x:", "x:y"):
        with pytest.raises(ValueError):
            parse_id(bad)


@pytest.mark.parametrize(
    ("code", "status", "retry_after"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "1"),
        (grpc.StatusCode.UNAVAILABLE, 503, "1"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
        (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (grpc.StatusCode.NOT_FOUND, 404, None),
    ],
)
def test_one_table_maps_grpc_status_to_http(code, status, retry_after) -> None:
    reason = {grpc.StatusCode.RESOURCE_EXHAUSTED: {"x-error-reason": "queue_full"}}.get(code, {})
    error = errors.from_status(code, "msg", reason)
    assert error.status == status and error.code == code.name
    assert error.headers().get("retry-after") == retry_after


def test_retry_after_follows_the_upstream_pushback_and_its_reason() -> None:
    error = errors.from_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "full",
        {"grpc-retry-pushback-ms": "2500", "x-error-reason": "tenant_limit"},
    )
    assert error.headers() == {"x-error-reason": "tenant_limit", "retry-after": "3"}


def test_resource_exhausted_for_size_is_413_not_load() -> None:
    for metadata in ({}, {"x-error-reason": "too_large"}):  # gRPC core's refusal carries no reason
        error = errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "big", metadata)
        assert error.status == 413 and error.reason == "too_large" and "retry-after" not in error.headers()
