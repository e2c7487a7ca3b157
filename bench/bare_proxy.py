"""The thinnest grpc.aio proxy that does the sidecar's transport job, as the floor bench.sidecar
measures the sidecar against: every method of our APIs forwarded as bytes (no parsing), with the
caller's metadata and deadline, the upstream's initial metadata, trailing metadata and status.
No dyeing, no breakers, no tenant limits, no metrics, no tracing: what the sidecar costs beyond
this is its own work. Same gRPC server and channel options as the sidecar.

Run as a script: prints `bare proxy serving gRPC on HOST:PORT` once bound, then serves until
SIGTERM/SIGINT.

    .venv/bin/python -m bench.bare_proxy --upstream 127.0.0.1:50052 [--listen 127.0.0.1:0]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from modelyard.process.grpc_server import connection_options
from modelyard.sidecar.proxy import method_table
from modelyard.sidecar.settings import Settings

Context = grpc.aio.ServicerContext[bytes, bytes]
if TYPE_CHECKING:
    _Handler = grpc.GenericRpcHandler[bytes, bytes]
    _MethodHandler = grpc.RpcMethodHandler[bytes, bytes]
else:
    _Handler = grpc.GenericRpcHandler
    _MethodHandler = grpc.RpcMethodHandler
Metadata = tuple[tuple[str, str | bytes], ...]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def forwarded(context: Context) -> Metadata:
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if not k.startswith((":", "grpc-")))


async def relay_status(call: Any, context: Context) -> None:
    """The upstream's trailing metadata and status, as its own."""
    context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
    code = await call.code()
    if code != grpc.StatusCode.OK:
        context.set_code(code)
        context.set_details(await call.details() or "")


def handlers(channel: Any) -> dict[str, _MethodHandler]:
    table: dict[str, _MethodHandler] = {}
    for info in method_table().values():
        path = info.path
        if info.kind == "unary_unary":
            table[path] = grpc.unary_unary_rpc_method_handler(unary(channel, path))
        elif info.kind == "unary_stream":
            table[path] = grpc.unary_stream_rpc_method_handler(unary_stream(channel, path))
        elif info.kind == "stream_unary":
            table[path] = grpc.stream_unary_rpc_method_handler(stream_unary(channel, path))
        else:
            table[path] = grpc.stream_stream_rpc_method_handler(stream_stream(channel, path))
    return table


def unary(channel: Any, path: str) -> Callable[[bytes, Context], Any]:
    method = channel.unary_unary(path)

    async def handle(request: bytes, context: Context) -> bytes | None:
        return await relay_answer(
            method(request, metadata=forwarded(context), timeout=context.time_remaining()), context
        )

    return handle


def stream_unary(channel: Any, path: str) -> Callable[[AsyncIterator[bytes], Context], Any]:
    method = channel.stream_unary(path)

    async def handle(requests: AsyncIterator[bytes], context: Context) -> bytes | None:
        return await relay_answer(
            method(requests, metadata=forwarded(context), timeout=context.time_remaining()), context
        )

    return handle


async def relay_answer(call: Any, context: Context) -> bytes | None:
    """A call with one answer: its headers, the answer, its trailers and status."""
    try:
        response: bytes = await call
    except grpc.aio.AioRpcError:
        await relay_status(call, context)
        return None
    initial = await call.initial_metadata()
    if initial:
        await context.send_initial_metadata(tuple(initial))
    await relay_status(call, context)
    return response


async def relay_stream(call: Any, context: Context) -> AsyncIterator[bytes]:
    try:
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(tuple(initial))
        async for message in call:
            yield message
    except grpc.aio.AioRpcError:
        pass
    await relay_status(call, context)


def unary_stream(channel: Any, path: str) -> Callable[[bytes, Context], AsyncIterator[bytes]]:
    method = channel.unary_stream(path)

    async def handle(request: bytes, context: Context) -> AsyncIterator[bytes]:
        call = method(request, metadata=forwarded(context), timeout=context.time_remaining())
        async for message in relay_stream(call, context):
            yield message

    return handle


def stream_stream(channel: Any, path: str) -> Callable[[AsyncIterator[bytes], Context], AsyncIterator[bytes]]:
    method = channel.stream_stream(path)

    async def handle(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
        call = method(requests, metadata=forwarded(context), timeout=context.time_remaining())
        async for message in relay_stream(call, context):
            yield message

    return handle


class Table(_Handler):
    def __init__(self, table: dict[str, _MethodHandler]) -> None:
        self._table = table

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> _MethodHandler | None:
        return self._table.get(handler_call_details.method)


async def serve(listen: str, upstream: str) -> None:
    async with grpc.aio.insecure_channel(upstream, options=OPTIONS) as channel:
        server = grpc.aio.server(options=[*OPTIONS, *connection_options(Settings())])  # the sidecar's
        server.add_generic_rpc_handlers((Table(handlers(channel)),))
        port = server.add_insecure_port(listen)
        await server.start()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        print(f"bare proxy serving gRPC on {listen.rpartition(':')[0]}:{port}", flush=True)
        await stopping.wait()
        await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free port)")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the service")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
