"""The gateway's one streamed response (gateway.streamed_response.stream), without a network."""

from __future__ import annotations

import asyncio
from typing import Any

from modelyard.gateway import streamed_response


class Connection:
    """An ASGI connection: records what is sent; receive() reports a disconnect once `gone` is set."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_writer_that_ends_closes_the_body() -> None:
    connection = Connection()

    async def body(write: streamed_response.Write) -> None:
        await write(b"a")
        await write(b"b")

    ended = await streamed_response.stream(connection.send, connection.receive, {"x-h": "1"}, body)
    assert ended
    assert connection.sent[0] == {"type": "http.response.start", "status": 200, "headers": [(b"x-h", b"1")]}
    assert [m["body"] for m in connection.sent[1:]] == [b"a", b"b", b""]
    assert [m["more_body"] for m in connection.sent[1:]] == [True, True, False]


async def test_a_disconnect_cancels_the_writer_and_leaves_the_body_open() -> None:
    connection = Connection()
    cancelled = asyncio.Event()

    async def body(write: streamed_response.Write) -> None:
        await write(b"a")
        connection.gone.set()
        try:
            await asyncio.Event().wait()  # a writer waiting for its next event
        except asyncio.CancelledError:
            cancelled.set()
            raise

    ended = await asyncio.wait_for(
        streamed_response.stream(connection.send, connection.receive, {}, body), 10
    )
    assert not ended
    assert cancelled.is_set()
    assert [m["body"] for m in connection.sent[1:]] == [b"a"]  # no closing frame


async def test_a_writer_that_fails_leaves_the_body_open() -> None:
    connection = Connection()

    async def body(write: streamed_response.Write) -> None:
        raise RuntimeError("upstream fault")

    assert not await streamed_response.stream(connection.send, connection.receive, {}, body)
    assert len(connection.sent) == 1
