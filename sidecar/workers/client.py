"""The supervisor's side of a worker's admin endpoint: one HTTP/1.1 request over the worker's
unix socket (a connection per request: the supervisor asks rarely, at human or scrape rate)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 10.0
MAX_HEAD = 64 * 1024


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str


async def ask(
    socket: Path,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Iterable[tuple[str, str]] = (),
    timeout_s: float = TIMEOUT_S,
) -> Answer:
    """OSError (or TimeoutError) when the worker does not answer."""
    return await asyncio.wait_for(_ask(socket, method, path, body, headers), timeout_s)


async def _ask(
    socket: Path, method: str, path: str, body: bytes, headers: Iterable[tuple[str, str]]
) -> Answer:
    reader, writer = await asyncio.open_unix_connection(str(socket), limit=MAX_HEAD)
    try:
        head = [f"{method} {path} HTTP/1.1", "Host: worker", "Connection: close"]
        head += [f"{name}: {value}" for name, value in headers]
        head.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        fields = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        size = int(fields.get("content-length", "0"))
        data = await reader.readexactly(size) if size and method != "HEAD" else b""
        return Answer(status, data, fields.get("content-type", ""))
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        raise OSError(f"the worker's admin answer was not read: {exc!r}") from exc
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
