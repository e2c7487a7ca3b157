"""Parsing a large protobuf request message without holding the event loop.

protobuf's parser (upb) holds the GIL for the whole of a parse, so a 62 MB message of 700,000
tensors held the loop (and every other call) for 0.15-0.3 s even when parsed in another thread.
A serialized message is the concatenation of its top-level fields, and parsing a concatenation
merges the parts (the protobuf encoding guarantees it), so a large message is parsed here as
consecutive slices of whole top-level fields, CHUNK_BYTES or so each, merged one after the other
with the loop free to run between them. Finding the field boundaries walks only the top-level
tags and lengths (the work per field is a few bytes' worth), also in steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import Message

CHUNK_BYTES = 256 * 1024
CHUNK_FIELDS = 4096  # also a bound on the Python work between two steps (tiny fields)
# Top-level fields a request may have. Ours have a handful plus one per tensor and parameter
# (and far more tensors than the model has are refused anyway: api/tensor_headers.py), so a
# message of millions of tiny fields is refused here, after a bounded walk in Python, instead of
# costing seconds of one core between its steps.
MAX_FIELDS = 16 * 1024


class Malformed(ValueError):
    """The bytes are not a sequence of well-formed top-level fields."""


class TooManyFields(Malformed):
    """Well-formed, perhaps, but more top-level fields than any request of ours has."""


def message_class(deserialize: Callable[[bytes], Any] | None) -> type[Message] | None:
    """The protobuf class whose FromString `deserialize` is, or None (another parser)."""
    owner = getattr(deserialize, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, Message):
        return owner
    return None


def _varint(data: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise Malformed("truncated or overlong varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7


def field_slices(data: memoryview, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive runs of whole top-level fields, about `chunk` bytes (or
    CHUNK_FIELDS fields) each; Malformed past MAX_FIELDS fields in all."""
    start = position = fields = total = 0
    size = len(data)
    while position < size:
        tag, position = _varint(data, position)
        kind = tag & 7
        if tag >> 3 == 0:
            raise Malformed("field number 0")
        if kind == 0:
            _, position = _varint(data, position)
        elif kind == 1:
            position += 8
        elif kind == 2:
            length, position = _varint(data, position)
            position += length
        elif kind == 5:
            position += 4
        else:  # groups (3, 4) are not used by our protocols; 6, 7 do not exist
            raise Malformed(f"wire type {kind}")
        if position > size:
            raise Malformed("a field runs past the end")
        fields += 1
        total += 1
        if total > MAX_FIELDS:
            raise TooManyFields(f"more than {MAX_FIELDS} top-level fields")
        if position - start >= chunk or fields >= CHUNK_FIELDS:
            yield start, position
            start, fields = position, 0
    if position > start:
        yield start, position


async def parse_in_steps(cls: type[Message], data: bytes, chunk: int = CHUNK_BYTES) -> Message:
    """`cls.FromString(data)`, parsed a slice of whole fields at a time with the loop running
    between slices. DecodeError (or Malformed) for bytes that are not a valid message."""
    message = cls()
    view = memoryview(data)
    for start, end in field_slices(view, chunk):
        message.MergeFromString(view[start:end])  # type: ignore[arg-type]  # upb takes any buffer
        await asyncio.sleep(0)
    return message
