"""The SSE connection: writes a stream's events from a position, heartbeats while quiet, and lets go
of the stream (see streams.Registry.detach) the moment the client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics
from gateway.streams import Evicted, Registry, Stream, encode, format_id

# Headers that stop proxies and browsers from buffering or caching the stream.
SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
HEARTBEAT = b": keep-alive\n\n"
LAGGED = b'event: error\ndata: {"status":410,"code":"OUT_OF_RANGE","reason":"resume_too_old",' + (
    b'"message":"this connection fell behind the stream buffer"}\n\n'
)


class SSEResponse(Response):
    """An ASGI response streaming `stream` from event `start` on. The caller has attached a reader
    for it; this response detaches it when it ends, however it ends."""

    def __init__(
        self,
        stream: Stream,
        start: int,
        registry: Registry,
        metrics: GatewayMetrics,
        heartbeat_s: float,
        retry_ms: int,
        extra_headers: Mapping[str, str],
    ) -> None:
        self.stream = stream
        self.start = start
        self.registry = registry
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.retry_ms = retry_ms
        self.response_headers = {**SSE_HEADERS, **stream.headers, "x-stream-id": stream.id, **extra_headers}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.attached.inc()
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in self.response_headers.items()],
                }
            )
            writer = asyncio.ensure_future(self._write(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writer, gone):
                    task.cancel()
                await asyncio.gather(writer, gone, return_exceptions=True)
            if writer.done() and not writer.cancelled() and writer.exception() is None:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                self.metrics.disconnects.inc()
        finally:
            self.metrics.attached.dec()
            self.registry.detach(self.stream)

    async def _write(self, send: Send) -> None:
        stream = self.stream
        # The retry hint first, and a comment naming the stream (an id for logs and for resume by
        # hand), in the same write as the events already there.
        preamble = f"retry: {self.retry_ms}\n: stream {format_id(stream.id, self.start)}\n\n".encode()
        position = self.start
        while True:
            try:
                events = stream.since(position)
            except Evicted:  # a second reader of the same stream ran ahead of this one
                await _body(send, preamble + LAGGED)
                return
            if not events:
                if preamble:
                    await _body(send, preamble)
                    preamble = b""
                await stream.wait_change(self.heartbeat_s)
                if not stream.since(position):
                    await _body(send, HEARTBEAT)
                continue
            await _body(send, preamble + b"".join(e.wire or encode(stream.id, e) for e in events))
            preamble = b""
            position = events[-1].seq + 1
            stream.delivered(events[-1].seq)
            if events[-1].terminal:
                return


async def _body(send: Send, chunk: bytes) -> None:
    await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (request body messages left unread are skipped)."""
    message: Message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()
