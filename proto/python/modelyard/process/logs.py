"""Logging set-up for every process: readable text for a terminal, one JSON object per line for
log collectors. A record that carries `trace_id` / `span_id` attributes (set by a tracing filter)
has them in its JSON object, so log lines join their traces."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Annotated, Literal

from msgspec import Meta

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Every process's log settings (`log_level: logs.Level = "INFO"`), for modelyard.process.settings.
Level = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="log level")]
Format = Annotated[Literal["text", "json"], Meta(description="log format: json is one object per line")]
_TRACE_FIELDS = ("trace_id", "span_id")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _TRACE_FIELDS:
            value = getattr(record, name, None)
            if value:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def quiet_grpc_core() -> None:
    """gRPC core logs every failed TLS handshake (and other per-connection events) at INFO, one line
    per connection attempt that any client can cause. Keep it to errors unless the operator sets
    GRPC_VERBOSITY. Call before grpc is imported: the core reads it once."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
