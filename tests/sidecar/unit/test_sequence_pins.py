"""The sidecar's sequence pins: the parameters read from a message's bytes (never decoded), and
the bounded table of where each live sequence goes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.sidecar.layers.route import Route
from modelyard.sidecar.sequences import SequencePins, SequenceStep, read_step


def message(
    sequence_id: object = None, start: bool | None = None, end: bool | None = None, **more: int
) -> bytes:
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="x")
    request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(np.ones((1, 1), np.int32).tobytes())
    if isinstance(sequence_id, bool):
        request.parameters["sequence_id"].bool_param = sequence_id
    elif isinstance(sequence_id, int):
        if sequence_id >= 1 << 63:
            request.parameters["sequence_id"].uint64_param = sequence_id
        else:
            request.parameters["sequence_id"].int64_param = sequence_id
    elif isinstance(sequence_id, str):
        request.parameters["sequence_id"].string_param = sequence_id
    elif isinstance(sequence_id, float):
        request.parameters["sequence_id"].double_param = sequence_id
    if start is not None:
        request.parameters["sequence_start"].bool_param = start
    if end is not None:
        request.parameters["sequence_end"].bool_param = end
    for key, value in more.items():
        request.parameters[key].int64_param = value
    return request.SerializeToString()


def test_read_step_reads_the_sequence_parameters_from_the_bytes() -> None:
    assert read_step(message(1000, True, False, priority=3)) == SequenceStep(1000, True, False)
    assert read_step(message("a-b-c", False, True)) == SequenceStep("a-b-c", False, True)
    assert read_step(message(2**64 - 1)) == SequenceStep(2**64 - 1)
    assert read_step(message(-4)) == SequenceStep(-4)  # pinned as sent; the service refuses it
    # No sequence: none given, 0 and "" (Triton's "no sequence"), ids that are not ids.
    for no in (
        message(),
        message(0, True),
        message("", True),
        message(1.5),
        message(True),
        message(priority=1),
    ):
        assert read_step(no) is None
    # A malformed prefix is no sequence either (the service refuses the message itself).
    assert read_step(b"\xff\xff\xff") is None
    assert read_step(message(7, True)[:12]) is None
    assert read_step(message("x" * 2000)) is None


def test_read_step_never_walks_the_tensors() -> None:
    # The parameters come before the inputs (encoders write fields in number order): a message
    # whose parameters come after them is read as naming no sequence, without walking its payload.
    request = pb.ModelInferRequest(model_name="m")
    request.raw_input_contents.append(b"\0" * (1 << 20))
    tail = pb.ModelInferRequest()
    tail.parameters["sequence_id"].int64_param = 5
    assert read_step(request.SerializeToString() + tail.SerializeToString()) is None


@dataclass
class Plan:
    """An attempt (or the call as asked) as the sequence pins read it."""

    model: str = "m"
    version: str = "1"
    dye: str = "stable"
    stable: str = "1"
    pin: str = ""
    upstream: object = None


@dataclass
class Pool:
    upstreams: list[str] = field(default_factory=lambda: ["a", "b", "c"])

    def serving(self, model: str, version: str) -> list[str]:
        return self.upstreams


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_started_sequence_goes_where_its_start_went() -> None:
    pins = SequencePins()
    pool = Pool()
    asked = Plan()  # the call as asked (layers.read.Asked: its model and pin)
    canary = Route("2", "canary", "1")
    assert pins.route(asked, canary, SequenceStep(9, start=True), pool) == (canary, ())  # as any call
    pins.routed(Plan(version="2", dye="canary", stable="1", upstream="b"), SequenceStep(9, start=True))
    routed, exclude = pins.route(asked, Route("1", "stable", "1"), SequenceStep(9), pool)
    assert routed == Route("2", "canary", "")  # no fallback mid-way
    assert list(exclude) == ["a", "c"]
    # A client's own version pin wins over the sequence's.
    routed, _ = pins.route(Plan(pin="3"), Route("3", "pinned", ""), SequenceStep(9), pool)
    assert routed.version == "3"
    # END unpins: the id may start afresh anywhere.
    pins.routed(Plan(upstream="b"), SequenceStep(9, end=True))
    assert len(pins) == 0
    stable = Route("1", "stable", "1")
    assert pins.route(asked, stable, SequenceStep(9), pool) == (stable, ())


def test_pins_are_bounded_and_idle_ones_dropped() -> None:
    clock = Clock()
    pins = SequencePins(idle_s=10.0, max_pins=3, clock=clock)
    for n in range(4):
        pins.pin("m", n, "1", "stable", "a")
    assert len(pins) == 3 and pins.get("m", 0) is None  # the least recently used went
    assert pins.get("m", 1) is not None  # used: now the most recent
    clock.now += 6
    assert pins.get("m", 1) is not None
    pins.pin("m", 9, "1", "stable", "a")
    clock.now += 6  # 2 and 3 idle 12 s, 1 and 9 used 6 s ago
    assert pins.get("m", 9) is not None
    assert pins.get("m", 2) is None and pins.get("m", 3) is None
    assert len(pins) == 2


@pytest.mark.parametrize("other_model", [False, True])
async def test_a_stream_pins_the_steps_it_carries(other_model: bool) -> None:
    pins = SequencePins()
    plan = Plan(version="2", upstream="b")
    second = pb.ModelInferRequest(model_name="n" if other_model else "m")
    second.parameters["sequence_id"].int64_param = 44
    second.parameters["sequence_start"].bool_param = True
    ended = pb.ModelInferRequest(model_name="m")
    ended.parameters["sequence_id"].int64_param = 45
    ended.parameters["sequence_end"].bool_param = True
    pins.pin("m", 45, "2", "stable", "b")

    async def messages():
        yield second.SerializeToString()
        yield ended.SerializeToString()
        yield b"not a message"

    passed = [m async for m in pins.follow(messages(), plan)]
    assert passed[-1] == b"not a message" and len(passed) == 3
    pin = pins.get("n" if other_model else "m", 44)
    assert pin is not None and pin.upstream == "b"
    assert pin.version == ("" if other_model else "2")  # another model's message names no version
    assert pins.get("m", 45) is None
