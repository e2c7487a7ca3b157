"""The SSE connection: writes a stream's events from a position, heartbeats while quiet, and lets go
of the stream (see streams.Registry.detach) the moment the client disconnects."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modelyard.gateway import streaming
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.streams import Evicted, Registry, Stream, encode, format_id

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
        self.response_headers = {
            **streaming.EVENT_STREAM_HEADERS,
            **stream.headers,
            "x-stream-id": stream.id,
            **extra_headers,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.attached.inc()
        try:
            if not await streaming.stream(send, receive, self.response_headers, self._write):
                self.metrics.disconnects.inc()
        finally:
            self.metrics.attached.dec()
            self.registry.detach(self.stream)

    async def _write(self, write: streaming.Write) -> None:
        stream = self.stream
        # The retry hint first, and a comment naming the stream (an id for logs and for resume by
        # hand), in the same write as the events already there.
        preamble = f"retry: {self.retry_ms}\n: stream {format_id(stream.id, self.start)}\n\n".encode()
        position = self.start
        while True:
            try:
                events = stream.since(position)
            except Evicted:  # a second reader of the same stream ran ahead of this one
                await write(preamble + LAGGED)
                return
            if not events:
                if preamble:
                    await write(preamble)
                    preamble = b""
                await stream.wait_change(self.heartbeat_s)
                if not stream.since(position):
                    await write(HEARTBEAT)
                continue
            await write(preamble + b"".join(e.wire or encode(stream.id, e) for e in events))
            preamble = b""
            position = events[-1].seq + 1
            stream.delivered(events[-1].seq)
            if events[-1].terminal:
                return
