"""The one streamed response of the gateway's APIs: a 200 with event-stream headers, then a body
that a writer sends chunk by chunk, raced against the client's disconnect. Whichever ends first
cancels the other, so a client that leaves stops its writer at once (SSE detaches its stream,
OpenAI cancels its upstream call), and a writer that ends closes the body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

# Headers that stop proxies and browsers from buffering or caching the stream.
EVENT_STREAM_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}

Write = Callable[[bytes], Awaitable[None]]  # sends one chunk of the body
Body = Callable[[Write], Awaitable[None]]  # writes the whole body with it


async def stream(
    send: Send, receive: Receive, headers: Mapping[str, str], body: Body, first: bytes = b""
) -> bool:
    """Sends a 200 with `headers` and `first` (what is ready to go already), then runs `body`
    until it returns or the client disconnects. True when it returned (the body is then closed);
    False when the client left first or the writer failed (the connection is left to end
    without a closed body)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
    )

    async def write(chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    if first:  # right behind the headers, not a loop turn later from the writer's task
        await write(first)

    writer = asyncio.ensure_future(body(write))
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writer, gone):
            task.cancel()
        await asyncio.gather(writer, gone, return_exceptions=True)
    if writer.done() and not writer.cancelled() and writer.exception() is None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    return False


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (request body messages left unread are skipped)."""
    message: Message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()


class UpstreamEvents(Response):
    """Writes `events` made from an upstream call's messages; when the client disconnects the
    writer stops and the upstream call is cancelled (the OpenAI and KServe generate streams)."""

    def __init__(self, events: AsyncIterator[bytes], call: Any, response_headers: Mapping[str, str]) -> None:
        self.events = events
        self.call = call
        self.response_headers = {**EVENT_STREAM_HEADERS, **response_headers}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await stream(send, receive, self.response_headers, self._write)
        finally:
            self.call.cancel()

    async def _write(self, write: Write) -> None:
        async for chunk in self.events:
            await write(chunk)
