"""Rate-limited logging: lines a client can cause (bad requests, denials) must not flood the log.

At most `burst` lines per `window_s` seconds go out; the rest are counted, and the next line that
goes out says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class LogThrottle:
    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 10,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = -window_s
        self._left = 0
        self.suppressed = 0  # lines left out since the last one that went out

    def log(self, level: int, message: str, *args: object) -> bool:
        """Log one line unless this window's lines are spent; True when it went out."""
        if not self._logger.isEnabledFor(level):
            return False
        with self._lock:
            now = self._clock()
            if now - self._window_start >= self._window_s:
                self._window_start, self._left = now, self._burst
            if self._left <= 0:
                self.suppressed += 1
                return False
            self._left -= 1
            suppressed, self.suppressed = self.suppressed, 0
        if suppressed:
            message += f" ({suppressed} similar lines left out)"
        self._logger.log(level, message, *args)
        return True
