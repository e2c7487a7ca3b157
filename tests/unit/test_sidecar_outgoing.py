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


def test_an_attempt_hands_grpc_aio_a_metadata_that_it_keeps_as_it_is() -> None:
    upstream = Upstream()
    forward.start(upstream, "/m/M", "unary_unary", b"", ENTRIES, 1.0, Flight())  # type: ignore[arg-type]
    sent = upstream.sent
    assert type(sent) is Outgoing and isinstance(sent, grpc.aio.Metadata)
    # What a grpc.aio multicallable does with it (without interceptors or compression): kept
    # as it is, then made the tuple its call hands gRPC's core; no Metadata.add per entry.
    from grpc.aio._channel import _BaseMultiCallable

    assert _BaseMultiCallable._init_metadata(sent) is sent
    assert tuple(sent) == ENTRIES and type(tuple(sent)) is tuple


def test_it_reads_as_its_tuple_and_as_a_metadata_of_the_same_entries() -> None:
    md = forward.outgoing(ENTRIES)
    assert isinstance(md, tuple) and md == ENTRIES and len(md) == 3 and list(md) == list(ENTRIES)
    assert md["x-user-id"] == "u1" and md.get_all("x-user-id") == ["u1", "u2"]
    assert "x-model-version" in md and "x-model-dye" not in md
    assert dict(md) == {"x-user-id": "u1", "x-model-version": "2"}  # Metadata's: the first value
    assert md == grpc.aio.Metadata(*ENTRIES)
    with pytest.raises(TypeError):
        md["x-model-version"] = "3"
    with pytest.raises(TypeError):
        md.add("x-model-dye", "canary")
    assert tuple(md) == ENTRIES
