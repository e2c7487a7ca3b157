"""The forwarder (sidecar/forward.py) for each of the four call kinds, between real gRPC servers on
loopback: a client calls an edge server whose handlers do nothing but forward one attempt to an
upstream server. Bytes arrive unchanged (or through the attempt's body rewrite), request metadata
reaches the upstream, the upstream's response headers (plus the sidecar's own) and trailers reach
the client, and an upstream error comes back as Failed with its status and trailers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from modelyard.sidecar import forward
from modelyard.sidecar.layers.read import Metadata
from modelyard.sidecar.scope import Flight
from modelyard.sidecar.upstreams import Upstream, UpstreamSpec

if TYPE_CHECKING:
    Handler = grpc.GenericRpcHandler[bytes, bytes]
    MethodHandler = grpc.RpcMethodHandler[bytes, bytes]
else:
    Handler = grpc.GenericRpcHandler
    MethodHandler = grpc.RpcMethodHandler
Context = grpc.aio.ServicerContext[bytes, bytes]
ADDED = (("x-model-dye", "stable"),)  # what the sidecar adds to the client's response headers


def _seen(context: Context) -> bytes:
    """What the upstream saw of the request metadata, as one message."""
    md = dict(context.invocation_metadata() or ())
    return f"seen:{md.get('x-test', '')}".encode()


async def _answer_headers(context: Context, request: bytes) -> None:
    await context.send_initial_metadata((("x-served-version", "1"),))
    context.set_trailing_metadata((("x-trailer", "t"),))
    if request.startswith(b"fail"):
        await context.abort(grpc.StatusCode.INTERNAL, "it broke", (("x-error-reason", "model_failed"),))


class UpstreamMethods(Handler):
    """Echoes: unary-unary the request; unary-stream the request, then what it saw; stream-unary
    the requests joined; stream-stream each request. A request starting with `fail` fails."""

    def service(self, details: grpc.HandlerCallDetails) -> MethodHandler | None:
        method = details.method.rpartition("/")[2]
        if method == "UnaryUnary":

            async def unary_unary(request: bytes, context: Context) -> bytes:
                await _answer_headers(context, request)
                return request + b"|" + _seen(context)

            return grpc.unary_unary_rpc_method_handler(unary_unary)
        if method == "UnaryStream":

            async def unary_stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
                if request == b"trailers-only":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
                await _answer_headers(context, request)
                yield request
                yield _seen(context)

            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if method == "StreamUnary":

            async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
                got = [message async for message in requests]
                await _answer_headers(context, got[-1] if got else b"")
                return b",".join(got)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if method == "StreamStream":

            async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
                async for message in requests:
                    if message.startswith(b"fail"):
                        await context.abort(
                            grpc.StatusCode.INTERNAL, "it broke", (("x-error-reason", "model_failed"),)
                        )
                    yield message

            return grpc.stream_stream_rpc_method_handler(stream_stream)
        return None


class Edge(Handler):
    """Forwards every call to the upstream, one attempt, through the forwarder only."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.failures: list[forward.Failed] = []
        self.early: list[forward.Failed | None] = []

    async def _failed(self, context: Context, failed: forward.Failed) -> None:
        self.failures.append(failed)
        code, details, md = forward.client_status(failed.code, failed.details, failed.trailing)
        await context.abort(code, details, forward.with_metadata(md, ADDED))

    def _md(self, context: Context) -> Metadata:
        return tuple((k, v) for k, v in context.invocation_metadata() or () if k.startswith("x-"))

    def service(self, details: grpc.HandlerCallDetails) -> MethodHandler | None:
        path = details.method
        kind = {
            "UnaryUnary": "unary_unary",
            "UnaryStream": "unary_stream",
            "StreamUnary": "stream_unary",
            "StreamStream": "stream_stream",
        }[path.rpartition("/")[2]]

        async def one(request: forward.Request, context: Context) -> bytes:
            try:
                response, initial, trailing = await forward.ask(
                    self.upstream, path, kind, request, self._md(context), 10, Flight()
                )
            except forward.Failed as failed:
                await self._failed(context, failed)
            if initial:
                await context.send_initial_metadata(initial)
            forward.answer(context, trailing, ADDED)
            return response

        async def many(request: forward.Request, context: Context) -> AsyncIterator[bytes]:
            call = forward.start(self.upstream, path, kind, request, self._md(context), 10, Flight())
            try:
                if kind == "unary_stream":
                    self.early.append(await forward.ended_early(call))
                async for message in forward.relay(call, context, ADDED):
                    yield message
            except forward.Failed as failed:
                await self._failed(context, failed)

        def spelled(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            return forward.requests(b"first", stream, lambda m: m.upper())

        if kind == "unary_unary":
            return grpc.unary_unary_rpc_method_handler(one)
        if kind == "stream_unary":

            async def stream_unary(requests: AsyncIterator[bytes], context: Context) -> bytes:
                return await one(spelled(requests), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if kind == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(many)

        async def stream_stream(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            async for message in many(requests, context):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream_stream)


Rig = tuple[grpc.aio.Channel, Edge]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    upstream_server = grpc.aio.server()
    upstream_server.add_generic_rpc_handlers((UpstreamMethods(),))
    upstream_port = upstream_server.add_insecure_port("127.0.0.1:0")
    await upstream_server.start()
    upstream = Upstream(UpstreamSpec.parse(f"127.0.0.1:{upstream_port}"), ())
    edge = Edge(upstream)
    edge_server = grpc.aio.server()
    edge_server.add_generic_rpc_handlers((edge,))
    edge_port = edge_server.add_insecure_port("127.0.0.1:0")
    await edge_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{edge_port}")
    try:
        yield channel, edge
    finally:
        await channel.close(None)
        await edge_server.stop(None)
        await upstream.close(None)
        await upstream_server.stop(None)


MD = (("x-test", "hello"),)


def _method(channel: grpc.aio.Channel, kind: str, path: str) -> Any:
    """A multicallable of bytes in and bytes out."""
    return getattr(channel, kind)(path, None, None)


def _as_dict(md: Any) -> dict[str, Any]:
    return {key: value for key, value in md or ()}


async def _headers(call: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return _as_dict(await call.initial_metadata()), _as_dict(await call.trailing_metadata())


async def test_unary_unary_moves_bytes_and_metadata_both_ways(rig: Rig) -> None:
    channel, _ = rig
    call = _method(channel, "unary_unary", "/t.T/UnaryUnary")(b"\x00ping\xff", metadata=MD)
    assert await call == b"\x00ping\xff|seen:hello"
    initial, trailing = await _headers(call)
    # The upstream's headers pass as they are; the sidecar's own ride in a unary answer's trailers.
    assert initial == {"x-served-version": "1"}
    assert (trailing["x-model-dye"], trailing["x-trailer"]) == ("stable", "t")


async def test_an_upstream_error_is_failed_with_its_status_and_trailers(rig: Rig) -> None:
    channel, edge = rig
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _method(channel, "unary_unary", "/t.T/UnaryUnary")(b"fail", metadata=MD)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INTERNAL, "it broke")
    trailing = _as_dict(caught.value.trailing_metadata())
    assert (trailing["x-error-reason"], trailing["x-model-dye"]) == ("model_failed", "stable")
    [failed] = edge.failures
    assert (failed.code, failed.details, failed.reason) == (
        grpc.StatusCode.INTERNAL,
        "it broke",
        "model_failed",
    )


async def test_stream_unary_sends_every_message_through_the_attempts_body(rig: Rig) -> None:
    channel, _ = rig

    async def requests() -> AsyncIterator[bytes]:
        for message in (b"a", b"b", b"c"):
            yield message

    call = _method(channel, "stream_unary", "/t.T/StreamUnary")(requests(), metadata=MD)
    assert await call == b"FIRST,A,B,C"  # the message read ahead first, then the rest, rewritten
    initial, trailing = await _headers(call)
    assert initial == {"x-served-version": "1"}
    assert (trailing["x-model-dye"], trailing["x-trailer"]) == ("stable", "t")


async def test_unary_stream_relays_every_message_and_tells_a_trailers_only_error_early(rig: Rig) -> None:
    channel, edge = rig
    call = _method(channel, "unary_stream", "/t.T/UnaryStream")(b"go", metadata=MD)
    assert [message async for message in call] == [b"go", b"seen:hello"]
    initial, trailing = await _headers(call)
    assert (initial["x-served-version"], initial["x-model-dye"], trailing["x-trailer"]) == (
        "1",
        "stable",
        "t",
    )
    assert edge.early == [None]  # the stream went on: nothing to retry

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in _method(channel, "unary_stream", "/t.T/UnaryStream")(b"trailers-only", metadata=MD):
            pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # the upstream gave no reason: the client gets README's reading of the bare code
    assert _as_dict(caught.value.trailing_metadata())["x-error-reason"] == "unavailable"
    early = edge.early[-1]
    assert early is not None and (early.code, early.details, early.reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "not now",
        "",
    )


async def test_stream_stream_relays_both_streams_and_a_mid_stream_error(rig: Rig) -> None:
    channel, edge = rig

    async def requests(*messages: bytes) -> AsyncIterator[bytes]:
        for message in messages:
            yield message

    call = _method(channel, "stream_stream", "/t.T/StreamStream")(requests(b"x", b"y"), metadata=MD)
    assert [message async for message in call] == [b"x", b"y"]
    assert await call.code() == grpc.StatusCode.OK

    call = _method(channel, "stream_stream", "/t.T/StreamStream")(requests(b"x", b"fail"), metadata=MD)
    got: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in call:
            got.append(message)
    assert got == [b"x"]
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert edge.failures[-1].reason == "model_failed"
