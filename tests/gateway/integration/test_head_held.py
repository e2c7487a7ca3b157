"""The gateway's listener sends a response's head together with the first body bytes written
after it (gateway/listener.HeadHeld): one write to the connection, so one TCP segment, not a head
alone and the body a segment later (which a client, or Envoy, reads in a wake-up of its own).

A real uvicorn server with the gateway's guarded protocol on loopback, a real client; the
connection's asyncio transport is wrapped (before the protocol sees it) to count the writes
that reach it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.config import Config
from uvicorn.server import ServerState

from modelyard.gateway.listener import Limits, protocol_class

pytestmark = pytest.mark.asyncio


class CountedWrites:
    """The real transport, with the writes that reach it kept (the bytes of each)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def serve(app: Starlette) -> tuple[asyncio.Server, list[CountedWrites]]:
    config = Config(app, http=protocol_class(Limits()), ws="none", lifespan="off", log_config=None)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    connections: list[CountedWrites] = []
    base = protocol_class(Limits())

    class Counted(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            connections.append(CountedWrites(transport))
            super().connection_made(connections[-1])

    server = await loop.create_server(
        lambda: Counted(config=config, server_state=state, app_state={}, _loop=loop), "127.0.0.1", 0
    )
    return server, connections


async def ask(server: asyncio.Server, request: bytes, until: bytes) -> bytes:
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        answer = b""
        while until not in answer:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            assert chunk, answer
            answer += chunk
        return answer
    finally:
        writer.close()


async def test_a_response_head_and_its_first_body_bytes_are_one_write() -> None:
    async def json_answer(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def events(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"event: token\ndata: {}\n\n"
            await asyncio.sleep(0)  # a yield, not a wait: the second chunk comes a loop turn later
            yield b"event: done\ndata: {}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def empty(request: Request) -> Response:
        return Response(status_code=204)

    app = Starlette(routes=[Route("/json", json_answer), Route("/events", events), Route("/empty", empty)])
    server, connections = await serve(app)
    try:
        answer = await ask(server, b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n", b'{"status":"ok"}')
        assert answer.startswith(b"HTTP/1.1 200")
        assert len(connections[-1].writes) == 1, connections[-1].writes  # head and body together
        assert connections[-1].writes[0] == answer

        await ask(server, b"GET /events HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
        writes = connections[-1].writes
        assert writes[0].startswith(b"HTTP/1.1 200") and b"event: token" in writes[0], writes
        assert b"event: done" not in writes[0]  # later writes are not held

        # A head with no body after it still goes out (at the end of the loop's turn).
        answer = await ask(server, b"GET /empty HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 204")
    finally:
        server.close()
        await server.wait_closed()
