"""An attempt's request metadata (forward.Outgoing): grpc.aio takes it as it is, and it reads as
the tuple it is made of and as a Metadata of the same entries."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from modelyard.sidecar import forward
from modelyard.sidecar.forward import Outgoing

ENTRIES = (("x-user-id", "u1"), ("x-model-version", "2"), ("x-user-id", "u2"))


class Upstream:
    """An upstream whose method records what the attempt's call was given."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.sent: Any = None

    def method(self, path: str, kind: str) -> Any:
        def call(request: bytes, metadata: Any = None, timeout: Any = None) -> object:
            self.sent = metadata
            return object()

        return call


class Flight:
    def follow(self, call: Any) -> None:
        self.call = call


async def test_an_attempt_hands_grpc_aio_a_metadata_it_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    upstream = Upstream()
    forward.start(upstream, "/m/M", "unary_unary", b"", ENTRIES, 1.0, Flight())  # type: ignore[arg-type]
    sent = upstream.sent
    assert type(sent) is Outgoing and isinstance(sent, grpc.aio.Metadata) and tuple(sent) == ENTRIES
    # A real grpc.aio call makes a plain tuple a Metadata, entry by entry; this one it keeps.
    added: list[str] = []
    add = grpc.aio.Metadata.add

    def counted(md: grpc.aio.Metadata, key: str, value: str | bytes) -> None:
        added.append(key)
        add(md, key, value)

    monkeypatch.setattr(grpc.aio.Metadata, "add", counted)
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        method = channel.unary_unary("/m/M", None, None)  # bytes in, bytes out
        for metadata in (ENTRIES, sent):
            added.clear()
            with pytest.raises(grpc.aio.AioRpcError):
                await method(b"", metadata=metadata, timeout=0.01)
            assert added == ([] if metadata is sent else [key for key, _ in ENTRIES])


def test_it_reads_as_its_tuple_and_as_a_metadata_of_the_same_entries() -> None:
    md: Any = forward.outgoing(ENTRIES)  # read as either
    assert issubclass(type(md), tuple) and md == ENTRIES and len(md) == 3 and list(md) == list(ENTRIES)
    assert md["x-user-id"] == "u1" and md.get_all("x-user-id") == ["u1", "u2"]
    assert "x-model-version" in md and "x-model-dye" not in md
    assert dict(md) == {"x-user-id": "u1", "x-model-version": "2"}  # Metadata's: the first value
    assert md == grpc.aio.Metadata(*ENTRIES)
    with pytest.raises(TypeError):
        md["x-model-version"] = "3"
    with pytest.raises(TypeError):
        md.add("x-model-dye", "canary")
    assert tuple(md) == ENTRIES
