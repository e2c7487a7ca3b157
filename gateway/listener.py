"""The HTTP listener's connection guard: uvicorn's httptools protocol with the timeouts and the
header bound that uvicorn lacks.

uvicorn arms its keep-alive timer only after a response, so on its own a connection that never
sends a request, a request whose headers never end, and a body that never ends are all held for
ever. Here each connection is, at any moment, in one phase with its own deadline:
- idle: no byte of a request yet (a new connection, or between keep-alive requests):
  closed after `idle_timeout_s`;
- headers: a request has begun and its headers are not complete: `header_timeout_s` from
  the first byte, then 408 and close; headers (request line included) over `max_header_bytes`:
  431 and close;
- body: headers complete, body not: `body_timeout_s` from the end of the headers for the whole
  body (a trickle does not extend it), then 408 (or, once the answer has started, close);
- answering: the request is fully read: no deadline (SSE streams last as long as they are
  written; the gateway's heartbeats keep them alive through proxies), except that a client
  that stops reading is let go: once the connection's write buffer is full (asyncio pauses
  writing), it has `write_stall_timeout_s` to take some of it, or the connection is closed (an
  SSE stream is then detached, as on any disconnect, and kept for resume).
An answer sent before its request's body was read (413, or a route that ignores bodies) closes
the connection after it, so an endless body cannot follow it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from modelyard.common.reasons import ErrorReason

IDLE, HEADERS, BODY, ANSWERING = "idle", "headers", "body", "answering"


@dataclass(frozen=True)
class Limits:
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    write_stall_timeout_s: float = 60.0


class _HeadersTooLarge(Exception):
    pass


def _answer(status: int, phrase: str, code: str, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "reason": reason, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\nx-error-reason: {reason}\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedProtocol(HttpToolsProtocol):
    """One connection; `LIMITS` is set on the subclass that protocol_class() makes."""

    LIMITS = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: tuple[object, str] | None = None  # (the request cycle, the phase name)
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a request arrived, its headers are not complete yet
        self._header_bytes = 0
        self._too_large = False
        self._stalled: asyncio.TimerHandle | None = None

    # --- uvicorn's protocol, watched --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = HeadHeld(transport, self.loop)  # uvicorn's responses write through it
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        timeout = self.LIMITS.write_stall_timeout_s
        if timeout > 0 and self._stalled is None:
            self._stalled = self.loop.call_later(timeout, self._stall_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is None or self.cycle.response_complete:
            self._partial = True  # a request has begun (it would have a new cycle once its headers end)
        self._watch()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._partial = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            self.transport.close()  # answered before its body was read: nothing more is read
        self._partial = False
        self._watch()

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            super().send_400_response(msg)
            return
        limit = self.LIMITS.max_header_bytes
        message = f"the request line and headers are over {limit} bytes"
        self.transport.write(
            _answer(
                431, "Request Header Fields Too Large", "RESOURCE_EXHAUSTED", ErrorReason.TOO_LARGE, message
            )
        )
        self.transport.close()

    # --- the guard ------------------------------------------------------------------------------

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.LIMITS.max_header_bytes:
            self._too_large = True
            raise _HeadersTooLarge  # httptools stops parsing; uvicorn answers (send_400_response)

    def _watch(self) -> None:
        """Arm the deadline of the phase the connection is in now, if it has just entered it."""
        if self.transport is None or self.transport.is_closing():
            self._cancel()
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            phase = HEADERS if self._partial else IDLE
        elif cycle.more_body:
            phase = BODY
        else:
            phase = ANSWERING
        key = (cycle, phase)
        if self._phase is not None and self._phase[0] is cycle and self._phase[1] == phase:
            return  # the same phase: its deadline runs on (more bytes do not extend it)
        self._cancel()
        self._phase = key
        timeout = {
            IDLE: self.LIMITS.idle_timeout_s,
            HEADERS: self.LIMITS.header_timeout_s,
            BODY: self.LIMITS.body_timeout_s,
        }.get(phase)
        if timeout is not None and timeout > 0:
            self._deadline = self.loop.call_later(timeout, self._expired, key)

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _stall_expired(self) -> None:
        self._stalled = None
        if not self.transport.is_closing():
            self.transport.abort()  # its buffer will not drain: drop it, do not wait on it

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, key: tuple[object, str]) -> None:
        self._deadline = None
        if key is not self._phase or self.transport.is_closing():
            return
        phase = key[1]
        started = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if phase in (HEADERS, BODY) and not started:
            what = "headers" if phase == HEADERS else "body"
            limit = self.LIMITS.header_timeout_s if phase == HEADERS else self.LIMITS.body_timeout_s
            message = f"the request {what} did not arrive within {limit:g} s"
            self.transport.write(
                _answer(408, "Request Timeout", "DEADLINE_EXCEEDED", ErrorReason.DEADLINE, message)
            )
        self.transport.close()  # the app, if it is reading the body, sees a disconnect


class HeadHeld(asyncio.Transport):
    """A connection's transport that holds a response's head until the next write, so that the
    head and the first body bytes written right after it (an SSE stream's first event, a JSON
    answer) leave in one TCP segment: uvicorn writes them separately, and with TCP_NODELAY each
    write is a segment of its own, for which the client (or Envoy) wakes and reads once more. A
    head that nothing follows within the event loop's turn goes out alone at the end of it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._head = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head:
            head, self._head = self._head, b""
            self._transport.write(head + data)
        elif data[:9] == b"HTTP/1.1 " and not self._transport.is_closing():
            self._head = bytes(data)
            self._loop.call_soon(self._release)
        else:
            self._transport.write(data)

    def _release(self) -> None:
        head, self._head = self._head, b""
        if head and not self._transport.is_closing():
            self._transport.write(head)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self._release()
        self._transport.close()

    def abort(self) -> None:
        self._head = b""
        self._transport.abort()

    def write_eof(self) -> None:
        self._release()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


def protocol_class(limits: Limits) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's Config(http=...), with these limits."""
    return type("GuardedProtocol", (GuardedProtocol,), {"LIMITS": limits})
