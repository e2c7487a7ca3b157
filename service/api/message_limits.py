"""The request size limit, checked where it can answer with x-error-reason `too_large`.

gRPC's own limit (grpc.max_receive_message_length) refuses an oversized message inside gRPC core,
before any handler runs: the client gets RESOURCE_EXHAUSTED with no trailing metadata of ours, so
a proxy could not tell it from an overloaded queue by its reason. So gRPC is given a higher
transport limit (transport_limit), the handlers receive each request message as bytes, and a
message over the configured limit is refused here, with its reason, before it is parsed. Only a
message over the transport limit still gets gRPC's bare RESOURCE_EXHAUSTED."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from modelyard.service.api.errors import Context, abort
from modelyard.service.api.pipeline import Handler, Wrapper
from modelyard.service.errors import TooLarge
from modelyard.service.metrics import ServiceMetrics

_GRPC_MAX = 2**31 - 1  # gRPC's message length options are C ints
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc's type stubs


def transport_limit(max_message_bytes: int) -> int:
    """gRPC's receive limit: twice the configured one, so that messages up to there reach
    the handler's check and get their reason; memory per call stays bounded."""
    return min(2 * max_message_bytes, _GRPC_MAX)


def _as_is(raw: bytes) -> bytes:
    return raw


def too_large(size: int, limit: int) -> TooLarge:
    return TooLarge(f"request message of {size} bytes is over the server's limit of {limit} bytes")


def size_limit(limit: int, metrics: ServiceMetrics) -> Wrapper:
    """The pipeline's size check (service/api/pipeline.py): each method's request arrives as
    bytes, its size is checked against `limit`, and only then is it parsed. No extra work per
    call beyond a len()."""

    def wrap(method: str, handler: Handler) -> Handler:
        return _size_checked(method.rsplit("/", 1)[-1], handler, limit, metrics)

    return wrap


def _size_checked(method: str, handler: Handler, limit: int, metrics: ServiceMetrics) -> Handler:
    # The decode guard (service/api/guards.py) hands on its handlers without a deserializer: it
    # parses after its guard. A handler that has one is parsed here, after the size check.
    deserializer: Any = handler.request_deserializer
    parse: Any = deserializer if deserializer is not None else _as_is
    parsed = deserializer is not None  # else the bytes go on as they are (no call per request)
    serialize = handler.response_serializer

    async def refuse(context: Context, size: int) -> None:
        metrics.observe_request(method, "", "", grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
        await abort(context, too_large(size, limit))

    if handler.unary_unary is not None:
        unary_unary: Any = handler.unary_unary

        async def checked_unary_unary(raw: bytes, context: Context) -> Any:
            if len(raw) > limit:
                await refuse(context, len(raw))
            # Not a local while the call runs: an aborted call's traceback keeps this frame
            # (and grpc.aio keeps that exception with the call's state).
            box = [raw]
            del raw
            return await unary_unary(parse(box.pop()) if parsed else box.pop(), context)

        return grpc.unary_unary_rpc_method_handler(checked_unary_unary, response_serializer=serialize)
    if handler.unary_stream is not None:
        unary_stream: Any = handler.unary_stream
        if not inspect.isasyncgenfunction(unary_stream):  # writes with context.write: a coroutine

            async def checked_unary_writes(raw: bytes, context: Context) -> Any:
                if len(raw) > limit:
                    await refuse(context, len(raw))
                box = [raw]  # not a local while the call runs (as above)
                del raw
                return await unary_stream(parse(box.pop()), context)

            return grpc.unary_stream_rpc_method_handler(checked_unary_writes, response_serializer=serialize)

        async def checked_unary_stream(raw: bytes, context: Context) -> AsyncIterator[Any]:
            if len(raw) > limit:
                await refuse(context, len(raw))
            box = [raw]  # not a local while the call runs (as above)
            del raw
            # aclosing: a cancelled call closes the servicer's stream (and its leases) at once.
            async with aclosing(unary_stream(parse(box.pop()), context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(checked_unary_stream, response_serializer=serialize)
    if handler.stream_stream is not None:
        stream_stream: Any = handler.stream_stream

        async def checked_stream_stream(raws: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
            async def requests() -> AsyncIterator[Any]:
                async for raw in raws:
                    if len(raw) > limit:
                        raise too_large(len(raw), limit)
                    yield parse(raw)

            # An oversized message on a stream ends the stream, with its reason: the servicer
            # never saw it, so it cannot answer it in-band.
            try:
                async with aclosing(stream_stream(requests(), context)) as responses:
                    async for response in responses:
                        yield response
            except TooLarge as exc:
                metrics.observe_request(method, "", "", grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
                await abort(context, exc)

        return grpc.stream_stream_rpc_method_handler(checked_stream_stream, response_serializer=serialize)
    if handler.stream_unary is not None:
        # A request-streaming method with one answer (none in these APIs today).
        stream_unary: Any = handler.stream_unary

        async def checked_stream_unary(raws: AsyncIterator[bytes], context: Context) -> Any:
            async def requests() -> AsyncIterator[Any]:
                # context.read, not `raws`: gRPC's iterator keeps the last message it
                # yielded for as long as the call's state lives (past the call's end).
                while (raw := await context.read()) is not _EOF:
                    assert isinstance(raw, bytes)
                    if len(raw) > limit:
                        raise too_large(len(raw), limit)
                    yield parse(raw)

            try:
                return await stream_unary(requests(), context)
            except TooLarge as exc:
                metrics.observe_request(method, "", "", grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
                await abort(context, exc)

        return grpc.stream_unary_rpc_method_handler(checked_stream_unary, response_serializer=serialize)
    raise TypeError(f"{method}: this kind of method is not size-checked here")
