"""What every call passes before its servicer: authorization, and a request that parsed.

`authorize` and `decode_guard` are two of the request pipeline's wrappers
(service/api/pipeline.py; the order is stated in service/server.py): every method handler of
the servicers passes through both, authorize outermost and decode_guard inside the size check.

- Authorization: a guard (service/api/credentials.py) chosen per method at registration runs first
  and aborts the call (UNAUTHENTICATED / PERMISSION_DENIED) when it is not allowed. A guarded
  unary method is registered as request-streaming, so that its message is not even read before
  the guard (gRPC reads a unary call's message before its handler runs).
- Parsing after the guard: decode_guard hands on its handlers without a request deserializer,
  so gRPC hands the message's bytes to the wrappers outside it, and it parses them only once
  they have passed them: an unauthenticated caller's message, however large, is never parsed.
  A message over STEPPED_PARSE_BYTES is parsed in steps (service/api/parsing.py: protobuf's
  parser holds the GIL, so a thread would not free the loop), so it does not hold every other
  call.
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
from contextlib import aclosing
from typing import Any

import grpc

from modelyard.service.api.errors import Context
from modelyard.service.api.parsing import TooManyFields, message_class, parse_in_steps
from modelyard.service.api.pipeline import Handler, Wrapper

# Called with the full method name of each refused message (logs and metrics, rate-limited there).
OnUndecodable = Callable[[str], None]
# Runs before the servicer; aborts the call when the caller may not make it.
Guard = Callable[[Context], Awaitable[None]]
# The guard of a method (by its full name), or None for a method open to every caller.
GuardFor = Callable[[str], Guard | None]


class Undecodable:
    """Stands for a request whose bytes are not a valid message of the method's request type;
    `why`, when the bytes break one of our bounds rather than the encoding."""

    __slots__ = ("why",)

    def __init__(self, why: str = "") -> None:
        self.why = why


_UNDECODABLE = Undecodable()
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc's type stubs
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


def authorize(guard_for: GuardFor | None) -> Wrapper:
    """The pipeline's authorization (service/api/pipeline.py): a method's guard runs before
    anything else of its call, its message included."""

    def wrap(method: str, handler: Handler) -> Handler:
        guard = guard_for(method) if guard_for is not None else None
        return handler if guard is None else _after_guard(handler, guard)

    return wrap


def decode_guard(on_undecodable: OnUndecodable) -> Wrapper:
    """The pipeline's decode guard (service/api/pipeline.py): the request parsed, undecodable
    bytes refused."""

    def wrap(method: str, original: Handler) -> Handler:
        handler: Any = original  # a namedtuple (grpc's stubs do not say so)
        refuse = _Refuse(method, on_undecodable, handler.request_deserializer)
        # No deserializer: the wrappers get bytes, and parse them (after the wrappers outside).
        behaviors: dict[str, Any] = {"request_deserializer": None}
        if handler.unary_unary is not None:
            behaviors["unary_unary"] = _unary_unary(handler.unary_unary, refuse)
        elif handler.unary_stream is not None:
            behaviors["unary_stream"] = _unary_stream(handler.unary_stream, refuse)
        elif handler.stream_unary is not None:
            behaviors["stream_unary"] = _stream_request(handler.stream_unary, refuse)
        elif handler.stream_stream is not None:
            behaviors["stream_stream"] = _stream_request(handler.stream_stream, refuse)
        replaced: Handler = handler._replace(**behaviors)
        return replaced

    return wrap


class _Refuse:
    """A method's decoding: `parse` of each request's bytes, `check` of each parsed request."""

    __slots__ = ("_class", "_deserialize", "_kind", "_method", "_on_undecodable")

    def __init__(
        self, method: str, on_undecodable: OnUndecodable, deserializer: Callable[[bytes], Any] | None
    ) -> None:
        self._method = method
        self._kind = method.rsplit("/", 1)[-1]
        self._on_undecodable = on_undecodable
        self._deserialize = _never_raises(deserializer)
        self._class = message_class(deserializer)  # protobuf: large messages parsed in steps

    async def parse(self, raw: Any) -> Any:
        if not isinstance(raw, bytes) or len(raw) <= STEPPED_PARSE_BYTES:
            return self._deserialize(raw)
        if self._class is None:  # another parser: it may let go of the GIL in a thread
            return await asyncio.get_running_loop().run_in_executor(None, self._deserialize, raw)
        try:
            return await parse_in_steps(self._class, raw)
        except TooManyFields as exc:
            return Undecodable(str(exc))
        except Exception:  # DecodeError, Malformed
            return _UNDECODABLE

    async def check(self, request: Any, context: Context) -> None:
        if isinstance(request, Undecodable):
            self._on_undecodable(self._method)
            why = f": {request.why}" if request.why else ""
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the {self._kind} request is not a valid message{why}"
            )

    async def message(self, raw: Any, context: Context) -> Any:
        """A request's bytes parsed and checked: a small message (nearly every one) with no
        awaits of parse's and check's own (two coroutines fewer per call)."""
        if isinstance(raw, bytes) and len(raw) <= STEPPED_PARSE_BYTES:
            request = self._deserialize(raw)
        else:
            request = await self.parse(raw)
        if isinstance(request, Undecodable):
            await self.check(request, context)
        return request


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
    deserialize = refuse._deserialize

    async def call(raw: Any, context: Context) -> Any:
        # Not a local while the servicer runs: an aborted call's traceback keeps this frame.
        box = [raw]
        del raw
        try:
            # A small message (nearly every one) is parsed here, without message()'s coroutine;
            # the box holds it, not a local (as above).
            if isinstance(box[0], bytes) and len(box[0]) <= STEPPED_PARSE_BYTES:
                request: Any = deserialize(box.pop())
                if isinstance(request, Undecodable):
                    await refuse.check(request, context)
                box.append(request)
                del request
            else:
                box.append(await refuse.message(box.pop(), context))
            return await inner(box.pop(), context)
        except BaseException as exc:
            _forget_locals(exc)
            raise

    return call


def _unary_stream(inner: Any, refuse: _Refuse) -> Any:
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: a coroutine

        async def write(raw: Any, context: Context) -> Any:
            box = [raw]  # not a local while the servicer runs (see call above)
            del raw
            return await inner(await refuse.message(box.pop(), context), context)

        return write

    async def stream(raw: Any, context: Context) -> AsyncIterator[Any]:
        box = [raw]  # not a local while the servicer runs (see call above)
        del raw
        async for response in inner(await refuse.message(box.pop(), context), context):
            yield response

    return stream


async def _the_message(context: Context) -> Any:
    """A unary call's one message, read when asked (context.read, not the request iterator:
    gRPC's iterator keeps the last message it yielded for as long as the call's state lives)."""
    raw = await context.read()
    if raw is _EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")
    return raw


def _after_guard(original: Handler, guard: Guard) -> Handler:
    """`original` with `guard` run first. A unary-request method is registered as
    request-streaming: gRPC reads a unary call's message before its handler runs, a
    request-streaming handler reads it when asked: after the guard (a refused caller's message
    is never read, and flow control holds the rest of it at the client)."""
    handler: Any = original  # a namedtuple (grpc's stubs do not say so)
    behaviors: dict[str, Any]
    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def call(raws: AsyncIterator[Any], context: Context) -> Any:
            try:
                await guard(context)
                box = [await _the_message(context)]  # not a local while the call runs
                return await unary(box.pop(), context)
            except BaseException as exc:
                _forget_locals(exc)
                raise

        behaviors = {"request_streaming": True, "unary_unary": None, "stream_unary": call}
    elif handler.unary_stream is not None:
        behaviors = {
            "request_streaming": True,
            "unary_stream": None,
            "stream_stream": _guarded_stream(handler.unary_stream, guard, read=True),
        }
    elif handler.stream_unary is not None:
        inner: Any = handler.stream_unary

        async def call_stream(raws: AsyncIterator[Any], context: Context) -> Any:
            await guard(context)
            return await inner(raws, context)

        behaviors = {"stream_unary": call_stream}
    else:
        behaviors = {"stream_stream": _guarded_stream(handler.stream_stream, guard, read=False)}
    replaced: Handler = handler._replace(**behaviors)
    return replaced


def _guarded_stream(inner: Any, guard: Guard, *, read: bool) -> Any:
    """A response-streaming behaviour with `guard` run first; `read`: the inner one takes the
    call's one message (a unary request), read after the guard."""
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: a coroutine

        async def write(raws: AsyncIterator[Any], context: Context) -> Any:
            await guard(context)
            return await inner(await _the_message(context) if read else raws, context)

        return write

    async def stream(raws: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        await guard(context)
        # aclosing: a cancelled call closes the inner stream (and the servicer's leases) at once.
        async with aclosing(inner(await _the_message(context) if read else raws, context)) as responses:
            async for response in responses:
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
            async for response in inner(checked(requests, context), context):
                yield response

        return stream

    async def call(requests: AsyncIterator[Any], context: Context) -> Any:
        return await inner(checked(requests, context), context)

    return call
