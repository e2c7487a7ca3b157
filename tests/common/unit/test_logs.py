from __future__ import annotations

import json
import logging
import os
import sys

from modelyard.process import calls, logs
from modelyard.process.logs import JsonFormatter


def _record(msg: str = "model %s failed", *args: object) -> logging.LogRecord:
    return logging.LogRecord("service.x", logging.ERROR, __file__, 1, msg, args or ("m",), None)


def test_json_lines_carry_ts_level_logger_msg_process_and_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record()
        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter("sidecar").format(record))
    assert entry["level"] == "ERROR" and entry["logger"] == "service.x"
    assert entry["msg"] == "model m failed" and entry["process"] == "sidecar" and entry["pid"] == os.getpid()
    assert "ValueError: boom" in entry["exception"] and entry["ts"].endswith("Z")
    assert "method" not in entry  # outside a call: no call fields


def test_a_line_written_during_a_call_carries_the_calls_fields() -> None:
    formatter = JsonFormatter("service")
    with calls.call("/modelyard.inference.v1.InferenceService/Infer", "req-7"):
        calls.note(model="scaler", version="")  # an unknown version is left out, not written empty
        early = json.loads(formatter.format(_record()))
        calls.note(version="2")
        late = json.loads(formatter.format(_record()))
    after = json.loads(formatter.format(_record()))
    assert early["method"].endswith("/Infer") and early["request_id"] == "req-7"
    assert early["model"] == "scaler" and "version" not in early
    assert late["version"] == "2"
    assert "method" not in after and "model" not in after


def test_a_records_own_fields_are_merged() -> None:
    record = _record()
    record.fields = {"code": "NOT_FOUND", "duration_ms": 1.5}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["code"] == "NOT_FOUND" and entry["duration_ms"] == 1.5


def test_json_lines_carry_the_ids_a_tracing_source_finds(monkeypatch) -> None:
    found: list[tuple[str, str] | None] = [None]
    monkeypatch.setattr(logs, "_trace_sources", ())  # as a process that does not trace
    assert "trace_id" not in json.loads(JsonFormatter().format(_record()))
    logs.join_traces(lambda: found[0])
    logs.join_traces(lambda: ("0" * 31 + "2", "0" * 15 + "2"))  # asked only when the first finds none
    found[0] = ("0" * 31 + "1", "0" * 15 + "1")
    entry = json.loads(JsonFormatter().format(_record()))
    assert (entry["trace_id"], entry["span_id"]) == ("0" * 31 + "1", "0" * 15 + "1")
    found[0] = None
    assert json.loads(JsonFormatter().format(_record()))["trace_id"] == "0" * 31 + "2"
    record = _record()
    record.trace_id, record.span_id = "a" * 32, "b" * 16  # a record's own win
    assert json.loads(JsonFormatter().format(record))["trace_id"] == "a" * 32
