"""KServe V2 tensor elements between JSON and the gRPC API's raw contents: little-endian element
bytes, as the gRPC API's raw contents; the `struct` module converts them (the gateway does not
need numpy). BYTES elements are 4-byte-length-prefixed, as Triton's.
"""

from __future__ import annotations

import struct
from typing import Any

from modelyard.common import names
from modelyard.gateway import http

# Datatype -> struct format character (little-endian '<' prefix added when packing).
FORMATS = {
    "BOOL": "?",
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}


def _shape_text(shape: list[int]) -> str:
    """The shape as a message shows it: its first 16 dims (int64s, so bounded)."""
    return str(shape) if len(shape) <= 16 else str(shape[:16])[:-1] + ", ...]"


def _count(shape: list[int], cap: int) -> int:
    """The element count of `shape`, or cap + 1 once it is known to be over `cap` (a long shape
    of huge dims would otherwise make an enormous integer, slowly)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            return cap + 1
    return n


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def encode(datatype: str, shape: list[int], data: Any, name: str) -> bytes:
    """JSON elements -> the raw little-endian bytes of the gRPC API."""
    values = _flatten(data)
    if len(values) != _count(shape, len(values)):
        raise http.invalid(name, f"{len(values)} elements for shape {_shape_text(shape)}")
    if datatype == "BYTES":
        out = bytearray()
        for value in values:
            # Strings only: bytes(<int>) would allocate that many zero bytes.
            if not isinstance(value, str):
                raise http.invalid(name, f"BYTES elements must be strings, got {type(value).__name__}")
            raw = value.encode()
            out += struct.pack("<I", len(raw)) + raw
        return bytes(out)
    fmt = FORMATS.get(datatype)
    if fmt is None:
        raise http.invalid(name, f"datatype {names.echo(datatype)} cannot be sent as JSON")
    if datatype == "BOOL" and not all(isinstance(v, bool) for v in values):
        raise http.invalid(name, "BOOL elements must be true or false")
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except (struct.error, OverflowError) as exc:
        raise http.invalid(name, f"data does not fit {names.echo(datatype)}: {exc}") from None


def decode(datatype: str, raw: bytes) -> list[Any]:
    if datatype == "BYTES":
        out: list[Any] = []
        offset = 0
        while offset < len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            item = raw[offset + 4 : offset + 4 + length]
            offset += 4 + length
            try:
                out.append(item.decode())
            except UnicodeDecodeError:
                out.append(list(item))
        return out
    fmt = FORMATS[datatype]
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))
