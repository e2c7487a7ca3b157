"""The forwarder: moves one attempt's bytes and metadata between the caller and an upstream.

For the four call kinds: a call with one response (unary-unary, stream-unary: `ask`, then
`answer`) and a call with a response stream (unary-stream, stream-stream: `opened`, then
`relay`). `ask` and `opened` are the proxy's attempt loop's exchanges: same arguments, an answer
or `Failed`. Messages are bytes, never decoded; the upstream's response metadata, trailers and
full status (code, message, trailers) pass through. An attempt the upstream answered with an
error raises `Failed`; what the caller then gets is `client_status` (a status message capped,
a reason where the upstream gave none). Which upstream, which version, whether to try again:
the layers' business (layers/), not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.sidecar.layers import retry
from modelyard.sidecar.layers.read import Metadata
from modelyard.sidecar.scope import Flight
from modelyard.sidecar.upstreams import Upstream

Context = grpc.aio.ServicerContext[bytes, bytes]
Request = bytes | AsyncIterator[bytes]  # one message, or the caller's stream of them

# A trailers-only answer comes as empty headers whose status completes a moment later (a separate
# completion in grpc.aio, which a busy loop may run some milliseconds after): how long to wait
# for it when a stream's headers are empty. Streams that send their own headers pay nothing.
TRAILERS_ONLY_WAIT_S = 0.1
MESSAGE_MAX = 1024  # characters of an upstream's status message passed on (then `...`)
_RUN_US = headers.RUN_US
# A reason for every error the client gets: an upstream or gRPC itself may answer without one
# (an unreachable upstream, a transport limit); docs/api.md's reading of a reason-less status.
_REASON_OF_CODE = {
    grpc.StatusCode.UNAVAILABLE: ErrorReason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorReason.DEADLINE,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorReason.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorReason.TOO_LARGE,
    grpc.StatusCode.INTERNAL: ErrorReason.INTERNAL,
    grpc.StatusCode.UNKNOWN: ErrorReason.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED: ErrorReason.UNSUPPORTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorReason.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED: ErrorReason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: ErrorReason.PERMISSION_DENIED,
}


class Failed(Exception):
    """The upstream answered an attempt with an error status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing

    @property
    def reason(self) -> str:
        return error_reason(self.trailing)


class EndedEarly(Failed):
    """A response stream's attempt ended with an error and nothing else (a trailers-only answer:
    nothing has reached the caller). `call`, ended: when it is not retried, its relay answers
    the error as it answers any a stream ends with."""

    def __init__(self, call: Any, failed: Failed) -> None:
        super().__init__(failed.code, failed.details, failed.trailing)
        self.call = call


def error_reason(trailing: Iterable[Any] | None) -> str:
    for key, value in trailing or ():
        if key == headers.ERROR_REASON:
            return value if isinstance(value, str) else value.decode()
    return ""


def run_seconds(trailing: Iterable[Any] | None) -> float | None:
    """The upstream's own measure of a unary answer's run (x-run-us: its run on its thread, or its
    batch's; docs/api.md), in seconds, or None when the answer carries none (an older service, a
    fake) or an unreadable one. Another version in the same service cannot inflate it, as it
    inflates the call's duration; its queue (x-queue-us) is left out: with callers spread over the
    versions' own queues by chance, the queues' lengths swing apart (docs/sidecar.md)."""
    for key, value in trailing or ():
        if key == _RUN_US:
            try:
                micros = int(value)
            except (TypeError, ValueError):
                return None
            return micros / 1e6 if micros >= 0 else None
    return None


def is_fault(code: grpc.StatusCode, trailing: Iterable[Any] | None) -> bool:
    """Whether an answer counts against the upstream: the retry policy's rule (retry.is_fault)."""
    return retry.is_fault(code.name, error_reason(trailing))


def client_status(
    code: grpc.StatusCode, details: str, trailing: Iterable[Any] | None
) -> tuple[grpc.StatusCode, str, Metadata]:
    """What the client gets for an upstream's error: its status message capped at MESSAGE_MAX,
    and a reason where it had none (docs/api.md's reading of the bare code). A CANCELLED that the
    client did not ask for (the upstream went away mid-call) is UNAVAILABLE/`unavailable`."""
    md: Metadata = tuple((key, value) for key, value in trailing or ())
    if len(details) > MESSAGE_MAX:
        details = details[:MESSAGE_MAX] + "..."
    if not error_reason(md):
        if code == grpc.StatusCode.CANCELLED:
            code, details = grpc.StatusCode.UNAVAILABLE, f"the upstream ended the call: {details}"
        reason = _REASON_OF_CODE.get(code)
        if reason is not None:
            md = (*md, (headers.ERROR_REASON, reason.value))
    return code, details, md


async def requests(
    first: bytes | None, more: AsyncIterator[bytes] | None, body: Callable[[bytes], bytes]
) -> AsyncIterator[bytes]:
    """The caller's request stream (its first message already read), each message through `body`."""
    if first is None:
        return
    yield body(first)
    if more is not None:
        async for message in more:
            yield body(message)


def with_metadata(received: Iterable[Any] | None, added: Metadata) -> Metadata:
    return (*(received or ()), *added)


class Outgoing(tuple[tuple[str, str | bytes], ...], grpc.aio.Metadata):  # type: ignore[misc]
    """An attempt's request metadata as grpc.aio takes it without a Python step per entry: a
    tuple (what its call hands gRPC's core) that is a grpc.aio.Metadata (which its multicallable
    keeps as it is). A plain tuple is made a Metadata first (Metadata.add per entry) and then a
    tuple again (Metadata.__iter__, a generator, per entry): Python steps for each entry of every
    attempt, where this hands the tuple on as it is. Iterated and counted as the tuple; read by
    key (an interceptor, a test's fake) as a Metadata of the same entries; never changed."""

    __slots__ = ()

    @property
    def _metadata(self) -> OrderedDict[str, list[str | bytes]]:  # what Metadata's reads read
        found: OrderedDict[str, list[str | bytes]] = OrderedDict()
        for key, value in tuple.__iter__(self):
            found.setdefault(key, []).append(value)
        return found

    __getitem__ = grpc.aio.Metadata.__getitem__  # type: ignore[assignment]
    __contains__ = grpc.aio.Metadata.__contains__
    __repr__ = grpc.aio.Metadata.__repr__

    def _read_only(self, *_: Any) -> NoReturn:
        raise TypeError("an attempt's request metadata is not changed once made")

    add = __setitem__ = __delitem__ = set_all = delete_all = _read_only  # type: ignore[assignment]


# tuple.__new__ alone (a C call): Metadata's __init__ is not run.
outgoing: Callable[[Metadata], Outgoing] = functools.partial(tuple.__new__, Outgoing)


# --- calls with one response: unary-unary, stream-unary ------------------------------------


async def ask(
    upstream: Upstream,
    path: str,
    kind: str,
    request: Request,
    metadata: Metadata,
    time_left: float | None,
    flight: Flight,
) -> tuple[bytes, Metadata, Any]:
    """One attempt with one response, started (`start`) and awaited: the upstream's response,
    headers and trailers once the call has finished; `Failed` for an error. The caller gets them
    by `answer`, once the scope has given the attempt's verdict."""
    call = start(upstream, path, kind, request, metadata, time_left, flight)
    try:
        response: bytes = await call
    except grpc.aio.AioRpcError as exc:
        raise Failed(exc.code(), exc.details() or "", exc.trailing_metadata()) from exc
    core = getattr(call, "_cython_call", None)
    if core is None:  # not grpc.aio's own call (a test's fake): its public reads
        initial = await call.initial_metadata()
        return response, tuple(initial) if initial else (), await call.trailing_metadata()
    # grpc.aio's call over gRPC's core (grpcio is pinned): its headers and trailers as the tuples
    # the core gave them, not each made a Metadata (a Python step per entry, and two coroutines)
    # to be taken apart again by `answer`.
    return response, await core.initial_metadata(), (await core.status()).trailing_metadata()


def answer(context: Context, trailing: Iterable[Any] | None, added: Metadata) -> None:
    """The upstream's trailers with the sidecar's own (`added`: x-model-dye, x-dye-fallback) to
    the caller (its headers, when it sent any, go first: `context.send_initial_metadata`). A
    unary answer's sidecar headers ride in the trailing metadata, beside the service's
    x-served-version (docs/api.md): grpc.aio sends initial metadata that a handler sets as a batch
    of its own (a write, and its completion, for every call), while the trailing metadata goes in
    the answer's final batch. A plain function, not a coroutine: nothing here waits."""
    md = (*trailing, *added) if trailing else added  # with_metadata, inline
    if md:
        context.set_trailing_metadata(md)


# --- calls with a response stream: unary-stream, stream-stream -----------------------------


def start(
    upstream: Upstream,
    path: str,
    kind: str,
    request: Request,
    metadata: Metadata,
    time_left: float | None,
    flight: Flight,
) -> Any:
    """One attempt's call, started: `ask` awaits it (one response); a response stream is
    `relay`ed (after `ended_early`)."""
    call = upstream.method(path, kind)(request, metadata=outgoing(metadata), timeout=time_left)
    flight.follow(call)
    return call


async def opened(
    upstream: Upstream,
    path: str,
    kind: str,
    request: Request,
    metadata: Metadata,
    time_left: float | None,
    flight: Flight,
) -> Any:
    """A response stream's attempt, started (`start`), once it is known not to have ended before
    its first message: `EndedEarly` when it did (`ended_early`), so that it may be retried."""
    call = start(upstream, path, kind, request, metadata, time_left, flight)
    early = await ended_early(call)
    if early is not None:
        raise EndedEarly(call, early)
    return call


async def opened_unchecked(
    upstream: Upstream,
    path: str,
    kind: str,
    request: Request,
    metadata: Metadata,
    time_left: float | None,
    flight: Flight,
) -> Any:
    """A response stream's attempt, started, for a method never retried (the caller streams its
    requests): its relay tells how it ends."""
    return start(upstream, path, kind, request, metadata, time_left, flight)


async def ended_early(call: Any) -> Failed | None:
    """The upstream's error when it answered the call with a status and nothing else (a
    trailers-only answer): nothing has reached the caller yet. None while the call goes on."""
    initial = await call.initial_metadata()
    if not initial and not call.done():
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ended(_: object) -> None:
            if not finished.done():
                finished.set_result(None)

        call.add_done_callback(ended)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished, TRAILERS_ONLY_WAIT_S)
    if not call.done():
        return None
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return None
    return Failed(code, await call.details() or "", await call.trailing_metadata())


# After a write fails in gRPC's core, the most its word that the caller cancelled may take.
CANCEL_WAIT_S = 5.0


async def send(messages: AsyncGenerator[bytes, None], context: Context) -> None:
    """Write the call's response stream to the caller. A caller that cancels while a write waits
    on flow control (it stopped reading) fails that write before gRPC has marked the call
    cancelled, which gRPC would log as an ERROR with a traceback. The cancellation follows at
    once: wait for it, so the call ends as the cancel it is. The stream is closed however the
    call ends (a cancelled one cancels its upstream call at once)."""
    async with aclosing(messages):
        async for message in messages:
            try:
                await context.write(message)
            except grpc.aio.InternalError:  # ExecuteBatchError: the write batch failed in core
                await asyncio.sleep(CANCEL_WAIT_S)  # cancelled meanwhile, by gRPC
                raise


async def relay(call: Any, context: Context, added: Metadata) -> AsyncIterator[bytes]:
    """The upstream's response headers (with the sidecar's own), messages and trailers to the
    caller; `Failed` when the upstream ends the stream with an error."""
    try:
        initial = await call.initial_metadata()
        await context.send_initial_metadata(with_metadata(initial, added))
        async for message in call:
            yield message
        trailing = await call.trailing_metadata()
    except grpc.aio.AioRpcError as exc:
        raise Failed(exc.code(), exc.details() or "", exc.trailing_metadata()) from exc
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
