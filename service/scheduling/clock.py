"""The time that queues and batchers see, behind a small protocol so tests can step it by hand."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale, and a wait that ends early when something happens."""

    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, until: float | None) -> None:
        """Return when `event` is set or, at the latest, once `now() >= until` (never, if None).
        Waking early is allowed: callers re-check their state after every wait. It always yields to
        the event loop, even when `until` has passed, so that a caller's loop cannot starve it."""
        ...


class MonotonicClock:
    """time.monotonic, with timed waits on the event loop's timer (no task per wait)."""

    # time.monotonic itself, not a method that calls it: read on every request a queue admits.
    now = staticmethod(time.monotonic)

    async def wait(self, event: asyncio.Event, until: float | None) -> None:
        if until is None:
            await event.wait()
            return
        delay = until - time.monotonic()
        if delay <= 0:
            await asyncio.sleep(0)
            return
        # A timer that sets the event is cheaper than asyncio.wait_for, which makes a task per call;
        # the caller clears the event before it looks at its state again.
        timer = asyncio.get_running_loop().call_later(delay, event.set)
        try:
            await event.wait()
        finally:
            timer.cancel()
