"""Logging set-up for every process: readable text for a terminal, one JSON object per line for
log collectors.

Every process writes the same JSON fields: `ts` (UTC, ms), `level`, `logger`, `msg`, `process`
(service, worker N, sidecar, gateway, up) and `pid`; during a call, the call's `method`,
`request_id`, `model` and `version` as far as they are known (modelyard.process.calls); a
record's own `fields` (the access log's code, duration_ms, peer, reason); `trace_id` / `span_id`
of the call's span while a traced call is handled (its access line too), so log lines join
their traces; `exception` with its traceback.

The ids come from the tracing of the process (`join_traces`: the service's and the sidecar's
tracing register where their call's span is found when tracing is on). The formatter asks at
each line; a process that does not trace registers nothing, and its lines cost one global read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
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
# Where the current call's (trace id, span id) are found, as 32 and 16 hex digits (None: no call
# is traced here); empty while nothing traces in this process.
TraceIds = Callable[[], tuple[str, str] | None]
_trace_sources: tuple[TraceIds, ...] = ()


def join_traces(source: TraceIds) -> None:
    """Have JSON lines carry the ids `source` finds (a process's tracing calls it when tracing is
    on; sources are asked in order, the first that finds ids gives them)."""
    global _trace_sources
    if source not in _trace_sources:
        _trace_sources = (*_trace_sources, source)


def trace_ids() -> tuple[str, str] | None:
    """The current call's (trace id, span id) from the registered sources, or None."""
    for source in _trace_sources:
        found = source()
        if found is not None:
            return found
    return None


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
        for name in _TRACE_FIELDS:  # a record may carry its own
            value = getattr(record, name, None)
            if value:
                entry[name] = value
        if _trace_sources and "trace_id" not in entry:
            found = trace_ids()
            if found is not None:
                entry["trace_id"], entry["span_id"] = found
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
