"""A tiny HTTP/2 client that writes frames by hand, for tests of what a gRPC listener does with
connections no real client makes: rapid reset (HEADERS then RST_STREAM at once), a partial
preface, an idle connection. Only what those tests need: no flow control, no HPACK decoding (the
server's frames are read as headers and skipped), header blocks as HPACK literals."""

from __future__ import annotations

import asyncio
import contextlib
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    # "Literal header field without indexing, new name" (RFC 7541 6.2.2); short strings only.
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_headers(path: str, authority: str = "127.0.0.1") -> bytes:
    """The header block of a gRPC call to `path`."""
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", authority.encode()),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    return b"".join(_literal(name, value) for name, value in fields)


class RawConnection:
    """One HTTP/2 connection: the preface and SETTINGS sent, the server's SETTINGS and PINGs
    acknowledged by a reader task that counts the frames it saw by type."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.seen: dict[int, int] = {}
        self.goaway = asyncio.Event()
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        connection = cls(reader, writer)
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        await writer.drain()
        connection._task = asyncio.get_running_loop().create_task(connection._read())
        return connection

    async def _read(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                payload = await self.reader.readexactly(length)
                self.seen[kind] = self.seen.get(kind, 0) + 1
                if kind == SETTINGS and not flags & ACK:
                    self.writer.write(frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    self.writer.write(frame(PING, ACK, 0, payload))
                elif kind == GOAWAY:
                    self.goaway.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()

    async def rapid_reset(self, pairs: int, path: str, batch: int = 100, first_stream: int = 1) -> int:
        """Open and at once reset `pairs` streams, `batch` pairs per write; the next stream id."""
        block = grpc_headers(path)
        stream = first_stream
        reset = struct.pack(">I", CANCEL)
        for start in range(0, pairs, batch):
            chunk = []
            for _ in range(min(batch, pairs - start)):
                chunk.append(frame(HEADERS, END_HEADERS, stream, block))
                chunk.append(frame(RST_STREAM, 0, stream, reset))
                stream += 2
            if self.closed.is_set():
                break
            self.writer.write(b"".join(chunk))
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
        return stream

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
