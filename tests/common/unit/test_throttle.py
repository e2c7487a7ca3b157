"""Rate-limited log lines and INTERNAL error ids."""

from __future__ import annotations

import logging
import re

import pytest

from modelyard.process.throttle import LogThrottle
from modelyard.service.api.errors import internal_error


def test_throttle_lets_a_burst_through_per_window_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("t"), burst=3, window_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO)
    sent = [throttle.log(logging.WARNING, "bad request %d", i) for i in range(10)]
    assert sent == [True] * 3 + [False] * 7
    now[0] = 10.0
    assert throttle.log(logging.WARNING, "bad request %d", 10)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:3] == ["bad request 0", "bad request 1", "bad request 2"]
    assert messages[3:] == ["bad request 10 (7 similar lines left out)"]


def test_internal_errors_carry_an_id_the_log_has_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        message = internal_error("Infer", "m", "", exc)
    match = re.search(r"error id ([0-9a-f]{12})", message)
    assert match is not None and "boom" not in message
    (record,) = caplog.records
    assert match.group(1) in record.getMessage() and record.exc_info is not None
