"""Generation streams kept for SSE: each upstream Generate call becomes a numbered sequence of events
in a bounded buffer, which readers (the SSE connection, then any reconnect with Last-Event-ID) read
from a position. The buffer is what makes resume exact: a reconnect continues from the event after
the one it names, so no token is lost or repeated.

Disconnect policy (docs/edge.md): when a stream's last reader leaves before the end,
- with resume_window_s > 0 the stream stops reading from gRPC at once (the producer waits for a
  reader), so the service's own flow control pauses the sequence within a few tokens (given a
  small upstream lookahead). A reader that attaches again (resume) lets it go on. If nobody
  resumes within resume_window_s the upstream call is cancelled (the service frees the sequence)
  and the stream is forgotten. An attached reader slower than the model pauses it too, once
  `resume_buffer_events` events wait unread;
- with resume_window_s == 0 the upstream call is cancelled at once.
A finished stream is kept for resume_window_s as well, so an EventSource that reconnects after the
end is told so (204) instead of starting a new generation.

Limits: `max_streams` bounds the OPEN streams (those whose upstream call still runs, attached or
kept for resume): they hold a slot upstream. Finished streams hold only their buffer, so they are
bounded by memory instead: their buffers together stay under `finished_bytes` (the encoded size
of their events), the oldest finished streams forgotten first. A one-token stream therefore costs
the limit nothing once it has ended.

Abandoned streams never lock live clients out: an open stream nobody reads (DETACHED, kept for
resume) is what gives way. One client (its credential, else its x-tenant-id, else its peer
address) keeps at most `per_client` detached streams: one more and its oldest is cancelled. And
when the open streams are at `max_streams`, a new stream cancels the oldest detached one (anyone's)
instead of being refused; only when every open stream is being read is it refused (429). A
cancelled stream is forgotten, so its resume is answered as an expired one.

Owners: a stream keeps a keyed digest of the credential that started it (its `authorization`
header); a resume with another credential, or with none, is answered as an unknown stream. A
stream started without a credential is resumed by whoever holds its id: the id is the capability,
so it is kept out of the log (log lines name a stream by its number only).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from modelyard.common import headers, names
from modelyard.gateway import errors, upstream
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.inference.v1 import inference_service_pb2 as pb

log = logging.getLogger(__name__)

TOKEN, DONE, ERROR = "token", "done", "error"
TRAILERS_WAIT_S = 5.0  # after the last event, the most a call may take to send its status
FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    name: str  # token, done or error
    wire: bytes  # the encoded event (its size is what the resume budget counts)
    # The event is kept encoded only, not also as its data: a held stream buffers up to its
    # --resume-buffer-events, and the dicts beside the bytes were most of its memory.

    @property
    def terminal(self) -> bool:
        return self.name != TOKEN


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from, as the registry keys it (Registry.caller): `owner`, a keyed digest
    of its credential (None: anonymous), which a resume must match; `client`, a keyed digest of
    the credential, else the x-tenant-id, else the peer address, under which its detached streams
    are counted. Fixed-size digests: what a client sends never grows the registry's keys."""

    owner: bytes | None = None
    client: bytes = b""


ANONYMOUS = Caller()
_NUMBERS = itertools.count(1)  # a stream's number, for log lines (its id is a capability)


class GenerateCall(Protocol):
    """What a Stream needs of a grpc.aio server-streaming call."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]: ...

    async def initial_metadata(self) -> Any: ...

    def cancel(self) -> bool: ...


class Evicted(Exception):
    """The position asked for has left the buffer."""


class Stream:
    def __init__(self, stream_id: str, model: str, bound: int, caller: Caller = ANONYMOUS) -> None:
        self.id = stream_id
        self.number = next(_NUMBERS)  # what log lines name it by
        self.model = model
        self.caller = caller
        self.headers: dict[str, str] = {}  # x-served-version, x-model-dye from the upstream call
        self.failure: errors.HttpError | None = None  # set when the call failed before any event
        self._bound = bound
        self._events: deque[Event] = deque()
        self.bytes = 0  # encoded size of the buffered events
        self._next = 0  # sequence number of the next event
        self._delivered = -1  # highest sequence number written to a reader
        self._changed = asyncio.Event()
        self._started = asyncio.Event()  # the first event, or the failure, is known
        self.readers = 0
        self.opened = False  # a 200 was sent: a failure from now on is an error event
        self.finished = False
        self.on_finished: Callable[[Stream], None] | None = None  # called once, when it finishes
        self.producer: asyncio.Task[None] | None = None
        self.call: GenerateCall | None = None  # the upstream call the producer reads
        self.expiry: asyncio.TimerHandle | None = None

    # --- the producer side ---------------------------------------------------------------------

    async def run(self, call: GenerateCall) -> None:
        """Read the upstream call to its end into the buffer (cancelled: the call is cancelled)."""
        try:
            self.headers = upstream.returned(await call.initial_metadata())
            dye = self.headers.get(headers.MODEL_DYE)
            async for response in call:
                self.headers.setdefault(headers.SERVED_VERSION, response.model_version)
                if response.token_ids or response.text:
                    token: dict[str, Any] = {
                        "text": response.text,
                        "token_ids": list(response.token_ids),
                        "index": response.sequence_number,
                        "model_version": response.model_version,
                    }
                    if dye and self._next == 0:  # for EventSource, which cannot read headers
                        token["model_dye"] = dye
                    await self._append(TOKEN, token)
                    if self._next == 1:
                        # The first event: let the request waiting for it answer (headers and
                        # event written) before this task asks gRPC for the next message.
                        await asyncio.sleep(0)
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    await self._append(DONE, {**done_data(response), "model_dye": dye or ""})
            if not self.finished:  # the upstream ended without a final event: a fault upstream
                await self._fail(errors.HttpError(502, "INTERNAL", "internal", "stream ended without done"))
        except grpc.aio.AioRpcError as exc:
            await self._fail(errors.from_rpc_error(exc))
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            self._started.set()

    async def _fail(self, error: errors.HttpError) -> None:
        if self._next == 0 and not self.opened:
            self.failure = error
            self._finish()
            return
        data = {"status": error.status, "code": error.code, "reason": error.reason, "message": error.message}
        await self._append(ERROR, data)

    def abort(self, error: errors.HttpError) -> None:
        """End the stream now with an error event (the gateway is shutting down)."""
        if self.finished:
            return
        data = {"status": error.status, "code": error.code, "reason": error.reason, "message": error.message}
        self._push(ERROR, data)
        self._finish()
        self._started.set()
        self._wake()

    async def _append(self, name: str, data: dict[str, Any]) -> None:
        # Nobody attached (the client left, a resume may come), or full of events nobody has read
        # yet: pause. The upstream call stops being read, so the service pauses the sequence
        # (within the few tokens the HTTP/2 windows hold) until a reader comes back or catches
        # up, or the stream expires and is cancelled.
        while self.readers <= 0 or (
            len(self._events) >= self._bound and self._events[0].seq > self._delivered
        ):
            await self._wait()
        if len(self._events) >= self._bound:
            self.bytes -= len(self._events.popleft().wire)
        self._push(name, data)
        if name != TOKEN:
            self._finish()
        self._started.set()
        self._wake()

    def _finish(self) -> None:
        """The last event is in the buffer (or the call failed, or it was given up)."""
        if not self.finished:
            self.finished = True
            if self.on_finished is not None:
                self.on_finished(self)

    def _push(self, name: str, data: dict[str, Any]) -> None:
        event = Event(self._next, name, encode(self.id, self._next, name, data))
        self._events.append(event)
        self.bytes += len(event.wire)
        self._next += 1

    # --- the reader side -----------------------------------------------------------------------

    async def started(self) -> None:
        await self._started.wait()

    @property
    def next_seq(self) -> int:
        return self._next

    def since(self, seq: int) -> list[Event]:
        """Buffered events from `seq` on; Evicted if `seq` has already left the buffer."""
        if not self._events:
            return []
        offset = seq - self._events[0].seq
        if offset < 0:
            raise Evicted(seq)
        return list(itertools.islice(self._events, offset, None))  # sequence numbers are contiguous

    def event(self, seq: int) -> Event | None:
        offset = seq - self._events[0].seq if self._events else -1
        return self._events[offset] if 0 <= offset < len(self._events) else None

    def resumed(self) -> None:
        """A reader is attached again: a producer paused for want of one goes on."""
        self._wake()

    def delivered(self, seq: int) -> None:
        if seq > self._delivered:
            self._delivered = seq
            self._wake()

    async def wait_change(self, within_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self) -> None:
        await self._changed.wait()


def done_data(response: pb.GenerateResponse) -> dict[str, Any]:
    usage = response.usage
    return {
        "finish_reason": FINISH_REASONS.get(response.finish_reason, "unspecified"),
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
        "time_to_first_token_ms": response.time_to_first_token.ToNanoseconds() / 1e6,
        "model_version": response.model_version,
    }


def format_id(stream_id: str, seq: int) -> str:
    return f"{stream_id}:{seq}"


def parse_id(text: str) -> tuple[str, int]:
    stream_id, _, seq = text.strip().rpartition(":")
    if not stream_id or not seq.isascii() or not seq.isdigit() or len(seq) > 18:
        raise ValueError(
            f"Last-Event-ID {names.echo(text)} is not an event id of this gateway (<stream>:<seq>)"
        )
    return stream_id, int(seq)


def encode(stream_id: str, seq: int, name: str, data: dict[str, Any]) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {format_id(stream_id, seq)}\nevent: {name}\ndata: {text}\n\n".encode()


class Registry:
    """The streams held by this process: open ones (at most `limit`) until they end and expire,
    finished ones until they expire or their buffers are over `finished_bytes` together."""

    def __init__(
        self,
        window_s: float,
        bound: int,
        limit: int,
        metrics: GatewayMetrics,
        finished_bytes: int = 64 << 20,
        per_client: int = 8,
    ) -> None:
        self.window_s = window_s
        self.bound = bound
        self.limit = limit
        self.finished_bytes = finished_bytes
        self.per_client = per_client
        self.metrics = metrics
        self._key = secrets.token_bytes(32)  # this process's digests of credentials and clients
        self._streams: dict[str, Stream] = {}
        # Open streams that nobody reads (kept for resume), oldest detach first, and the same by
        # client: what gives way to live streams. Entries exist only while a stream is detached.
        self._detached: dict[str, Stream] = {}
        self._detached_by: dict[bytes, dict[str, Stream]] = {}
        self._open = 0  # streams that have not sent their last event (nor been given up)
        # Finished streams still held, oldest first, and the size of their buffers together.
        self._finished: dict[str, Stream] = {}
        self._finished_size = 0

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def open(self) -> int:
        return self._open

    @property
    def finished_size(self) -> int:
        return self._finished_size

    @property
    def detached(self) -> int:
        """Open streams nobody reads (kept for resume)."""
        return len(self._detached)

    def detached_by(self, caller: Caller) -> int:
        return len(self._detached_by.get(caller.client, ()))

    def caller(self, authorization: str, tenant: str, peer: str) -> Caller:
        """The Caller of a request with these headers from this peer address (host only: every
        connection of a client has its own port)."""
        owner = self._digest(b"credential", authorization) if authorization else None
        if owner is not None:
            return Caller(owner, owner[:16])
        if tenant:
            return Caller(None, self._digest(b"tenant", tenant)[:16])
        return Caller(None, self._digest(b"peer", peer)[:16])

    def _digest(self, kind: bytes, value: str) -> bytes:
        return hmac.new(
            self._key, kind + b"\0" + value.encode("utf-8", "surrogateescape"), hashlib.sha256
        ).digest()

    @staticmethod
    def may_resume(stream: Stream, caller: Caller) -> bool:
        """Whether `caller` may read `stream`: it started without a credential (its id is the
        capability), or the caller presents the same one (compared in constant time)."""
        owner = stream.caller.owner
        if owner is None:
            return True
        return caller.owner is not None and hmac.compare_digest(owner, caller.owner)

    def get(self, stream_id: str) -> Stream | None:
        return self._streams.get(stream_id)

    def start(self, model: str, call: GenerateCall, caller: Caller = ANONYMOUS) -> Stream:
        """A new stream reading `call`, with one reader attached (the request that started it). At
        the limit of open streams, the oldest detached stream gives way; with none, 429."""
        if self._open >= self.limit:
            oldest = next(iter(self._detached.values()), None)
            if oldest is None:
                call.cancel()
                raise errors.overloaded(f"the gateway has {self.limit} streams open, its limit")
            self._evict(oldest, "full")
        stream = Stream(secrets.token_urlsafe(12), model, self.bound, caller)
        self._streams[stream.id] = stream
        stream.readers = 1
        self._open += 1
        stream.on_finished = self._finished_one
        stream.call = call
        stream.producer = asyncio.get_running_loop().create_task(stream.run(call))
        stream.producer.add_done_callback(lambda _: self._ended(stream))
        self._gauges()
        return stream

    def attach(self, stream: Stream) -> None:
        stream.readers += 1
        self._undetach(stream)
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        stream.resumed()

    def detach(self, stream: Stream) -> None:
        stream.readers -= 1
        if stream.readers > 0:
            return
        if self.window_s <= 0 or stream.failure is not None:
            self.drop(stream)
            return
        if stream.expiry is None and stream.id in self._streams:
            stream.expiry = asyncio.get_running_loop().call_later(self.window_s, self._expire, stream)
        if not stream.finished and stream.id in self._streams:
            self._detach_open(stream)

    def _detach_open(self, stream: Stream) -> None:
        """An open stream is left unread: count it against its client, whose oldest detached
        stream is cancelled past `per_client`."""
        self._detached[stream.id] = stream
        mine = self._detached_by.setdefault(stream.caller.client, {})
        mine[stream.id] = stream
        while len(mine) > self.per_client:
            self._evict(next(iter(mine.values())), "client")
        self._gauges()

    def _undetach(self, stream: Stream) -> None:
        """It is read again, has finished, or is dropped: no longer held detached."""
        if self._detached.pop(stream.id, None) is None:
            return
        client = stream.caller.client
        mine = self._detached_by.get(client)
        if mine is not None:
            mine.pop(stream.id, None)
            if not mine:
                del self._detached_by[client]

    def _evict(self, stream: Stream, cause: str) -> None:
        """Cancel a detached stream's upstream call and forget it (its resume: unknown or expired),
        so that its place and its slot upstream go to a live stream. It counts as ended at once."""
        self.metrics.evicted.labels(cause).inc()
        log.debug("detached stream #%d cancelled (%s)", stream.number, cause)
        self.drop(stream)
        stream._finish()

    def drop(self, stream: Stream, at_once: bool = False) -> None:
        """Forget the stream and cancel its upstream call if it still runs. A call whose last event
        is in is left to end by itself (its OK status follows at once): cancelling it would make
        the service and the sidecar count a cancel for a stream read to its end. Only a call that
        outstays TRAILERS_WAIT_S, or any call when `at_once` (shutdown), is cancelled."""
        if stream.expiry is not None:
            stream.expiry.cancel()
            stream.expiry = None
        producer = stream.producer
        if producer is not None and not producer.done():
            if stream.finished and not at_once:
                late = asyncio.get_running_loop().call_later(TRAILERS_WAIT_S, producer.cancel)
                producer.add_done_callback(lambda _: late.cancel())
            else:
                producer.cancel()
                if stream.call is not None:  # also when the producer never ran (its except did not)
                    stream.call.cancel()
                if not stream.finished:
                    self.metrics.cancelled.inc()
        if self._finished.pop(stream.id, None) is not None:
            self._finished_size -= stream.bytes
        self._undetach(stream)
        self._streams.pop(stream.id, None)
        self._gauges()

    def _expire(self, stream: Stream) -> None:
        stream.expiry = None
        if stream.readers == 0:
            log.debug("stream #%d expired", stream.number)
            self.drop(stream)

    def _gauges(self) -> None:
        self.metrics.streams.set(len(self._streams))
        self.metrics.open_streams.set(self._open)
        self.metrics.detached_streams.set(len(self._detached))
        self.metrics.finished_bytes.set(self._finished_size)

    def _ended(self, stream: Stream) -> None:
        """Its producer is done (ended, failed or cancelled)."""
        stream._finish()
        if stream.readers == 0 and stream.expiry is None and stream.id in self._streams:
            stream.expiry = asyncio.get_running_loop().call_later(self.window_s, self._expire, stream)

    def _finished_one(self, stream: Stream) -> None:
        self._open -= 1
        self._undetach(stream)  # its upstream call is over: it holds nothing upstream any more
        self._gauges()
        if stream.id not in self._streams:
            return
        # Its buffer no longer changes: count it against the finished streams' budget, and make
        # room by forgetting the oldest finished ones (their readers, if any, keep their copy).
        self._finished[stream.id] = stream
        self._finished_size += stream.bytes
        while self._finished_size > self.finished_bytes and self._finished:
            oldest = next(iter(self._finished.values()))
            log.debug(
                "stream #%d forgotten: finished streams are over %d bytes", oldest.number, self.finished_bytes
            )
            self.drop(oldest)
        self._gauges()

    def close(self) -> None:
        """Shutting down: every open stream ends with an error event, every upstream call is cancelled."""
        draining = errors.HttpError(503, "UNAVAILABLE", "draining", "the gateway is shutting down", 1)
        for stream in list(self._streams.values()):
            self.drop(stream, at_once=True)  # first, so a call cut mid-generation is counted as cancelled
            stream.abort(draining)
