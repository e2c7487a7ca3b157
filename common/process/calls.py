"""The context of the call that code runs in, for log lines, and the access line of an ended call.

A call's fields (method, request_id, model, version) live in a context variable for the length of
the call, so every log line written during it carries them in JSON (modelyard.process.logs), and
the layer that learns the model or version later (the sidecar's plan, a typed request) adds them
with `note`. No gRPC here: logging imports this before grpc is (see logs.quiet_grpc_core).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

ACCESS = logging.getLogger("modelyard.access")
_CALL: ContextVar[dict[str, str] | None] = ContextVar("modelyard_call", default=None)


def current() -> Mapping[str, str]:
    """The fields of the call this code runs in (empty outside a call)."""
    return _CALL.get() or {}


def note(**fields: str) -> None:
    """Add what is known of the current call (empty values are skipped); nothing outside a call."""
    call = _CALL.get()
    if call is not None:
        for name, value in fields.items():  # a loop, not a comprehension: no frame of its own
            if value:
                call[name] = value


def note_model(model: str, version: str) -> None:
    """`note(model=..., version=...)` without building its keyword dict (a proxy's every call)."""
    call = _CALL.get()
    if call is not None:
        if model:
            call["model"] = model
        if version:
            call["version"] = version


@contextmanager
def call(method: str, request_id: str = "") -> Iterator[dict[str, str]]:
    """The context of one call, for the code it runs (tasks it starts copy the same dict)."""
    fields = {"method": method}
    if request_id:
        fields["request_id"] = request_id
    token = _CALL.set(fields)
    try:
        yield fields
    finally:
        try:
            _CALL.reset(token)
        except ValueError:  # a streaming handler closed from another context (an aclose at exit)
            _CALL.set(None)


def write(fields: Mapping[str, str], code: str, reason: str, duration_s: float, peer: str) -> None:
    """The access line of one ended call."""
    line = {**fields, "code": code, "duration_ms": round(duration_s * 1000, 3), "peer": peer}
    if reason:
        line["reason"] = reason
    extras = " ".join(f"{k}={line[k]}" for k in ("model", "version", "reason", "request_id") if k in line)
    ACCESS.info(
        "%s %s %.1f ms %s%s",
        fields.get("method", ""),
        code,
        duration_s * 1000,
        peer,
        f" {extras}" if extras else "",
        extra={"fields": line},
    )
