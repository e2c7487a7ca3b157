"""The one intake path of every endpoint: bounded bodies, JSON parsed safely, typed and ranged
fields, model names, and the headers that may travel upstream.

Whatever a client sends, a failure here is an HttpError (400, 413 or 422 with a reason), never an
exception that would become a 500:
- a body is read up to `limit` bytes (413 past it), and must be strict UTF-8 JSON;
- its nesting depth is measured before it is parsed, without recursion (`MAX_DEPTH`), so neither
  the JSON decoder nor the endpoints' own walks can overflow the stack;
- `NaN`/`Infinity` are refused, and so is a number that a double cannot hold (`1e999`, which
  Python would read as infinity), and strings with lone surrogates (`"\\ud800"`: valid JSON,
  but no UTF-8 encoding, so protobuf and gRPC would fail on them);
- integers are range-checked against the protobuf field they fill (`INT32` ... `UINT64`);
- numbers in text (query parameters, object keys that are token ids) are read by JSON's grammar
  in ASCII (`decimal_int`, `json_number`), not by int()/float(), which also take `" 5 "`,
  `"5_0"`, `"+5"`, `"05"`, other scripts' digits (U+0665), `"inf"` and `"nan"`;
- model names and versions follow modelyard.common.names;
- forwarded header values must be printable ASCII (gRPC metadata).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request

from modelyard.common import names
from modelyard.common.reasons import ErrorReason
from modelyard.gateway import errors

# Deeper than any request of ours needs (KServe nested `data` of a 32-d tensor included).
MAX_DEPTH = 64
# Bodies larger than this are parsed off the event loop (a 1 MiB parse takes ~10-20 ms).
OFF_LOOP_BYTES = 64 * 1024
# The protobuf integer kinds: name -> inclusive range.
INT32 = ("int32", -(2**31), 2**31 - 1)
UINT32 = ("uint32", 0, 2**32 - 1)
INT64 = ("int64", -(2**63), 2**63 - 1)
UINT64 = ("uint64", 0, 2**64 - 1)
IntKind = tuple[str, int, int]
# The float fields of the API are float32: a larger double would arrive as infinity.
FLOAT32_MAX = 3.4028234663852886e38

# JSON's number grammar, ASCII digits only (a str pattern's \\d would match any Unicode digit).
_DECIMAL_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 past `limit` bytes (declared or sent: nothing more is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and len(declared) < 20 and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    except ClientDisconnect:
        # Gone (or cut by the listener's body timeout): nobody reads this answer.
        raise errors.HttpError(
            408, "CANCELLED", ErrorReason.CANCELLED, "the body was not sent in time"
        ) from None
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object (see parse_object); a large one is parsed in a thread,
    so the event loop keeps serving others meanwhile."""
    raw = await read_body(request, limit)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_object, raw)
    return parse_object(raw)


def parse_object(raw: bytes) -> dict[str, Any]:
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise errors.bad_request("the body must be a JSON object")
    return value


def parse_json(raw: bytes) -> Any:
    """Strict UTF-8 JSON no deeper than MAX_DEPTH, without NaN/Infinity or lone surrogates."""
    try:
        text = raw.decode("utf-8")  # strict: encoded surrogates and stray bytes are refused
    except UnicodeDecodeError as exc:
        raise errors.bad_request(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    depth = nesting_depth(raw)
    if depth is None:
        raise errors.bad_request("the body is not valid JSON: its brackets do not balance")
    if depth > MAX_DEPTH:
        raise errors.bad_request(f"the body is nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except NotFinite as exc:
        raise errors.bad_request(f"the body has a number out of range: {exc}") from None
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of over 4300 digits
        raise errors.bad_request(f"the body is not valid JSON: {names.echo(str(exc))}") from None
    if b"\\ud" in raw or b"\\uD" in raw:
        try:  # only an escape can make one; the C encoder finds it anywhere (keys too)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise errors.bad_request("the body has a string with a lone UTF-16 surrogate") from None
    return value


def nesting_depth(raw: bytes, stop_after: int = MAX_DEPTH) -> int | None:
    """The bracket nesting depth of a JSON text (up to stop_after + 1), or None when its brackets
    do not balance (so it is not JSON). Linear C-speed passes only: no recursion and no Python
    loop per character or per string, whatever the input."""
    # Escapes out first (escaped backslashes, then escaped quotes), so every quote left delimits
    # a string; the pieces at even places of the split are outside strings.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(plain.split(b'"')[::2]).translate(_SQUARE, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= stop_after:
        shorter = brackets.replace(b"[]", b"")  # one level of innermost pairs a pass
        if len(shorter) == len(brackets):
            return None
        brackets = shorter
        depth += 1
    return depth


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class NotFinite(ValueError):
    """A JSON number past a double's range (`1e999`, `-1e999`): Python reads it as an infinity."""


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent (the decoder's parse_float): a finite double."""
    value = float(text)
    if not math.isfinite(value):
        raise NotFinite(f"{names.echo(text, 40)} is beyond a double's range")
    return value


def decimal_int(text: str) -> int | None:
    """`text` when it is a JSON integer in ASCII (`5`, `-5`; not `05`, `+5`, ` 5 `, `5_0`, U+0665),
    as an int; else None. At most 4,300 digits are read (Python's limit), longer is None too."""
    if _DECIMAL_INT.fullmatch(text) is None:
        return None
    try:
        return int(text)
    except ValueError:  # over 4300 digits
        return None


def json_number(text: str) -> int | float | None:
    """`text` when it is a JSON number in ASCII (an int without fraction or exponent, else a
    float, which may be infinite for a huge exponent: get_float refuses that); else None."""
    if _JSON_NUMBER.fullmatch(text) is None:
        return None
    if any(c in text for c in ".eE"):
        return float(text)
    return decimal_int(text)


def too_large(limit: int) -> errors.HttpError:
    return errors.HttpError(
        413, "RESOURCE_EXHAUSTED", ErrorReason.TOO_LARGE, f"the body is over {limit} bytes"
    )


def invalid(name: str, message: str) -> errors.HttpError:
    """A field of the wrong type or shape: 422 naming it."""
    return errors.bad_request(f"{name}: {message}", status=422)


def out_of_range(name: str, message: str) -> errors.HttpError:
    """A well-typed field whose value the API cannot take: 400 naming it."""
    return errors.bad_request(f"{name}: {message}")


def check_string(value: str, name: str) -> str:
    """A string that protobuf can encode (query parameters, path parts)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise out_of_range(name, "has a lone UTF-16 surrogate") from None
    return value


def ranged(value: int, name: str, kind: IntKind, minimum: int | None = None) -> int:
    label, low, high = kind
    low = low if minimum is None else max(low, minimum)
    if not low <= value <= high:
        raise out_of_range(name, f"{names.echo(value, 40)} is outside {low}..{high} ({label})")
    return value


def get_str(body: Mapping[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise invalid(name, f"must be a string, got {type(value).__name__}")
    return value


def get_int(
    body: Mapping[str, Any], name: str, kind: IntKind, default: int = 0, minimum: int | None = 0
) -> int:
    value = body.get(name)
    if value is None:
        return default
    return as_int(value, name, kind, minimum)


def as_int(value: Any, name: str, kind: IntKind, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {type(value).__name__}")
    return ranged(value, name, kind, minimum)


def get_float(body: Mapping[str, Any], name: str, default: float = 0.0) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"must be a finite number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise out_of_range(name, f"must be a finite number within +-{FLOAT32_MAX:.4g} (float32)")
    return number


def get_str_list(body: Mapping[str, Any], name: str) -> list[str]:
    """A string or a list of strings (as OpenAI's `stop`)."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise invalid(name, "must be a string or a list of strings")


def int_list(value: Any, name: str, kind: IntKind) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise invalid(name, "must be a list of integers")
    for i, item in enumerate(value):
        ranged(item, f"{name}[{i}]", kind)
    return list(value)


def get_dict(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    """An optional object field ({} when absent or null)."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(name, "must be an object")
    return value


def model_name(value: Any, field: str) -> str:
    """A client-sent model name: modelyard.common.names' rule, 400 naming the field."""
    if not isinstance(value, str):
        raise invalid(field, "must be a string")
    try:
        return names.check_name(value, field)
    except names.InvalidName as exc:
        raise errors.bad_request(str(exc), param=field) from None


def model_version(value: Any, field: str) -> str:
    """A client-sent model version ('' = none asked for)."""
    if not isinstance(value, str):
        raise invalid(field, "must be a string")
    try:
        return names.check_version(value, field)
    except names.InvalidName as exc:
        raise errors.bad_request(str(exc), param=field) from None


def query_fields(request: Request, numbers: dict[str, type]) -> dict[str, Any]:
    """Query parameters as the JSON body would carry them: numbers parsed by JSON's grammar (an
    int field takes an integer, a float field any number), `stop` repeatable; they then go
    through the same field checks as a body."""
    out: dict[str, Any] = {}
    for key, text in request.query_params.items():
        check_string(text, key)
        if key == "stop":
            out["stop"] = [check_string(s, key) for s in request.query_params.getlist("stop")]
        elif key in numbers:
            number = decimal_int(text) if numbers[key] is int else json_number(text)
            if number is None:
                raise invalid(key, f"must be a JSON {numbers[key].__name__}, got {names.echo(text, 40)}")
            out[key] = number
        else:
            out[key] = text
    return out
