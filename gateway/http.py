"""Request reading and field checking shared by the endpoints: bounded bodies, JSON, typed fields."""

from __future__ import annotations

import json
import math
from typing import Any

from modelyard.common.reasons import ErrorReason
from starlette.requests import Request

from gateway import errors


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past `limit` bytes (read no further), 400 if malformed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise errors.bad_request("the body must be a JSON object")
    return value


def _too_large(limit: int) -> errors.HttpError:
    return errors.HttpError(
        413, "RESOURCE_EXHAUSTED", ErrorReason.TOO_LARGE, f"the body is over {limit} bytes"
    )


def invalid(name: str, message: str) -> errors.HttpError:
    return errors.bad_request(f"{name}: {message}", status=422)


def get_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise invalid(name, f"must be a string, got {type(value).__name__}")
    return value


def get_int(body: dict[str, Any], name: str, default: int = 0, minimum: int = 0) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise invalid(name, f"must be >= {minimum}, got {value}")
    return value


def get_float(body: dict[str, Any], name: str, default: float = 0.0) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, f"must be a finite number, got {value!r}")
    return float(value)


def get_str_list(body: dict[str, Any], name: str) -> list[str]:
    """A string or a list of strings (as OpenAI's `stop`)."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise invalid(name, "must be a string or a list of strings")


def get_int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise invalid(name, "must be a list of integers")


def query_fields(request: Request, numbers: dict[str, type]) -> dict[str, Any]:
    """Query parameters as the JSON body would carry them: numbers parsed, `stop` repeatable."""
    out: dict[str, Any] = {}
    for key, text in request.query_params.items():
        if key == "stop":
            out["stop"] = request.query_params.getlist("stop")
        elif key in numbers:
            try:
                out[key] = numbers[key](text)
            except ValueError:
                raise invalid(key, f"must be a {numbers[key].__name__}, got {text!r}") from None
        else:
            out[key] = text
    return out
