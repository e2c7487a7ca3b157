"""Draining a gRPC server so that every call it accepted gets its answer, also a large answer to a
slow reader: refuse new calls, let the calls in flight end, let the peers acknowledge every byte
of their answers, and only then stop the server (grpc.aio's stop(grace) closes the connections).

Why not stop(grace) alone: it sends GOAWAY and waits for the calls, but gRPC core shuts each
connection's socket (shutdown(SHUT_RDWR), then close) as soon as the connection's last call has
handed its final frames to the kernel. A peer still reading a large answer then sends a
WINDOW_UPDATE; the kernel answers data after SHUT_RD with a reset (RFC 1122) and drops the
answer's unsent tail, so the caller gets UNAVAILABLE ("Connection reset by peer") for a call the
server completed. Once the peers hold every byte, that reset loses nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason

# How often the drain looks again at the calls and the sockets' queues: a few loopback
# round trips; the wait is bounded by the grace, the look is a few small /proc reads.
LOOK_EVERY_S = 0.01

_REFUSED = ((headers.ERROR_REASON, ErrorReason.DRAINING.value),)


class Drain:
    """The calls in flight of the servers whose handlers pass `wrap`; `close` refuses new ones."""

    def __init__(self) -> None:
        self.closed = False
        self.calls = 0

    def close(self) -> None:
        """From now on, new calls are answered UNAVAILABLE (draining) at once."""
        self.closed = True

    def wrap(self, method: str, handler: Any) -> Any:
        """A request-pipeline wrapper (outermost): the call counts until gRPC has ended it (its
        status written), and is refused once the drain is closed."""
        if handler is None:
            return handler
        kind = _kind(handler)
        behaviour = getattr(handler, kind)
        wrapped: Any
        if handler.response_streaming and inspect.isasyncgenfunction(behaviour):

            async def replies(request: Any, context: Any) -> AsyncIterator[Any]:
                if self.closed:
                    await _refuse(context)
                self._admit(context)
                async for reply in behaviour(request, context):
                    yield reply

            wrapped = replies
        else:

            async def reply(request: Any, context: Any) -> Any:
                # While open (every call but those of the last moments), admitting is plain
                # calls: no coroutine of its own per call.
                if self.closed:
                    await _refuse(context)
                self._admit(context)
                return await behaviour(request, context)

            wrapped = reply
        return handler._replace(**{kind: wrapped})

    def _admit(self, context: Any) -> None:  # grpc's stubs take no function as a done callback
        self.calls += 1
        context.add_done_callback(self._ended)

    def _ended(self, _context: Any) -> None:
        self.calls -= 1

    async def settle(self, port: int, deadline: float) -> bool:
        """Close, then wait until no call is in flight and the peers on `port` acknowledged all
        this process sent them, or until `deadline` (the loop's clock). True when drained."""
        self.close()
        loop = asyncio.get_running_loop()
        while True:
            if self.calls == 0 and not await asyncio.to_thread(unacknowledged_bytes, port):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(LOOK_EVERY_S, max(0.0, deadline - loop.time())))


async def _refuse(context: Any) -> None:
    """A call that came once the drain closed: UNAVAILABLE (draining); abort raises."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", _REFUSED)


def unacknowledged_bytes(port: int) -> int:
    """Bytes this process wrote on its TCP connections of local `port` that the peers have not
    acknowledged yet (Linux: the tx_queue of /proc/self/net/tcp{,6} for the sockets among its own
    descriptors); 0 where /proc cannot tell."""
    try:
        mine = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    except OSError:
        return 0
    total = 0
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, queues, inode = fields[1], fields[3], fields[4], fields[9]
            # A listener's (0A) tx_queue is its backlog, not bytes.
            if state == "0A" or int(local.rsplit(":", 1)[1], 16) != port:
                continue
            if f"socket:[{inode}]" in mine:
                total += int(queues.split(":")[0], 16)
    return total


def _kind(handler: Any) -> str:
    streaming = bool(handler.request_streaming)
    if handler.response_streaming:
        return "stream_stream" if streaming else "unary_stream"
    return "stream_unary" if streaming else "unary_unary"
