"""The sidecar's admin endpoint against hostile and careless HTTP clients: bodies that are not JSON
objects or are nested too deeply are 400 with a reason (never 500), bodies over the bound 413 before
they are read, a held half-request and an idle connection are closed after their timeouts, a
connection flood is bounded, and one slow client never holds up another (asyncio, not a thread per
connection). The upstream address is closed: the admin endpoint needs none."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import running_sidecar

MAX_CONNECTIONS = 8
LIMITS: dict[str, Any] = {
    "admin_header_timeout_s": 0.5,
    "admin_body_timeout_s": 0.5,
    "admin_idle_timeout_s": 0.5,
    "admin_max_body_bytes": 64 * 1024,
    "admin_max_connections": MAX_CONNECTIONS,
}


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    # No upstream answers: the route file names the one model the changes are about.
    config = tmp_path / "routes.yaml"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    async with running_sidecar(["127.0.0.1:9"], config=config, **LIMITS) as running:
        yield running


@pytest.fixture
async def http(sidecar: Sidecar) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as client:
        yield client


def error(answer: httpx.Response) -> tuple[int, str]:
    return answer.status_code, answer.json()["reason"]


@pytest.mark.parametrize(
    "body",
    [
        b"[1, 2]",
        b"42",
        b'"canary_weight"',
        b"null",
        b"{not json",
        b"\xff\xfe",
        b"[" * 30_000 + b"]" * 30_000,  # RecursionError in the decoder
        b'{"stable": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # decoded, but no version
        b'{"stable": {"a": 1}}',
        b'{"canary": "../../etc"}',
        b'{"canary_weight": "x" }',
        b'{"nonsense": 1}',
    ],
)
async def test_a_bad_body_is_400_with_a_reason(http: httpx.AsyncClient, body: bytes) -> None:
    answer = await http.put("/canary/scaler", content=body)
    assert error(answer) == (400, "invalid_argument"), answer.text
    assert len(answer.text) < 1024


async def test_a_bad_model_name_is_400_and_a_good_change_applies(
    http: httpx.AsyncClient, sidecar: Sidecar
) -> None:
    for name in ("a..b", "%2e%2e%2fetc", "a" * 200, "-flag", "x%00y"):
        answer = await http.put(f"/canary/{name}", json={"canary_weight": 10})
        assert error(answer) == (400, "invalid_argument"), name
    assert set(sidecar.routes.table.models) == {"scaler"}
    # No upstream has reported (none answers): a model the route file does not name is not known
    # to be unknown yet, and is refused as retryable.
    assert error(await http.put("/canary/nosuch", json={"canary_weight": 10})) == (503, "unavailable")
    assert set(sidecar.routes.table.models) == {"scaler"}
    answer = await http.put("/canary/scaler", json={"canary_weight": 10, "stable": 1, "canary": "v2"})
    assert answer.status_code == 200 and answer.json()["canary"] == "2"
    assert error(await http.get("/nowhere")) == (404, "unsupported")


async def test_a_body_over_the_bound_is_413_before_it_is_read(sidecar: Sidecar) -> None:
    reader, writer = await connect(sidecar)
    writer.write(b"PUT /canary/scaler HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
    status, body = await read_answer(reader)
    assert status == 413 and body["reason"] == "too_large"
    assert await reader.read() == b""  # and the connection is closed
    writer.close()


async def test_a_head_over_the_bound_is_431(sidecar: Sidecar) -> None:
    reader, writer = await connect(sidecar)
    writer.write(b"GET /breakers HTTP/1.1\r\nX-Padding: " + b"a" * 20_000 + b"\r\n\r\n")
    status, body = await asyncio.wait_for(read_answer(reader), 5)
    assert status == 431 and body["reason"] == "too_large"
    writer.close()


async def test_a_chunked_body_is_refused(http: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"canary_weight": 1}'

    answer = await http.put("/canary/scaler", content=chunks())
    assert error(answer) == (411, "invalid_argument")


async def test_held_half_requests_and_idle_connections_are_closed(sidecar: Sidecar) -> None:
    started = time.monotonic()
    idle = await connect(sidecar)
    half = await connect(sidecar)
    half[1].write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
    body = await connect(sidecar)
    body[1].write(b"PUT /canary/scaler HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
    assert await asyncio.wait_for(idle[0].read(), 5) == b""
    status, _ = await asyncio.wait_for(read_answer(half[0]), 5)
    assert status == 408
    status, _ = await asyncio.wait_for(read_answer(body[0]), 5)
    assert status == 408
    assert time.monotonic() - started < 5
    for _, writer in (idle, half, body):
        writer.close()


async def test_slow_clients_hold_up_nobody_and_the_flood_is_bounded(
    sidecar: Sidecar, http: httpx.AsyncClient
) -> None:
    threads = threading.active_count()
    held = [await connect(sidecar) for _ in range(MAX_CONNECTIONS - 1)]
    for _, writer in held:
        writer.write(b"GET /breakers HTTP/1.1\r\n")  # half a request each
    answer = await http.get("/breakers")  # the one connection left
    assert answer.status_code == 200
    # No thread per connection (httpx's own connection included; /metrics was not asked for).
    assert threading.active_count() == threads
    extra = await connect(sidecar)  # one over the bound
    extra[1].write(b"GET /breakers HTTP/1.1\r\n\r\n")
    status, body = await asyncio.wait_for(read_answer(extra[0]), 5)
    assert status == 503 and body["reason"] == "queue_full"
    # Keep-alive: the client's connection answers again.
    assert (await http.get("/canary")).status_code == 200
    for _, writer in [*held, extra]:
        writer.close()


async def connect(sidecar: Sidecar) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = sidecar.admin_address.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return status, json.loads(await reader.readexactly(length))
