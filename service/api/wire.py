"""What every call passes before its servicer: authorization, and a request that parsed.

Servicers are added through `Guarded`, which stands in for the server: every handler they
register is wrapped.

- Authorization: a guard (service/api/access.py) chosen per method at registration runs first
  and aborts the call (UNAUTHENTICATED / PERMISSION_DENIED) when it is not allowed.
- Undecodable requests: grpc.aio parses a request before any handler runs, and a parse failure
  there answers UNKNOWN and logs a full traceback per request (a log flood on demand). The
  wrapped handlers parse with a deserializer that never raises (it returns `Undecodable`), and
  refuse an `Undecodable` request with INVALID_ARGUMENT before the servicer sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from service.api.errors import Context

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


def _never_raises(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # protobuf's DecodeError, or anything a parser raises on bad bytes
            return _UNDECODABLE

    return parse


class Registrar(Protocol):
    """What generated `add_*Servicer_to_server` functions use of a server: a grpc.aio server, or
    another stand-in (service/api/limits.py's size check) that passes handlers on."""

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None: ...

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None: ...


class Guarded:
    """Pass this in place of the grpc.aio server to generated `add_*Servicer_to_server` functions."""

    def __init__(
        self,
        server: Registrar | grpc.aio.Server,
        on_undecodable: OnUndecodable,
        guard_for: GuardFor | None = None,
    ) -> None:
        self._server = server
        self._on_undecodable = on_undecodable
        self._guard_for = guard_for or (lambda method: None)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler[Any, Any]]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Generic(h, self._wrap) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        wrapped = {name: self._wrap(f"/{service}/{name}", h) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, wrapped)  # type: ignore[union-attr]

    def _wrap(self, method: str, handler: Any) -> Any:
        if handler is None:
            return None
        refuse = _Refuse(method, self._on_undecodable, self._guard_for(method))
        behaviors: dict[str, Any] = {"request_deserializer": _never_raises(handler.request_deserializer)}
        if handler.unary_unary is not None:
            behaviors["unary_unary"] = _unary_unary(handler.unary_unary, refuse)
        elif handler.unary_stream is not None:
            behaviors["unary_stream"] = _unary_stream(handler.unary_stream, refuse)
        elif handler.stream_unary is not None:
            behaviors["stream_unary"] = _stream_request(handler.stream_unary, refuse)
        elif handler.stream_stream is not None:
            behaviors["stream_stream"] = _stream_request(handler.stream_stream, refuse)
        return handler._replace(**behaviors)


class _Refuse:
    """A method's checks: `admit` (the guard) at the start of a call, `check` on each request."""

    __slots__ = ("_guard", "_kind", "_method", "_on_undecodable")

    def __init__(self, method: str, on_undecodable: OnUndecodable, guard: Guard | None) -> None:
        self._method = method
        self._kind = method.rsplit("/", 1)[-1]
        self._on_undecodable = on_undecodable
        self._guard = guard

    async def admit(self, context: Context) -> None:
        if self._guard is not None:
            await self._guard(context)

    async def check(self, request: Any, context: Context) -> None:
        if request is _UNDECODABLE:
            self._on_undecodable(self._method)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the {self._kind} request is not a valid message"
            )


def _unary_unary(inner: Any, refuse: _Refuse) -> Any:
    async def call(request: Any, context: Context) -> Any:
        await refuse.admit(context)
        await refuse.check(request, context)
        return await inner(request, context)

    return call


def _unary_stream(inner: Any, refuse: _Refuse) -> Any:
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: a coroutine

        async def write(request: Any, context: Context) -> Any:
            await refuse.admit(context)
            await refuse.check(request, context)
            return await inner(request, context)

        return write

    async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
        await refuse.admit(context)
        await refuse.check(request, context)
        async for response in inner(request, context):
            yield response

    return stream


def _stream_request(inner: Any, refuse: _Refuse) -> Any:
    async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for request in requests:
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


if TYPE_CHECKING:  # generic in grpc-stubs only
    _GenericBase = grpc.GenericRpcHandler[Any, Any]
else:
    _GenericBase = grpc.GenericRpcHandler


class _Generic(_GenericBase):
    """A generic handler whose method handlers are wrapped (once per method, then cached)."""

    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], wrap: Callable[[str, Any], Any]) -> None:
        self._inner = inner
        self._wrap = wrap
        self._cache: dict[str, Any] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        wrapped = self._cache.get(method)
        if wrapped is None:
            wrapped = self._wrap(method, self._inner.service(handler_call_details))
            if wrapped is not None:  # only methods that exist: unknown names must not grow it
                self._cache[method] = wrapped
        return wrapped
