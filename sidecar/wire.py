"""Reading and setting fields 1 (model name) and 2 (model version) in a request's wire bytes.

Every request of both APIs (InferRequest, InferStreamRequest, GenerateRequest, KServe's
ModelInferRequest, ModelMetadataRequest, ...) carries the model name in field 1 and the version
in field 2, both strings. The proxy never decodes a message: it walks the top-level fields
until it has seen both (a few bytes in practice: they come first) and skips the rest by length.
"""

from __future__ import annotations

from dataclasses import dataclass

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_VERSION_TAG = (2 << 3) | _LEN  # field 2, length-delimited


class WireError(ValueError):
    """The bytes are not a protobuf message."""


@dataclass(frozen=True, slots=True)
class ModelFields:
    name: str = ""
    version: str = ""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(data)
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def read_model_fields(data: bytes) -> ModelFields:
    """Fields 1 and 2 as strings (empty when absent; the last occurrence wins, as in protobuf).
    Raises WireError for bytes that do not parse."""
    name = version = b""
    pos = 0
    end = len(data)
    view = memoryview(data)
    while pos < end:
        key, pos = _varint(view, pos)
        field, kind = key >> 3, key & 7
        if kind == _VARINT:
            _, pos = _varint(view, pos)
        elif kind == _LEN:
            size, pos = _varint(view, pos)
            if pos + size > end:
                raise WireError("length-delimited field runs past the end")
            if field == 1:
                name = data[pos : pos + size]
            elif field == 2:
                version = data[pos : pos + size]
            pos += size
        elif kind == _I64:
            pos += 8
        elif kind == _I32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind}")
        if pos > end:
            raise WireError("field runs past the end")
    try:
        return ModelFields(name.decode(), version.decode())
    except UnicodeDecodeError as exc:
        raise WireError("model name or version is not UTF-8") from exc


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def with_version(data: bytes, version: str) -> bytes:
    """The message with field 2 set to `version`: appended, because for a singular field the last
    occurrence on the wire wins. No decode, one copy."""
    raw = version.encode()
    return data + bytes((_VERSION_TAG,)) + _encode_varint(len(raw)) + raw
