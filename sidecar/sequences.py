"""Sequence pinning: the steps of one stateful sequence (Triton's `sequence_id`) never change
version or upstream mid-way.

A stateful model keeps a sequence's state in the service process that took its START, on the
version that ran it: a later step that the canary weight dyed otherwise, or that the upstreams'
turn sent to another upstream serving the same version, would find no such sequence there. So a
KServe ModelInfer or ModelStreamInfer message carrying `sequence_id` is routed as usual at its
sequence's START (dye, canary weight, breakers), and the version and upstream it went to are
pinned for the sequence: every later step goes to the same pair, with no canary fallback, until
the step with END, or until the sequence has had no step for IDLE_S (longer than any service's
max_sequence_idle_us is expected to be: a pin kept after the service released the sequence only
sends its late step to the service that says so). A step of a sequence the sidecar has no pin
for (one started before the sidecar did) is pinned where it goes.

A stream is one upstream call: all its messages go where its first one went (a stream carrying
the steps of sequences pinned elsewhere cannot split; the service there answers them in-band
that it has no such sequence). The steps a stream carries are pinned to the stream's version and
upstream as they pass, so that a sequence started on a stream may go on in unary calls.

Bounded: at most MAX_PINS pins (beyond, the least recently used is dropped: its sequence's next
step is routed afresh), each with an id of at most 256 characters (the service's bound); state
that grows with what clients send is bounded so.

The sidecar never decodes a message: the parameter is read from the bytes (`read_step`), walking
the top-level fields until the first one after `parameters` (field 4; encoders write fields in
number order, so the inputs and their tensors are never walked), and only for the KServe data
methods.
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from modelyard.sidecar.layers.route import Route
from modelyard.sidecar.message_fields import WireError, _varint, read_model_fields

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
METHODS = frozenset({MODEL_INFER, MODEL_STREAM_INFER})

IDLE_S = 600.0  # a pin with no step for this long is dropped
MAX_PINS = 65_536
MAX_ID_BYTES = 1024  # a longer string id is not pinned (the service refuses it)
MAX_FIELDS = 64  # top-level fields walked at most (as wire.MAX_FIELDS)
# The tags of ModelInferRequest's fields after `parameters`: inputs, outputs, raw_input_contents.
_AFTER_PARAMETERS = frozenset({0x2A, 0x32, 0x3A})

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_PARAMETERS = (4 << 3) | _LEN  # ModelInferRequest.parameters, a map entry per field

SequenceKey = int | str


@dataclass(slots=True)
class SequenceStep:
    sequence_id: SequenceKey
    start: bool = False
    end: bool = False


def read_step(data: bytes) -> SequenceStep | None:
    """The message's sequence parameters, or None when it names no sequence (no sequence_id, 0,
    "", a malformed prefix: the service answers what it makes of those)."""
    # Most calls carry no parameters: their first field after the name, version and id (1-3, as
    # encoders write them, each a one-byte length here) is an input (5) or beyond, seen inline.
    pos, end = 0, len(data)
    if pos < end and data[pos] == 0x0A and pos + 1 < end and data[pos + 1] < 0x80:
        pos += 2 + data[pos + 1]
        if pos < end and data[pos] == 0x12 and pos + 1 < end and data[pos + 1] < 0x80:
            pos += 2 + data[pos + 1]
        if pos < end and data[pos] == 0x1A and pos + 1 < end and data[pos + 1] < 0x80:
            pos += 2 + data[pos + 1]
        if pos >= end or data[pos] in _AFTER_PARAMETERS:
            return None
    try:
        return _read_step(data)
    except (WireError, IndexError, struct.error, UnicodeDecodeError):
        return None


def _read_step(data: bytes) -> SequenceStep | None:
    pos, end = 0, len(data)
    sequence_id: object = None
    start = stop = False
    for _ in range(MAX_FIELDS):
        if pos >= end:
            break
        # One-byte tags and lengths inline (fields 1-15, values under 128 bytes): this runs on
        # every KServe inference message.
        key = data[pos]
        if key >= 0x80:
            key, pos = _varint(data, pos)
        else:
            pos += 1
        if key >> 3 > 4:
            break  # the inputs and tensors follow: parameters come before them
        kind = key & 7
        if kind == _LEN:
            size = data[pos]
            if size >= 0x80:
                size, pos = _varint(data, pos)
            else:
                pos += 1
            if pos + size > end:
                raise WireError("length-delimited field runs past the end")
            if key == _PARAMETERS:
                if data.startswith(_ID_KEY, pos):
                    sequence_id = _parameter(data, pos + len(_ID_KEY), pos + size)
                elif data.startswith(_START_KEY, pos):
                    start = _parameter(data, pos + len(_START_KEY), pos + size) is True
                elif data.startswith(_END_KEY, pos):
                    stop = _parameter(data, pos + len(_END_KEY), pos + size) is True
            pos += size
        elif kind == _VARINT:
            _, pos = _varint(data, pos)
        elif kind == _I64:
            pos += 8
        elif kind == _I32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind}")
    if sequence_id is None or sequence_id == 0 or sequence_id == "" or isinstance(sequence_id, bool):
        return None
    if not isinstance(sequence_id, int | str):
        return None
    if isinstance(sequence_id, str) and len(sequence_id) > MAX_ID_BYTES:
        return None
    return SequenceStep(sequence_id, start, stop)


def _key(name: bytes) -> bytes:
    """A map entry's start for key `name` (field 1, its length), then field 2's tag: the entry
    as every encoder writes it (key before value)."""
    return bytes((0x0A, len(name))) + name + b"\x12"


_ID_KEY, _START_KEY, _END_KEY = _key(b"sequence_id"), _key(b"sequence_start"), _key(b"sequence_end")


def _parameter(data: bytes, pos: int, end: int) -> object:
    """An entry's InferParameter (from its length on): 1 bool, 2 int64, 3 string, 5 uint64 (4, a
    double, is no id; None)."""
    size, pos = _varint(data, pos)
    end = min(end, pos + size)
    if pos >= end:
        return None
    key = data[pos]
    pos += 1
    if key == 0x08:
        return bool(_varint(data, pos)[0])
    if key in (0x10, 0x28):
        raw = _varint(data, pos)[0]
        return raw - (1 << 64) if key == 0x10 and raw >= 1 << 63 else raw
    if key == 0x1A:
        size, pos = _varint(data, pos)
        return data[pos : min(pos + size, end)].decode()
    return None


@dataclass(slots=True)
class Pin:
    version: str
    dye: str
    upstream: Any
    used: float


class SequencePins:
    """Where each live sequence goes: (model, sequence_id) -> version, dye and upstream."""

    def __init__(
        self, idle_s: float = IDLE_S, max_pins: int = MAX_PINS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._idle_s = idle_s
        self._max = max_pins
        self._clock = clock
        self._pins: OrderedDict[tuple[str, SequenceKey], Pin] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, model: str, sequence_id: SequenceKey) -> Pin | None:
        self._prune()
        pin = self._pins.get((model, sequence_id))
        if pin is not None:
            pin.used = self._clock()
            self._pins.move_to_end((model, sequence_id))
        return pin

    def pin(self, model: str, sequence_id: SequenceKey, version: str, dye: str, upstream: Any) -> None:
        key = (model, sequence_id)
        self._pins[key] = Pin(version, dye, upstream, self._clock())
        self._pins.move_to_end(key)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def unpin(self, model: str, sequence_id: SequenceKey) -> None:
        self._pins.pop((model, sequence_id), None)

    def _prune(self) -> None:
        if not self._pins:
            return
        limit = self._clock() - self._idle_s
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if pin.used > limit:
                return
            del self._pins[key]

    # -- the proxy's calls ----------------------------------------------------------------------

    def route(self, asked: Any, route: Route, step: SequenceStep, pool: Any) -> tuple[Route, Sequence[Any]]:
        """Before a routed call's first attempt is made (layers.balance.first): a step of a pinned
        sequence takes its pin's version and dye (no canary fallback mid-sequence: the route's
        `stable` is cleared), and the upstreams it may not go to are returned with the route
        (every other one serving its version)."""
        if step.start:
            return route, ()
        pin = self.get(asked.model, step.sequence_id)
        if pin is None:
            return route, ()
        version, dye = route.version, route.dye
        if not asked.pin:  # a client's own version pin wins
            version, dye = pin.version, pin.dye
        excluded = [u for u in pool.serving(asked.model, version) if u is not pin.upstream]
        return Route(version, dye, ""), excluded or ()

    def routed(self, attempt: Any, step: SequenceStep) -> None:
        """The call's first attempt is planned: its sequence is pinned there (or unpinned at END)."""
        if step.end:
            self.unpin(attempt.model, step.sequence_id)
        else:
            self.pin(attempt.model, step.sequence_id, attempt.version, attempt.dye, attempt.upstream)

    async def follow(self, messages: AsyncIterator[bytes], attempt: Any) -> AsyncIterator[bytes]:
        """A stream's messages after its first, each passed on as it is; the steps among them
        are pinned to the stream's version and upstream (unpinned at END)."""
        async for message in messages:
            step = read_step(message)
            if step is not None:
                try:
                    model = read_model_fields(message).name or attempt.model
                except WireError:
                    model = attempt.model
                version = attempt.version if model == attempt.model else ""
                if step.end:
                    self.unpin(model, step.sequence_id)
                else:
                    self.pin(model, step.sequence_id, version, attempt.dye, attempt.upstream)
            yield message
