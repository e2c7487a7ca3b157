"""What every call passes before its servicer: authorization, and a request that parsed.

`decode_guard` is one of the request pipeline's wrappers (service/api/pipeline.py; the order is
stated in service/server.py): every method handler of the servicers passes through it.

- Authorization: a guard (service/api/access.py) chosen per method at registration runs first
  and aborts the call (UNAUTHENTICATED / PERMISSION_DENIED) when it is not allowed.
- Parsing after the guard: the wrapped handlers are registered without a request deserializer,
  so gRPC hands them the message's bytes, and they parse only once the guard has admitted the
  call: an unauthenticated caller's message, however large, is never parsed. A guarded unary
  method is registered as request-streaming, so that its message is not even read before the
  guard (gRPC reads a unary call's message before its handler runs). A message over
  STEPPED_PARSE_BYTES is parsed in steps (service/api/parsing.py: protobuf's parser holds the
  GIL, so a thread would not free the loop), so it does not hold every other call.
- Undecodable requests: a parse failure inside grpc.aio answers UNKNOWN and logs a full
  traceback per request (a log flood on demand). The wrappers parse with a deserializer that
  never raises (it returns `Undecodable`), and refuse an `Undecodable` request with
  INVALID_ARGUMENT before the servicer sees it.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.api.errors import Context
from service.api.parsing import message_class, parse_in_steps
from service.api.pipeline import Handler, Wrapper

# Called with the full method name of each refused message (logs and metrics, rate-limited there).
OnUndecodable = Callable[[str], None]
# Runs before the servicer; aborts the call when the caller may not make it.
Guard = Callable[[Context], Awaitable[None]]
# The guard of a method (by its full name), or None for a method open to every caller.
GuardFor = Callable[[str], Guard | None]


class Undecodable:
    """Stands for a request whose bytes are not a valid message of the method's request type."""

    __slots__ = ()


_UNDECODABLE = Undecodable()
# Messages larger than this are parsed in steps, the event loop running between them.
STEPPED_PARSE_BYTES = 1024 * 1024


def _never_raises(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    if deserialize is None:
        return lambda data: data

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # protobuf's DecodeError, or anything a parser raises on bad bytes
            return _UNDECODABLE

    return parse


def decode_guard(on_undecodable: OnUndecodable, guard_for: GuardFor | None = None) -> Wrapper:
    """The pipeline's guard (service/api/pipeline.py): authorization, then the request parsed."""
    guard_of = guard_for or (lambda method: None)

    def wrap(method: str, handler: Handler) -> Handler:
        refuse = _Refuse(method, on_undecodable, guard_of(method), handler.request_deserializer)
        return _guarded(handler, refuse)

    return wrap


def _guarded(original: Handler, refuse: _Refuse) -> Handler:
    handler: Any = original  # a namedtuple (grpc's stubs do not say so)
    # No deserializer: the wrappers get bytes, and parse them once the guard has admitted the call.
    behaviors: dict[str, Any] = {"request_deserializer": None}
    if refuse.guarded and handler.unary_unary is not None:
        # gRPC reads a unary call's message before its handler runs; a request-streaming
        # handler reads it when asked: after the guard (a refused caller's message is never
        # read, and flow control holds the rest of it at the client).
        behaviors.update(
            request_streaming=True, unary_unary=None, stream_unary=_unary_after_guard(handler, refuse)
        )
    elif refuse.guarded and handler.unary_stream is not None:
        behaviors.update(
            request_streaming=True, unary_stream=None, stream_stream=_unary_after_guard(handler, refuse)
        )
    elif handler.unary_unary is not None:
        behaviors["unary_unary"] = _unary_unary(handler.unary_unary, refuse)
    elif handler.unary_stream is not None:
        behaviors["unary_stream"] = _unary_stream(handler.unary_stream, refuse)
    elif handler.stream_unary is not None:
        behaviors["stream_unary"] = _stream_request(handler.stream_unary, refuse)
    elif handler.stream_stream is not None:
        behaviors["stream_stream"] = _stream_request(handler.stream_stream, refuse)
    replaced: Handler = handler._replace(**behaviors)
    return replaced


class _Refuse:
    """A method's checks: `admit` (the guard) at the start of a call, `parse` of each request's
    bytes (after admit), `check` of each parsed request."""

    __slots__ = ("_class", "_deserialize", "_guard", "_kind", "_method", "_on_undecodable")

    def __init__(
        self,
        method: str,
        on_undecodable: OnUndecodable,
        guard: Guard | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        self._method = method
        self._kind = method.rsplit("/", 1)[-1]
        self._on_undecodable = on_undecodable
        self._guard = guard
        self._deserialize = _never_raises(deserializer)
        self._class = message_class(deserializer)  # protobuf: large messages parsed in steps

    @property
    def guarded(self) -> bool:
        return self._guard is not None

    async def admit(self, context: Context) -> None:
        if self._guard is not None:
            await self._guard(context)

    async def parse(self, raw: Any) -> Any:
        if not isinstance(raw, bytes) or len(raw) <= STEPPED_PARSE_BYTES:
            return self._deserialize(raw)
        if self._class is None:  # another parser: it may let go of the GIL in a thread
            return await asyncio.get_running_loop().run_in_executor(None, self._deserialize, raw)
        try:
            return await parse_in_steps(self._class, raw)
        except Exception:  # DecodeError, Malformed
            return _UNDECODABLE

    async def check(self, request: Any, context: Context) -> None:
        if request is _UNDECODABLE:
            self._on_undecodable(self._method)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the {self._kind} request is not a valid message"
            )

    async def admitted_message(self, raw: Any, context: Context) -> Any:
        """A request's bytes parsed and checked."""
        request = await self.parse(raw)
        await self.check(request, context)
        return request

    async def admitted(self, raw: Any, context: Context) -> Any:
        """The request of a unary call: the guard first, then the bytes parsed and checked."""
        await self.admit(context)
        return await self.admitted_message(raw, context)


def _forget_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames in `error`'s traceback and in those of the errors
    it chains. grpc.aio keeps the exception of an aborted call (and so, through its traceback,
    the servicer's frames and the request they hold: tens of MB for a large message) for as
    long as it keeps the call's state."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen or len(seen) > 16:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # running frames are left alone
        pending += [current.__context__, current.__cause__]


def _unary_unary(inner: Any, refuse: _Refuse) -> Any:
    async def call(raw: Any, context: Context) -> Any:
        # Not a local while the servicer runs: an aborted call's traceback keeps this frame.
        box = [raw]
        del raw
        try:
            return await inner(await refuse.admitted(box.pop(), context), context)
        except BaseException as exc:
            _forget_locals(exc)
            raise

    return call


def _unary_stream(inner: Any, refuse: _Refuse) -> Any:
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: a coroutine

        async def write(raw: Any, context: Context) -> Any:
            box = [raw]  # not a local while the servicer runs (see call above)
            del raw
            return await inner(await refuse.admitted(box.pop(), context), context)

        return write

    async def stream(raw: Any, context: Context) -> AsyncIterator[Any]:
        box = [raw]  # not a local while the servicer runs (see call above)
        del raw
        async for response in inner(await refuse.admitted(box.pop(), context), context):
            yield response

    return stream


def _unary_after_guard(handler: Any, refuse: _Refuse) -> Any:
    """A unary-request method as a request-streaming handler: the guard, then its one message."""

    async def request(raws: AsyncIterator[Any], context: Context) -> Any:
        await refuse.admit(context)
        try:
            raw = await anext(raws)
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")
        finally:
            # A wrapping generator (the size check's) left suspended would keep the bytes alive.
            close = getattr(raws, "aclose", None)
            if close is not None:
                await close()
        return await refuse.admitted_message(raw, context)

    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def call(raws: AsyncIterator[Any], context: Context) -> Any:
            try:
                return await unary(await request(raws, context), context)
            except BaseException as exc:
                _forget_locals(exc)
                raise

        return call
    inner: Any = handler.unary_stream
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: a coroutine

        async def write(raws: AsyncIterator[Any], context: Context) -> Any:
            return await inner(await request(raws, context), context)

        return write

    async def stream(raws: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for response in inner(await request(raws, context), context):
            yield response

    return stream


def _stream_request(inner: Any, refuse: _Refuse) -> Any:
    async def checked(raws: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for raw in raws:
            request = await refuse.parse(raw)
            await refuse.check(request, context)
            yield request

    if inspect.isasyncgenfunction(inner):

        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            await refuse.admit(context)
            async for response in inner(checked(requests, context), context):
                yield response

        return stream

    async def call(requests: AsyncIterator[Any], context: Context) -> Any:
        await refuse.admit(context)
        return await inner(checked(requests, context), context)

    return call
