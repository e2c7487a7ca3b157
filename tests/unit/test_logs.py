from __future__ import annotations

import json
import logging

from modelyard.process.logs import JsonFormatter


def test_json_lines_carry_level_logger_message_and_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("service.x", logging.ERROR, __file__, 1, "model %s failed", ("m",), None)
        import sys

        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "ERROR" and entry["logger"] == "service.x"
    assert entry["message"] == "model m failed"
    assert "ValueError: boom" in entry["exception"] and entry["time"].endswith("Z")
