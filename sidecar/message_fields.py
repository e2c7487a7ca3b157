"""Reading and setting fields 1 (model name) and 2 (model version) in a request's wire bytes.

Every request of both APIs (InferRequest, InferStreamRequest, GenerateRequest, KServe's
ModelInferRequest, ModelMetadataRequest, ...) carries the model name in field 1 and the version
in field 2, both strings. The proxy never decodes a message: it walks the top-level fields until
it has seen both and skips the others by their length (no byte of a skipped field is read).

The walk is bounded, because it runs on the event loop for every message: it stops as soon as it
has fields 1 and 2, and after at most MAX_FIELDS top-level fields whatever it has found. Encoders
write fields in number order (protobuf's, Triton's, grpc-gateway's), so 1 and 2 are the first two
fields of any real request; a message whose fields 1/2 are not within the first MAX_FIELDS is read
as naming no model and no version (`complete` False): the proxy forwards it undyed and without
per-model state, and the service, which parses the whole message, answers it. Only the scanned
prefix is checked: a malformed tail is the service's to refuse. Each value kept is at most
VALUE_MAX bytes (a longer one is cut there: no valid name is that long, so it is refused anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_VERSION_TAG = (2 << 3) | _LEN  # field 2, length-delimited
MAX_FIELDS = 64  # top-level fields walked per message at most (a few microseconds)
VALUE_MAX = 1024  # bytes kept of field 1 or 2; valid names and versions have at most 128


class WireError(ValueError):
    """The bytes are not a protobuf message."""


# Not frozen (a value all the same): a frozen dataclass's __init__ sets each field through
# object.__setattr__, a Python-level call per field, and every call's first message is read.
@dataclass(slots=True)
class ModelFields:
    name: str = ""
    version: str = ""
    complete: bool = True  # False: the walk stopped at MAX_FIELDS before the end of the message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
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


def read_model_fields(data: bytes, max_fields: int = MAX_FIELDS) -> ModelFields:
    """Fields 1 and 2 as strings (empty when absent; the first occurrence, see the module's
    docstring). Raises WireError for a prefix that does not parse, and for nothing else."""
    name: bytes | None = None
    version: bytes | None = None
    pos = 0
    end = len(data)
    left = max_fields
    while pos < end:
        if not left:
            if name is None:  # not named within the bound: no model, no version
                return ModelFields(complete=False)
            return ModelFields(_text(name), "", complete=False)
        left -= 1
        # One-byte varints (tags of fields 1-15, lengths under 128) inline: this runs per message.
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        kind = key & 7
        if kind == _LEN:
            if key < 8:
                raise WireError("field number 0")
            size = data[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(data, pos)
            start = pos
            pos += size
            if pos > end:
                raise WireError("length-delimited field runs past the end")
            if key == 0x0A:  # field 1
                if name is None:
                    name = data[start : start + min(size, VALUE_MAX)]  # a copy of the value alone
                    if version is not None:
                        break
            elif key == 0x12 and version is None:  # field 2
                version = data[start : start + min(size, VALUE_MAX)]
                if name is not None:
                    break
            continue
        if key < 8:
            raise WireError("field number 0")
        if kind == _VARINT:
            _, pos = _varint(data, pos)
        elif kind == _I64:
            pos += 8
        elif kind == _I32:
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind}")
        if pos > end:
            raise WireError("field runs past the end")
    try:  # _text, inline for the usual case: this runs per message
        return ModelFields(name.decode() if name else "", version.decode() if version else "")
    except UnicodeDecodeError:
        return ModelFields(_text(name or b""), _text(version or b""))


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        if len(raw) == VALUE_MAX:  # cut inside a character: too long to be valid anyway
            return raw.decode(errors="replace")
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
    return data + version_field(version)


@lru_cache(maxsize=256)
def version_field(version: str) -> bytes:
    """Field 2 holding `version`, encoded (the same few versions on every call)."""
    raw = version.encode()
    return bytes((_VERSION_TAG,)) + _encode_varint(len(raw)) + raw
