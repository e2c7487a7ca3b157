"""A small SSE parser for the tests (the wire format, read as a browser reads it)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class SseEvent:
    event: str  # token, done, error; "retry" and "comment" for those lines
    id: str = ""
    data: Any = None
    at: float = field(default_factory=time.monotonic)


async def read_events(response: httpx.Response) -> AsyncIterator[SseEvent]:
    name, ident, data = "message", "", list[str]()
    async for line in response.aiter_lines():
        if line == "":
            if data:
                text = "\n".join(data)
                yield SseEvent(name, ident, json.loads(text) if text.startswith(("{", "[")) else text)
            name, ident, data = "message", "", []
        elif line.startswith(":"):
            yield SseEvent("comment", data=line[1:].strip())
        else:
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "id":
                ident = value
            elif key == "data":
                data.append(value)
            elif key == "retry":
                yield SseEvent("retry", data=int(value))


def events_only(events: list[SseEvent]) -> list[SseEvent]:
    return [e for e in events if e.event in ("token", "done", "error")]


def token_ids(events: list[SseEvent]) -> list[int]:
    return [t for e in events if e.event == "token" for t in e.data["token_ids"]]
