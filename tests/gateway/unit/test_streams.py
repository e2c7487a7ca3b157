"""The gateway's stream buffer, SSE writer and error table, without a network."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from modelyard.gateway import errors
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.sse.response import HEARTBEAT, SSEResponse
from modelyard.gateway.streams import DONE, TOKEN, Evicted, Registry, Stream, parse_id
from modelyard.inference.v1 import inference_service_pb2 as pb


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
    stream.readers = 1  # attached, but reading slower than the model
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


async def test_a_stream_nobody_reads_stops_reading_upstream_until_a_reader_attaches() -> None:
    """The client left (a closed tab): the producer waits at once, with room in the buffer, so the
    upstream call is not read and the service pauses the sequence; a resume lets it go on."""
    streams = registry(bound=64)
    stream = Stream("s", "m", 64)
    streams._streams["s"] = stream
    stream.readers = 1
    await stream._append(TOKEN, {"i": 0})
    streams.detach(stream)
    assert stream.readers == 0 and stream.expiry is not None
    second = asyncio.create_task(stream._append(TOKEN, {"i": 1}))
    await asyncio.sleep(0)
    assert not second.done() and stream.next_seq == 1  # paused, with 63 places free
    streams.attach(stream)
    await asyncio.wait_for(second, 5)
    assert stream.next_seq == 2 and stream.expiry is None


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


def test_a_request_the_model_rejected_inside_its_graph_is_422() -> None:
    # It fitted the declared inputs (no 400) and is no server fault by itself (no 500).
    metadata = {"x-error-reason": "model_rejected"}
    error = errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, "reshape", metadata)
    assert error.status == 422 and error.reason == "model_rejected" and "retry-after" not in error.headers()
    plain = errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, "not a decoder", {})
    assert plain.status == 400 and plain.reason == "failed_precondition"


# --- the limits: open streams counted, finished ones bounded by bytes --------------------------


class FakeCall:
    """A Generate call that yields `tokens` tokens then done; `hold` keeps it open until released."""

    def __init__(self, tokens: int, hold: bool = False) -> None:
        self.tokens = tokens
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.cancelled = False

    async def initial_metadata(self) -> Any:
        return ()

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        for i in range(self.tokens):
            yield pb.GenerateResponse(sequence_number=i, text="t" * 100, token_ids=[i], model_version="1")
        await self.release.wait()
        yield pb.GenerateResponse(sequence_number=self.tokens, finish_reason=pb.FINISH_REASON_LENGTH)


async def finish(streams: Registry, call: FakeCall) -> Stream:
    stream = streams.start("m", call)
    assert stream.producer is not None
    await stream.producer
    await asyncio.sleep(0)  # the producer's done callback runs on the next loop pass
    streams.detach(stream)
    return stream


async def test_finished_streams_do_not_count_against_max_streams() -> None:
    streams = Registry(60.0, 16, 2, GatewayMetrics())
    for _ in range(100):  # one-token requests: each ends, is kept for resume, and costs no place
        await finish(streams, FakeCall(1))
    assert len(streams) == 100 and streams.open == 0
    held = [streams.start("m", FakeCall(1, hold=True)) for _ in range(2)]
    refused = FakeCall(1)
    with pytest.raises(errors.HttpError) as raised:
        streams.start("m", refused)
    assert raised.value.status == 429 and refused.cancelled  # two open: the limit
    for stream in held:
        streams.drop(stream)
    await asyncio.gather(*(s.producer for s in held if s.producer), return_exceptions=True)
    await asyncio.sleep(0)
    assert streams.open == 0
    streams.start("m", FakeCall(1))  # places come back when open streams end


async def test_finished_buffers_are_bounded_by_bytes_oldest_forgotten_first() -> None:
    one = len((await finish(Registry(60.0, 16, 8, GatewayMetrics()), FakeCall(3))).since(0))
    assert one == 4
    size = (await finish(Registry(60.0, 16, 8, GatewayMetrics()), FakeCall(3))).bytes
    streams = Registry(60.0, 16, 8, GatewayMetrics(), finished_bytes=3 * size)
    open_one = streams.start("m", FakeCall(3, hold=True))
    done = [await finish(streams, FakeCall(3)) for _ in range(5)]
    # The three newest finished streams fit the budget; the two oldest are forgotten.
    assert [streams.get(s.id) is not None for s in done] == [False, False, True, True, True]
    assert streams.finished_size == 3 * size
    assert streams.get(open_one.id) is open_one  # an open stream is never evicted for bytes
    # A kept stream still resumes exactly: every event from the position asked for.
    kept = done[-1]
    assert [e.seq for e in kept.since(2)] == [2, 3] and kept.event(3) is not None and kept.event(3).terminal
    streams.drop(open_one)


async def test_the_request_waiting_for_the_first_event_runs_before_the_producer_reads_on() -> None:
    # The request answers (headers and first event written) before the producer asks gRPC for the
    # next message: here the next messages are ready at once, so a producer that read on would
    # have buffered them all before the waiting request woke.
    streams = registry(bound=16)
    stream = streams.start("m", FakeCall(5))
    async with asyncio.timeout(5):  # as the endpoint waits (wait_for would add a task between)
        await stream.started()
    assert stream.next_seq == 1
    assert stream.producer is not None
    await stream.producer
    assert stream.next_seq == 6  # then the rest, as before


async def test_a_buffered_event_costs_little_beyond_its_encoded_bytes() -> None:
    # A held stream buffers up to --resume-buffer-events events: each is kept encoded only (its
    # bytes, a small record), not also as the dict it was made from (which about doubled it).
    stream = Stream("Zx3kQ1w2e3r4", "codelm", 512)
    stream.readers = 1
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(256):
            token = {"text": f"self{i}", "token_ids": [1000 + i], "index": i, "model_version": "1"}
            await stream._append(TOKEN, token)
        per_event = (tracemalloc.get_traced_memory()[0] - before) / 256
    finally:
        tracemalloc.stop()
    assert per_event < stream.bytes / 256 + 160, per_event
