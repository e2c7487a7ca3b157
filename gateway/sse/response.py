"""The SSE connection: writes a stream's events from a position, heartbeats while quiet, and lets go
of the stream (see streams.Registry.detach) the moment the client disconnects."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modelyard.gateway import streamed_response
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.streams import Evicted, Registry, Stream, format_id

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
            **streamed_response.EVENT_STREAM_HEADERS,
            **stream.headers,
            "x-stream-id": stream.id,
            **extra_headers,
        }
        # The retry hint first, and a comment naming the stream (an id for logs and for resume by
        # hand), in the same write as the events already there.
        self._preamble = f"retry: {retry_ms}\n: stream {format_id(stream.id, start)}\n\n".encode()
        self._position = start  # the next event to write
        self._written = -1  # the last event in a chunk written, not yet marked delivered
        self._new = False  # the last chunk taken held events (more may follow at once)
        self._ended = False  # the last chunk taken held the last event (or the reader fell behind)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.attached.inc()
        try:
            # What is there already (the first event, usually) goes out with the headers.
            first = self._take()
            if not await streamed_response.stream(send, receive, self.response_headers, self._write, first):
                self.metrics.disconnects.inc()
        finally:
            self.metrics.attached.dec()
            self.registry.detach(self.stream)

    def _take(self) -> bytes:
        """The preamble (the first time) and the events buffered from this reader's position on,
        as one chunk."""
        preamble, self._preamble = self._preamble, b""
        try:
            events = self.stream.since(self._position)
        except Evicted:  # a second reader of the same stream ran ahead of this one
            self._ended = True
            return preamble + LAGGED
        self._new = bool(events)
        if not events:
            return preamble
        self._position = events[-1].seq + 1
        self._written = events[-1].seq
        self._ended = events[-1].terminal
        return preamble + b"".join(e.wire for e in events)

    def _delivered(self) -> None:
        """The chunk taken last has been written: its events count as delivered (see Stream)."""
        if self._written >= 0:
            self.stream.delivered(self._written)
            self._written = -1

    async def _write(self, write: streamed_response.Write) -> None:
        self._delivered()  # the first chunk went out with the headers
        while not self._ended:
            if not self._new:
                await self.stream.wait_change(self.heartbeat_s)
                if not self.stream.since(self._position):
                    await write(HEARTBEAT)
                    continue
            chunk = self._take()
            if chunk:
                await write(chunk)
                self._delivered()
