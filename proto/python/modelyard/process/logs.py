"""Logging set-up for every process: readable text for a terminal, one JSON object per line for
log collectors.

Every process writes the same JSON fields: `ts` (UTC, ms), `level`, `logger`, `msg`, `process`
(service, worker N, sidecar, gateway, up) and `pid`; during a call, the call's `method`,
`request_id`, `model` and `version` as far as they are known (modelyard.process.calls); a
record's own `fields` (the access log's code, duration_ms, peer, reason); `trace_id` / `span_id`
when a tracing filter set them, so log lines join their traces; `exception` with its traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Annotated, Literal

from msgspec import Meta

from modelyard.process import calls

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Every process's log settings (`log_level: logs.Level = "INFO"`), for modelyard.process.settings.
Level = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="log level")]
Format = Annotated[Literal["text", "json"], Meta(description="log format: json is one object per line")]
AccessLog = Annotated[
    bool, Meta(description="log one line per call (method, code, reason, duration, peer, model, version)")
]
_TRACE_FIELDS = ("trace_id", "span_id")


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process
        self.pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "process": self.process,
            "pid": self.pid,
        }
        entry.update(calls.current())
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        for name in _TRACE_FIELDS:
            value = getattr(record, name, None)
            if value:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str, process: str = "") -> None:
    """Logs to stderr at `level` in `fmt`; `process` names this process in JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def quiet_grpc_core() -> None:
    """gRPC core logs every failed TLS handshake (and other per-connection events) at INFO, one line
    per connection attempt that any client can cause. Keep it to errors unless the operator sets
    GRPC_VERBOSITY. Call before grpc is imported: the core reads it once."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
